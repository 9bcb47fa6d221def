"""Prefill saved by routing: what the fleet computed against what round robin would have.

Per served request the real side is exact: the replica computed
``prompt_tokens - cached_tokens`` (its own report). The round-robin side is
the sampled shadow's estimate (``routing.shadow``): the replica round robin
would have used, and the prompt tokens it would have computed there. Both are
also counted in GPU-seconds, each at its replica's prefill rate, the one
routing learns from the replica's histograms (``routing.rates``; a replica
that has not said yet is given the mean of those that have, and before any
has, seconds are not counted). Totals are kept per tenant and per replica:
per replica, what it computed and what round robin would have had it compute.

The request's blocks are the ones routing already hashed (hashed once per
request): the token-block keys when the request carries token ids (precise
mode's keys, ``routing.token_keys``: vLLM's blocks exactly), else the
routing blocks of its canonical stream (``routing.keys.analyse``, cached in
the request's scratch), converted to tokens at the request's own ratio of
prompt tokens to bytes. Pure: no I/O, no clock but the CPU timer that measures
its own cost.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import NamedTuple, Sequence

from .base import ReplicaView, RouteRequest
from .keys import analyse
from .settings import RoutingSettings
from .shadow import ShadowFleet
from .token_keys import block_keys

__all__ = ["PrefillCounters", "SavingsLedger", "Served", "request_blocks"]

# Where precise mode keeps a request's token-block keys (``routing.kv_events``): reused, not rehashed.
_TOKEN_KEYS = "kvgate.block_keys"
_SHADOW_KEYS = "kvgate.shadow_keys"
# Rows kept per table: tenants beyond it fold into one (a tenant per request cannot grow memory).
_MAX_ROWS = 10_000
_OTHER = "(other)"


def request_blocks(request: RouteRequest, settings: RoutingSettings) -> tuple[list[int], float | None]:
    """The request's chained block hashes, and the tokens each stands for (None: a routing block
    of ``block_chars`` bytes, converted by the caller at the request's own ratio)."""
    tokens = request.token_ids
    if tokens:
        keys = request.scratch.get(_TOKEN_KEYS) or request.scratch.get(_SHADOW_KEYS)
        if keys is None:
            salt = request.body.get("cache_salt")
            keys = request.scratch[_SHADOW_KEYS] = block_keys(tokens, settings.block_size,
                                                               salt if isinstance(salt, str) else None)
        return keys, float(settings.block_size)
    return analyse(request, settings).hashes, None


@dataclass
class PrefillCounters:
    requests: int = 0
    prompt_tokens: int = 0
    computed_tokens: int = 0  # what the replicas computed (prompt - cached, as they reported)
    rr_computed_tokens: float = 0.0  # what round robin would have computed (the shadow's estimate)
    computed_s: float = 0.0  # the same at each replica's prefill rate
    rr_computed_s: float = 0.0

    def row(self) -> dict[str, float | int | None]:
        out: dict[str, float | int | None] = {k: round(v, 3) if isinstance(v, float) else v
                                              for k, v in asdict(self).items()}
        out["saved_tokens"] = round(self.rr_computed_tokens - self.computed_tokens, 1)
        out["saved_s"] = round(self.rr_computed_s - self.computed_s, 3)
        out["saved_share"] = (round(1 - self.computed_tokens / self.rr_computed_tokens, 4)
                              if self.rr_computed_tokens > 0 else None)
        return out


class Served(NamedTuple):
    """One request's two sides (for metrics)."""

    rr_replica: str
    computed_tokens: int
    rr_computed_tokens: float
    computed_s: float | None
    rr_computed_s: float | None


def _rates(fleet: Sequence[ReplicaView]) -> dict[str, float]:
    known = {r.name: r.prefill_rate for r in fleet if r.prefill_rate}
    if not known:
        return {}
    mean = sum(known.values()) / len(known)
    return {r.name: known.get(r.name, mean) for r in fleet}  # type: ignore[misc]


class SavingsLedger:
    """The shadow, and per tenant and per replica totals of both sides."""

    def __init__(self, settings: RoutingSettings | None = None, rate: float = 1 / 16) -> None:
        self.settings = settings or RoutingSettings()
        self.shadow = ShadowFleet(rate)
        self.tenants: dict[str, PrefillCounters] = {}
        self.replicas: dict[str, PrefillCounters] = {}
        # Tokens per routing block, learned from usage (sum of prompt tokens / sum of blocks):
        # sizes the shadow of a pool given in tokens when blocks are routing blocks.
        self._tokens_seen = 0.0
        self._blocks_seen = 0.0
        self.cpu_s = 0.0  # time spent in ``served``, for the per-request figure

    def served(self, request: RouteRequest, tenant: str, replica: str, fleet: Sequence[ReplicaView],
               prompt_tokens: int, cached_tokens: int) -> Served | None:
        """Account one request served by ``replica``; ``fleet``: the replicas round robin would
        have rotated over (the eligible ones). None when it had no prompt to count."""
        started = time.perf_counter()
        try:
            return self._served(request, tenant, replica, fleet, prompt_tokens, cached_tokens)
        finally:
            self.cpu_s += time.perf_counter() - started

    def _served(self, request: RouteRequest, tenant: str, replica: str, fleet: Sequence[ReplicaView],
                prompt_tokens: int, cached_tokens: int) -> Served | None:
        if prompt_tokens <= 0:
            return None
        names = [r.name for r in fleet] or [replica]
        rr = self.shadow.place(names) or replica
        blocks, per_block = request_blocks(request, self.settings)
        if per_block is None:  # routing blocks: this request's own tokens per block
            size = len(analyse(request, self.settings).rendered.data)
            per_block = prompt_tokens * self.settings.block_chars / size if size else 0.0
            self._tokens_seen += prompt_tokens * min(1.0, len(blocks) * self.settings.block_chars / size) \
                if size else 0.0
            self._blocks_seen += len(blocks)
            mean_block = self._tokens_seen / self._blocks_seen if self._blocks_seen else None
        else:
            mean_block = per_block
        view = next((r for r in fleet if r.name == rr), None)
        pool = view.kv_tokens if view is not None else None
        capacity = pool / mean_block if pool and mean_block else None
        hit_blocks = self.shadow.serve(rr, blocks, capacity) if blocks else 0.0
        # vLLM computes at least the last token: hits stop at the last full block before it.
        bs = self.settings.block_size
        hit = min(hit_blocks * per_block, float((prompt_tokens - 1) // bs * bs))
        rr_computed = prompt_tokens - hit
        computed = max(0, prompt_tokens - max(0, cached_tokens))
        rates = _rates(fleet)
        real_rate, rr_rate = rates.get(replica), rates.get(rr)
        computed_s = computed / real_rate if real_rate else None
        rr_s = rr_computed / rr_rate if rr_rate else None
        for row in (self._row(self.tenants, tenant),):
            self._add(row, prompt_tokens, computed, rr_computed, computed_s, rr_s)
        real, shadow = self._row(self.replicas, replica), self._row(self.replicas, rr)
        real.requests += 1
        real.prompt_tokens += prompt_tokens
        real.computed_tokens += computed
        real.computed_s += computed_s or 0.0
        shadow.rr_computed_tokens += rr_computed
        shadow.rr_computed_s += rr_s or 0.0
        if len(self.replicas) > 2 * len(names) + 8:
            self.shadow.retain(names)
        return Served(rr, computed, rr_computed, computed_s, rr_s)

    @staticmethod
    def _add(row: PrefillCounters, prompt: int, computed: int, rr: float, computed_s: float | None,
             rr_s: float | None) -> None:
        row.requests += 1
        row.prompt_tokens += prompt
        row.computed_tokens += computed
        row.rr_computed_tokens += rr
        # Seconds only where both sides have a rate, so the two columns compare like with like.
        if computed_s is not None and rr_s is not None:
            row.computed_s += computed_s
            row.rr_computed_s += rr_s

    @staticmethod
    def _row(table: dict[str, PrefillCounters], name: str) -> PrefillCounters:
        row = table.get(name)
        if row is None:
            if len(table) >= _MAX_ROWS:
                name = _OTHER
            row = table.setdefault(name, PrefillCounters())
        return row

    def totals(self) -> PrefillCounters:
        out = PrefillCounters()
        for row in self.tenants.values():
            for k, v in asdict(row).items():
                setattr(out, k, getattr(out, k) + v)
        return out

    def to_dict(self) -> dict[str, object]:
        requests = self.totals().requests
        entries = self.shadow.entries()
        return {
            "totals": self.totals().row(),
            "tenants": [{"name": n, **c.row()} for n, c in sorted(self.tenants.items())],
            "replicas": [{"name": n, **c.row()} for n, c in sorted(self.replicas.items())],
            "shadow": {"sample_rate": self.shadow.rate, "entries": entries,
                       "memory_bytes": self.shadow.memory_bytes(),
                       "cpu_us_per_request": round(self.cpu_s / requests * 1e6, 2) if requests else None},
        }
