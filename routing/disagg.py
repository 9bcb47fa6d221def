"""Disaggregated prefill (P/D): remote prefill or local, per request. Pure.

In a P/D fleet a request can be served two ways once its decode replica is
chosen (routing picks it like any other: its own held blocks, its load):

* **local**: the decode replica prefills the prompt itself, as a ``both``
  replica would;
* **remote**: a prefill replica computes the prompt (the router's first leg,
  ``max_tokens`` 1), and the decode replica pulls the KV blocks it lacks
  (vLLM's NixlConnector) before it streams.

What each costs, in seconds, from named terms (``Terms``):

    local_s   = uncached_decode / rate_decode
    stall_s   = decoding x local_s
    transfer_s = uncached_decode x transfer_s_per_token
    prefill_s = uncached_prefill / rate_prefill
    remote_s  = prefill_wait_s + prefill_s + transfer_s + leg_s

* ``local_s`` is the request's own prefill where it decodes; ``stall_s`` is what
  that prefill costs the ``decoding`` requests already running there: each
  waits through the step that computes it (the interference P/D exists to
  remove; Little's law, as ``routing.prefix_affinity`` prices extra prefill).
* the remote path costs the prefill replica's queue ahead (``prefill_wait_s``),
  its own prefill there (of what that replica does not hold), the pull of the
  blocks the decode replica lacks, and the extra leg's fixed round trip
  (``leg_s``).

**The decision.** Remote when ``remote_s < local_s + stall_s``, read as the
issue's two conditions, both reported:

1. *the threshold*: the uncached prompt on the decode replica must exceed
   ``threshold = leg_s / saved_per_token``, where ``saved_per_token =
   (1 + decoding) / rate_decode - transfer_s_per_token - 1 / rate_prefill`` is
   what each token moved off the decode replica saves when the prefill side is
   idle and cold. It is derived from the measured rates alone: a fleet whose
   transfer costs more per token than it saves never disaggregates
   (``threshold`` infinite), a fast transfer lowers it;
2. *the queue*: the prefill replica's queue must be shallower than what the
   transfer saves: ``prefill_wait_s < local_s + stall_s - prefill_s -
   transfer_s - leg_s`` (``headroom_s``).

Where no rate is known yet (no replica has reported one), every figure is in
tokens (a rate of 1) and the transfer's cost per token, which is in seconds,
cannot be compared: it is taken as 0, and so is ``leg_s`` (the gateway's priors,
``gateway.proxy.disagg``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["Terms", "Decision", "decide"]


@dataclass(frozen=True, slots=True)
class Terms:
    """What the decision reads, each from one source (``gateway.proxy.disagg``)."""

    # Prompt tokens the chosen decode replica would compute itself (routing's estimate).
    uncached_decode: float
    # Prompt tokens the chosen prefill replica would compute (routing's estimate there).
    uncached_prefill: float
    # Prefill rates (prompt tokens per prefill-second, routing.rates); None: not known yet.
    rate_decode: float | None
    rate_prefill: float | None
    # Requests running at the decode replica (its reported load): each waits through a local prefill.
    decoding: float
    # Prefill already queued ahead at the prefill replica, in seconds (tokens where no rate is known).
    prefill_wait_s: float
    # Seconds a decode replica takes per token it pulls (learned from decode legs).
    transfer_s_per_token: float
    # The extra leg's fixed round trip in seconds (learned from prefill legs).
    leg_s: float


@dataclass(frozen=True, slots=True)
class Decision:
    remote: bool
    reason: str  # "remote", "below_threshold", "prefill_queue", "no_prefill_replica", ...
    local_s: float
    stall_s: float
    prefill_s: float
    transfer_s: float
    remote_s: float
    saved_per_token: float
    threshold: float  # uncached decode tokens past which a remote prefill pays (inf: never)
    headroom_s: float  # what the remote path saves before the prefill replica's queue

    def as_dict(self) -> dict[str, Any]:
        return {name: _finite(getattr(self, name)) for name in self.__slots__}


def _finite(v: Any) -> Any:
    return None if isinstance(v, float) and math.isinf(v) else v


def decide(t: Terms) -> Decision:
    """Remote prefill or local, from the terms alone."""
    timed = t.rate_decode is not None and t.rate_prefill is not None
    rate_d = t.rate_decode if timed and t.rate_decode else 1.0
    rate_p = t.rate_prefill if timed and t.rate_prefill else 1.0
    # Seconds per token cannot be mixed with figures in tokens (no rate known yet).
    per_token = t.transfer_s_per_token if timed else 0.0
    leg = t.leg_s if timed else 0.0
    uncached_d = max(0.0, t.uncached_decode)
    local_s = uncached_d / rate_d
    stall_s = max(0.0, t.decoding) * local_s
    prefill_s = max(0.0, t.uncached_prefill) / rate_p
    transfer_s = uncached_d * per_token
    wait = max(0.0, t.prefill_wait_s)
    remote_s = wait + prefill_s + transfer_s + leg
    saved = (1.0 + max(0.0, t.decoding)) / rate_d - per_token - 1.0 / rate_p
    threshold = leg / saved if saved > 0 else math.inf
    headroom = local_s + stall_s - prefill_s - transfer_s - leg
    # One rule, ``wait < headroom`` (remote_s < local_s + stall_s); the reason says which of
    # the two conditions failed. Below the threshold headroom is at most 0 unless the prefill
    # replica holds more of the prompt than the decode replica (a warmer prefill side may pay).
    # Ties go local (one leg, not two), and so does a gain within rounding of the sums above.
    margin = 1e-9 * (local_s + stall_s)
    if uncached_d <= 0.0:
        reason = "nothing_uncached"
    elif headroom <= margin:
        # Past the threshold with no gain: the prefill replica would compute more than the decode one.
        reason = "below_threshold" if uncached_d <= threshold else "prefill_colder"
    elif wait >= headroom - margin:
        reason = "prefill_queue"
    else:
        reason = "remote"
    return Decision(reason == "remote", reason, local_s, stall_s, prefill_s, transfer_s, remote_s, saved,
                    threshold, headroom)
