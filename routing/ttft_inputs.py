"""The ``ttft`` policy's inputs from what the replicas report, and the terms of a decision.

Pure functions of the replica views (``routing.base.ReplicaView``) and one learned mean:
each replica's prefill rate, the requests it reported waiting and the other instances'
share of the queues, the wait for a seat, and where a home stands in a key's order. The
formula that combines them, and what it learns, is ``routing.ttft_affinity``'s.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple, Sequence

from .base import ReplicaView, others_reported, reported

__all__ = ["Mean", "Terms", "home_index", "known_rates", "seat_wait", "waiting_and_share"]

# The learned means (uncached prompt per request, the prediction's error) are over this
# many recent requests: a mean of 256 samples settles within about 1/16 of its spread,
# and a change of load replaces it within a few seconds of traffic.
_ERROR_WINDOW = 256


class Terms(NamedTuple):
    """One replica's figures in one decision (``explain``; seconds, or tokens before any rate)."""

    replica: str
    rate: float | None  # prompt tokens per prefill-second used (None: figures in tokens)
    held: float  # prompt tokens believed held
    source: str  # where ``held`` came from: events, index, key, home, none
    uncached: float  # prompt tokens it would compute
    ahead: float  # the wait ahead: prefill queued, or a seat (the larger)
    seat: float  # the wait for a seat (0 where its seats are not known or one is free)
    astray: float  # a known-nowhere key placed away from home: its next request's refill
    excess: float  # tokens beyond the fewest any replica would compute, priced by the busy share
    refill: float  # the prefill its evictions cost the fleet later (pools under pressure)
    ttft: float  # the predicted time to first token: ahead + uncached / rate
    cost: float  # what the pick minimises: ttft + astray + excess + refill
    bound: float  # the wait ahead the rail allows here
    rail: str | None  # "wait" (ahead > bound) or None


class Mean:
    """The mean of the last ``_ERROR_WINDOW`` samples (a learned figure, never a setting)."""

    __slots__ = ("_ring", "_sum")

    def __init__(self) -> None:
        self._ring: deque[float] = deque()
        self._sum = 0.0

    def add(self, x: float) -> None:
        self._ring.append(x)
        self._sum += x
        if len(self._ring) > _ERROR_WINDOW:
            self._sum -= self._ring.popleft()

    def __len__(self) -> int:
        return len(self._ring)

    def get(self, default: float) -> float:
        return self._sum / len(self._ring) if self._ring else default

    @property
    def total(self) -> float:
        return self._sum


def seat_wait(r: ReplicaView, hold: float, share: float) -> float:
    """Seconds until one more request finds a seat at ``r``, whose seats are known (0 otherwise).

    vLLM runs at most ``seats`` requests (--max-num-seqs); past them a request waits, whatever
    its prefill, for one to end, and with every seat taken they end ``seats / hold`` a second
    (``hold``: a request's time from its first token to its end). The requests there now: the
    others' as of the last scrape, this instance's now, and what the other instances sent since
    the scrape, taken to be what this one sent since then times ``share / (1 - share)``: they
    decide as it does, on the same facts, so where it sent they sent too. Without that last part
    eight instances each saw the seats a scrape left free and all filled them (MT-bench precise
    x8 p95 182 against 25 ms: docs/benchmarks/routing-ttft.md).
    """
    seats = r.seats
    if not seats or reported(r) is None or hold <= 0.0:
        return 0.0
    since = max(0, r.in_flight - r.in_flight_at_scrape)
    now = others_reported(r) + r.in_flight + (since * share / (1.0 - share) if share < 1.0 else 0.0)
    return (now - seats + 1.0) * hold / seats if now >= seats else 0.0


def home_index(first: ReplicaView, order: list[ReplicaView]) -> int:
    """Where the anchor's first choice stands in the key's order."""
    return next(i for i, r in enumerate(order) if r is first)


def known_rates(replicas: Sequence[ReplicaView]) -> list[float | None]:
    """Each replica's learned prefill rate; one not known yet gets the mean of those known."""
    known = [r.prefill_rate for r in replicas if r.prefill_rate]
    if not known:
        return [None] * len(replicas)
    mean = sum(known) / len(known)  # type: ignore[arg-type]
    return [r.prefill_rate or mean for r in replicas]


def waiting_and_share(replicas: Sequence[ReplicaView]) -> tuple[list[float], float]:
    """The requests each replica reported waiting (per unit weight), and the others' share of the queues.

    *Waiting*: every client's, this instance's included, as of the last
    scrape: requests not yet started, whether for prefill or for a free
    sequence slot (``max_num_seqs``), which this instance's backlog cannot see.

    *The others' share*: of the replicas' reported queues, the part that is not
    this instance's (0 before any report).
    """
    waiting = []
    total = mine = 0.0
    for r in replicas:
        queue = reported(r)
        if queue is None:
            waiting.append(0.0)
            continue
        waiting.append((r.waiting or 0.0) / r.weight)
        total += queue
        mine += min(queue, r.in_flight_at_scrape)
    return waiting, (total - mine) / total if total > 0 else 0.0
