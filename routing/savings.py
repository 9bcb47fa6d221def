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
prompt tokens to bytes, or, where a replica already reported a hit ending at
the same sampled block, at what it reported (``SavingsLedger.worth``). Pure:
no I/O, no clock but the CPU timer that measures its own cost.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import NamedTuple, Sequence

from .base import ReplicaView, RouteRequest
from .keys import analyse
from .settings import RoutingSettings
from .shadow import ENTRY_BYTES, ShadowFleet, sampled
from .token_keys import block_keys

__all__ = ["PrefillCounters", "SavingsLedger", "Served", "budget_rate", "request_blocks"]

# Where precise mode keeps a request's token-block keys (``routing.kv_events``): reused, not rehashed.
_TOKEN_KEYS = "kvgate.block_keys"
_SHADOW_KEYS = "kvgate.shadow_keys"
# The replica round robin gave the request when it was routed (``SavingsLedger.place``).
_RR_REPLICA = "kvgate.rr_replica"
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
        out: dict[str, float | int | None] = {k: round(v, 6) if isinstance(v, float) else v
                                              for k, v in asdict(self).items()}
        out["saved_tokens"] = round(self.rr_computed_tokens - self.computed_tokens, 1)
        out["saved_s"] = round(self.rr_computed_s - self.computed_s, 6)
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


# Sampled blocks a typical prompt should keep: the midpoint's error per prefix end is then under
# 1/64 of the prompt, and the CPU a request costs is about this many LRU moves per shadow, not
# its whole length (a 2,048-block prompt at rate 1: 700 us).
SAMPLES_PER_PROMPT = 32


def budget_rate(entries: int, pool_blocks: float | None, prompt_blocks: float | None = None) -> float:
    """The sample rate: a power of 1/2 (the samples at 1/2^k are a subset of those at 1/2^(k-1)),
    the largest that keeps a replica's shadow within ``entries``, and no larger than leaves
    ``SAMPLES_PER_PROMPT`` of a mean prompt of ``prompt_blocks``; 1 when neither binds."""
    rate = 1.0
    if pool_blocks and pool_blocks > entries:
        rate = 2.0 ** -math.ceil(math.log2(pool_blocks / entries))
    if prompt_blocks and prompt_blocks > 2 * SAMPLES_PER_PROMPT:
        rate = min(rate, 2.0 ** -math.floor(math.log2(prompt_blocks / SAMPLES_PER_PROMPT)))
    return rate


class SavingsLedger:
    """The shadows, and per tenant and per replica totals of both sides.

    Two shadows see the same sampled blocks: ``rr`` places each request by round robin, ``mirror``
    where it really went. The mirror does two things with what the replicas reported
    (``cached_tokens``):

    * where its hit ended at a sampled block, the replica's figure is what a hit ending there is
      worth (``worth``): round robin's hits ending at the same block are counted at it, exact
      whatever the text's density (mtbench's system prompt is denser in tokens than the
      questions after it: at the request's mean density its hits were 10% too long);
    * its estimates, summed, against the reported sum scale round robin's (a ratio estimator):
      what biases both alike (hits shorter than a gap, blocks pinned by running requests)
      cancels.
    """

    def __init__(self, settings: RoutingSettings | None = None, entries: int = 8192,
                 rate: float | None = None) -> None:
        """``entries``: the most sampled blocks a replica's shadow keeps; the rate follows from the
        largest pool (``budget_rate``). ``rate``: a fixed rate instead (benchmarks, tests)."""
        self.settings = settings or RoutingSettings()
        self.budget = entries
        self.fixed = rate
        self.rr = ShadowFleet(rate or 1.0)
        self.mirror = ShadowFleet(rate or 1.0)
        self.tenants: dict[str, PrefillCounters] = {}
        self.replicas: dict[str, PrefillCounters] = {}
        # Tokens per routing block, learned from usage (sum of prompt tokens / sum of blocks):
        # sizes the shadow of a pool given in tokens when blocks are routing blocks.
        self._tokens_seen = 0.0
        self._blocks_seen = 0.0
        # Hashed blocks per request, for the sample rate.
        self._prompts = 0
        self._prompt_blocks = 0
        # What a hit ending at a sampled block is worth, in tokens, as a replica reported it when
        # the mirror's hit ended there (bounded, oldest forgotten first).
        self.worth: OrderedDict[int, int] = OrderedDict()
        # The ratio estimator's sums: tokens the replicas reported cached, and the mirror's estimate.
        self.reported_hits = 0.0
        self.mirror_hits = 0.0
        self.cpu_s = 0.0  # time spent in ``served``, for the per-request figure

    @property
    def shadow(self) -> ShadowFleet:
        return self.rr

    @property
    def correction(self) -> float:
        """Reported over mirrored hits (1 until the mirror has estimated any)."""
        return self.reported_hits / self.mirror_hits if self.mirror_hits > 0 else 1.0

    def place(self, request: RouteRequest, fleet: Sequence[ReplicaView]) -> str | None:
        """Round robin's replica for ``request``, chosen when it is routed, as round robin chooses:
        placed in the order answers complete instead, concurrent requests would be dealt to the
        replicas in another order than round robin's own (which request lands where, a different
        draw each run: 11% apart on 128 requests over real processes, ``bench.savings_e2e``)."""
        started = time.perf_counter()
        name = request.scratch[_RR_REPLICA] = self.rr.place([r.name for r in fleet])
        self.cpu_s += time.perf_counter() - started
        return name

    def served(self, request: RouteRequest, tenant: str, replica: str, fleet: Sequence[ReplicaView],
               prompt_tokens: int, cached_tokens: int) -> Served | None:
        """Account one request served by ``replica``; ``fleet``: the replicas round robin would
        have rotated over (the eligible ones). None when it had no prompt to count."""
        started = time.perf_counter()
        try:
            return self._served(request, tenant, replica, fleet, prompt_tokens, cached_tokens)
        finally:
            self.cpu_s += time.perf_counter() - started

    def _blocks(self, request: RouteRequest, prompt_tokens: int) -> tuple[list[int], float, float, float | None]:
        """The blocks, tokens per block for this request, blocks past the hashed ones, and tokens
        per block for sizing pools (None before any is known)."""
        blocks, per_block = request_blocks(request, self.settings)
        if per_block is not None:
            return blocks, per_block, 0.0, per_block
        size = len(analyse(request, self.settings).rendered.data)
        if not size:
            return blocks, 0.0, 0.0, None
        per_block = prompt_tokens * self.settings.block_chars / size
        self._tokens_seen += prompt_tokens
        self._blocks_seen += size / self.settings.block_chars
        tail = max(0.0, size / self.settings.block_chars - len(blocks))
        return blocks, per_block, tail, self._tokens_seen / self._blocks_seen

    def _size(self, fleet: Sequence[ReplicaView], mean_block: float | None, blocks: int) -> None:
        """Follow the pools and the prompts: the rate ``budget_rate`` gives (the shadows restart when
        it moves: at once when the memory budget needs it, else only for a factor of 4, so a mean
        wandering around a power of 2 does not restart them over and over)."""
        self._prompts += 1
        self._prompt_blocks += blocks
        if self.fixed is not None or mean_block is None:
            return
        largest = max((r.kv_tokens or 0.0 for r in fleet), default=0.0) / mean_block
        memory = budget_rate(self.budget, largest or None)
        rate = min(memory, budget_rate(self.budget, None, self._prompt_blocks / self._prompts))
        current = self.rr.rate
        if memory < current or rate >= 4 * current or rate <= current / 4:
            self.rr.resize(rate)
            self.mirror.resize(rate)

    def _served(self, request: RouteRequest, tenant: str, replica: str, fleet: Sequence[ReplicaView],
                prompt_tokens: int, cached_tokens: int) -> Served | None:
        if prompt_tokens <= 0:
            return None
        names = [r.name for r in fleet] or [replica]
        # Placed when routed (``place``); a caller that did not place it: now, in answer order.
        rr = request.scratch.get(_RR_REPLICA) or self.rr.place(names) or replica
        blocks, per_block, tail, mean_block = self._blocks(request, prompt_tokens)
        self._size(fleet, mean_block, len(blocks))
        pools = {r.name: r.kv_tokens / mean_block if r.kv_tokens and mean_block else None for r in fleet}
        keep = sampled(blocks, self.rr.threshold)
        # vLLM computes at least the last token: hits stop at the last full block before it.
        bs = self.settings.block_size
        most = float((prompt_tokens - 1) // bs * bs)
        cached = min(max(0, cached_tokens), prompt_tokens)
        rr_hit = self._hit(self.rr, rr, blocks, pools, tail, keep, per_block, most)
        mirrored = self._hit(self.mirror, replica, blocks, pools, tail, keep, per_block, most)
        self.reported_hits += cached
        self.mirror_hits += mirrored
        if self.mirror.boundary is not None and cached:
            self.worth[self.mirror.boundary] = cached
            self.worth.move_to_end(self.mirror.boundary)
            if len(self.worth) > self.budget:
                self.worth.popitem(last=False)
        rr_computed = prompt_tokens - min(rr_hit * self.correction, most)
        computed = prompt_tokens - cached
        rates = _rates(fleet)
        real_rate, rr_rate = rates.get(replica), rates.get(rr)
        computed_s = computed / real_rate if real_rate else None
        rr_s = rr_computed / rr_rate if rr_rate else None
        self._add(self._row(self.tenants, tenant), prompt_tokens, computed, rr_computed, computed_s, rr_s)
        real, shadow = self._row(self.replicas, replica), self._row(self.replicas, rr)
        real.requests += 1
        real.prompt_tokens += prompt_tokens
        real.computed_tokens += computed
        real.computed_s += computed_s or 0.0
        shadow.rr_computed_tokens += rr_computed
        shadow.rr_computed_s += rr_s or 0.0
        if len(self.replicas) > 2 * len(names) + 8:
            self.rr.retain(names)
            self.mirror.retain(names)
        return Served(rr, computed, rr_computed, computed_s, rr_s)

    def _hit(self, shadow: ShadowFleet, replica: str, blocks: list[int], pools: dict[str, float | None],
             tail: float, keep: list[int], per_block: float, most: float) -> float:
        """Prompt tokens ``shadow`` estimates ``replica`` holds: what a replica reported for a hit
        ending at the same sampled block, when one did (exact, whatever the text's density);
        else the blocks at this request's tokens per block."""
        if not blocks:
            shadow.boundary = None
            return 0.0
        got = shadow.serve(replica, blocks, pools.get(replica), tail, keep)
        known = self.worth.get(shadow.boundary) if shadow.boundary is not None else None
        return float(min(known, most)) if known is not None else min(got * per_block, most)

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
        return {
            "totals": self.totals().row(),
            "tenants": [{"name": n, **c.row()} for n, c in sorted(self.tenants.items())],
            "replicas": [{"name": n, **c.row()} for n, c in sorted(self.replicas.items())],
            "shadow": {"sample_rate": self.rr.rate, "entries": self.rr.entries(),
                       "mirror_entries": self.mirror.entries(),
                       # Both shadows and the worth table (an entry each, of the same size).
                       "memory_bytes": self.rr.memory_bytes() + self.mirror.memory_bytes()
                       + len(self.worth) * ENTRY_BYTES,
                       "correction": round(self.correction, 4),
                       "cpu_us_per_request": round(self.cpu_s / requests * 1e6, 2) if requests else None},
        }
