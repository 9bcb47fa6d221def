"""What kvgate saved the fleet, per tenant and per replica: ``GET /admin/savings``, metrics, the status page.

Two sources:

* **routing**: the prefill the fleet computed against what round robin would
  have computed for the same requests (``routing.savings``: exact on our side,
  the sampled shadow's estimate on round robin's), in tokens and GPU-seconds;
* **the semantic cache**: an answer served from it sent the replicas no
  prompt and generated no completion. Its stored usage says how many tokens
  each; the decode seconds saved are its completion tokens at the decode time
  per token this gateway measured on the streams it relayed (from a stream's
  first token to its end, over its tokens after the first; the mean over all
  of them, so a long answer weighs as its tokens). Before any stream has been
  measured, no seconds are counted: a guessed figure would be worse than none.

Both are recorded after an answer (never before forwarding), and each worker
process keeps its own (the Prometheus counters sum over workers).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Sequence

from routing import ReplicaView, RouteRequest, RoutingSettings
from routing.savings import SavingsLedger

from .metrics import Metrics

if TYPE_CHECKING:
    from gateway.proxy.relay import Outcome

__all__ = ["Savings", "CacheSavings"]

_MAX_TENANTS = 10_000


@dataclass
class CacheSavings:
    hits: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    decode_s: float = 0.0


class Savings:
    def __init__(self, routing: RoutingSettings, metrics: Metrics, entries: int) -> None:
        self.ledger = SavingsLedger(routing, entries=entries)
        self.metrics = metrics
        self.cache: dict[str, CacheSavings] = {}
        self._decode_s = 0.0
        self._decode_tokens = 0

    @property
    def decode_s_per_token(self) -> float | None:
        return self._decode_s / self._decode_tokens if self._decode_tokens else None

    def routed(self, route: RouteRequest, fleet: Sequence[ReplicaView]) -> None:
        """A request is being routed: round robin's replica for it, in routing order (``SavingsLedger.place``)."""
        self.ledger.place(route, fleet)

    def served(self, route: RouteRequest, tenant: str, replica: str, fleet: Sequence[ReplicaView],
               outcome: "Outcome", started: float) -> None:
        """A replica answered: both sides of its prefill, and (a stream) its decode time per token."""
        usage = outcome.usage
        if usage is None or not usage.prompt_tokens or outcome.failure is not None:
            return
        if outcome.ttft_s is not None and outcome.complete and (usage.completion_tokens or 0) > 1:
            self._decode_s += max(0.0, time.perf_counter() - started - outcome.ttft_s)
            self._decode_tokens += usage.completion_tokens - 1  # type: ignore[operator]
        got = self.ledger.served(route, tenant, replica, fleet, usage.prompt_tokens, usage.cached_tokens or 0)
        if got is None:
            return
        tokens, seconds = self.metrics.prefill_tokens, self.metrics.prefill_seconds
        tokens.labels("actual", replica, tenant).inc(got.computed_tokens)
        tokens.labels("round_robin", got.rr_replica, tenant).inc(got.rr_computed_tokens)
        if got.computed_s is not None:
            seconds.labels("actual", replica, tenant).inc(got.computed_s)
        if got.rr_computed_s is not None:
            seconds.labels("round_robin", got.rr_replica, tenant).inc(got.rr_computed_s)

    def cache_hit(self, tenant: str, prompt_tokens: int, completion_tokens: int) -> None:
        """An answer served from the semantic cache: its tokens were never sent to a replica."""
        row = self.cache.get(tenant)
        if row is None:
            if len(self.cache) >= _MAX_TENANTS:
                self.cache.pop(next(iter(self.cache)))
            row = self.cache[tenant] = CacheSavings()
        per_token = self.decode_s_per_token
        decode = completion_tokens * per_token if per_token is not None else 0.0
        row.hits += 1
        row.prompt_tokens += prompt_tokens
        row.completion_tokens += completion_tokens
        row.decode_s += decode
        saved = self.metrics.semantic_saved
        saved.labels("prompt", tenant).inc(prompt_tokens)
        saved.labels("completion", tenant).inc(completion_tokens)
        if decode:
            self.metrics.semantic_saved_decode.labels(tenant).inc(decode)

    def to_dict(self) -> dict[str, object]:
        routing = self.ledger.to_dict()
        tenants = {row["name"]: row for row in routing["tenants"]}  # type: ignore[attr-defined]
        out_tenants = []
        for name in sorted(set(tenants) | set(self.cache)):
            cache = self.cache.get(name, CacheSavings())
            prefill = {k: v for k, v in tenants.get(name, {}).items() if k != "name"}
            out_tenants.append({"name": name, "prefill": prefill or None, "semantic_cache": _cache_row(cache)})
        total = CacheSavings()
        for row in self.cache.values():
            for k, v in asdict(row).items():
                setattr(total, k, getattr(total, k) + v)
        per_token = self.decode_s_per_token
        return {
            "totals": {"prefill": routing["totals"], "semantic_cache": _cache_row(total)},
            "tenants": out_tenants,
            "replicas": routing["replicas"],
            "shadow": routing["shadow"],
            "decode_s_per_token": round(per_token, 9) if per_token is not None else None,
        }


def _cache_row(row: CacheSavings) -> dict[str, float | int]:
    return {**asdict(row), "decode_s": round(row.decode_s, 6)}
