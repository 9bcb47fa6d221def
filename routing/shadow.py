"""What round robin would have computed: a sampled shadow of the fleet's prefix caches.

kvgate knows exactly what the fleet computed for each request (the replica
reports ``prompt_tokens`` and ``cached_tokens``). To say what routing saved it
needs the counterfactual: the prefill the same requests would have cost under
round robin, on the same replicas with the same pools. That is estimated
online, per request, by a shadow of the fleet under round-robin placement.

**Sampling (SHARDS).** Keeping every block of every pool would cost as much
memory as the block index. So, as SHARDS does for miss-ratio curves
(Waldspurger et al., FAST '15), the shadow keeps a fixed fraction ``R`` of the
block hashes, chosen *by hash*: a block is sampled iff ``hash mod 2^24 <
R x 2^24``. Every replica, every request and every gateway instance therefore
samples the same blocks, and each replica's shadow is an LRU of the sampled
blocks with ``R`` times its pool's capacity in blocks: a sampled block is in
the shadow exactly when, in a full LRU of the pool's size, it would be (the
sampled stream is the full one thinned at random, so its reuse distances are
the full ones times ``R``).

**Placement.** Round robin over the eligible replicas sorted by name, in the
order ``place`` is called (``routing.savings`` calls it as kvgate routes each
request), as ``routing.round_robin`` rotates.

**From sampled blocks to a hit.** vLLM's prefix cache hits a chained prefix:
block ``j`` hits only if blocks ``0..j-1`` do, and a replica evicts a
request's tail before its head, so what a replica holds of a prompt is its
first ``h`` blocks. The shadow sees only the sampled positions, and the head
(position 0, always kept: below): ``d``, the deepest of them found in the
replica's shadow, and ``m``, the next sampled position (which missed) or the
prompt's end. So ``d < h <= m``, and the estimate is

    h_est = (d + 1 + m) / 2      (0 when the head missed: the prompt is cold)

Why the midpoint: whether a position is sampled depends only on its hash,
so the sampled positions are a Bernoulli(R) thinning independent of where the
hit ends. Given ``d`` and ``m``, the unsampled run before the end of the hit
and the one after it have probabilities ``(1-R)^a`` and ``(1-R)^b`` with
``a + b`` fixed, so every split is equally likely: ``h`` is uniform on
``d+1..m``, and the midpoint is its mean. The estimate is unbiased wherever a
sampled block hit; its error is within half a gap (about ``1 / 2R`` blocks)
per distinct prefix end, and errors of different prefixes cancel.

**The head.** A prompt's first block is kept whether its hash samples it or
not, weighing ``R`` in the pool's room (a sampled block stands for ``1/R``
blocks, the head for itself), so a miss there is a cold prompt, counted as
computed in full, and a hit shorter than the first sampled position is seen
and estimated at the midpoint like any other. Without it such a hit counted
0: on a trace whose prompts share only a 512-token head (mooncake's, over
real processes) no sampled block fell in it at 1/16, no hit was seen at all,
and round robin's estimate was every prompt token. Heads cost an entry each,
so the entries are bounded too (twice the room), against many short distinct
prompts.

The counting estimator (sampled hits / R, each sampled block standing for
1/R) is unbiased too, but one shared prefix's sample count is one draw for
every request that shares it: a 500-block system prompt at R = 1/16 is
counted 17% off (one standard deviation), the same way for all its requests.
The midpoint's error does not grow with the prefix.

**The rate** is chosen by ``routing.savings.budget_rate``, a power of 1/2: the
largest that keeps each replica's shadow within a memory budget (8,192
entries, about 1.1 MB, twice with the mirror), and no larger than leaves 32 sampled blocks in a mean
prompt. The first bounds memory; the second the error (half a gap per prefix
end: under 1/64 of a prompt) and the CPU (about 32 LRU moves a request,
whatever its length). Rates above it buy nothing measurable: on the routing
benchmark's workloads the error at 1/4 and at 1/64 differed by under two
points where prompts are long (``bench/savings.py --rates``), and short prompts get
rate 1.

What the shadow cannot see (``routing.savings`` corrects for what biases it
alike under both placements, with a second shadow at the real placement):
blocks past ``routing.max_blocks`` are not hashed (their room in the pool is
counted: ``tail``), and a pool full of running requests evicts sooner.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import numpy as np

__all__ = ["ShadowFleet", "sampled", "SAMPLE_SPACE"]

# hash mod SAMPLE_SPACE < threshold keeps a block: 2^24, as SHARDS' implementation.
SAMPLE_SPACE = 1 << 24
_MASK = SAMPLE_SPACE - 1
# Bytes one shadow entry costs (an OrderedDict slot: the int key, link node, table share),
# measured with tracemalloc on CPython 3.11 (``tests/test_savings.py`` checks it).
ENTRY_BYTES = 140
# Keys a prompt's unhashed tail apart from its blocks (an odd constant: never a block's own hash in practice).
_TAIL = 0x9E3779B97F4A7C15


# Past this many blocks the test is vectorised: numpy's conversion costs about as much as
# 150 Python comparisons, and then halves the rest (2,048 blocks: 85 against 43 us).
_VECTOR_FROM = 256


def sampled(blocks: Sequence[int], threshold: int) -> list[int]:
    """Positions of the blocks the shadow keeps: those whose hash mod 2^24 is below ``threshold``."""
    if len(blocks) < _VECTOR_FROM:
        return [j for j, h in enumerate(blocks) if h & _MASK < threshold]
    hashes = np.fromiter(blocks, dtype=np.uint64, count=len(blocks))
    return np.flatnonzero((hashes & np.uint64(_MASK)) < threshold).tolist()  # type: ignore[no-any-return]


class ShadowFleet:
    """Shadow LRUs of every replica's sampled blocks, placed by round robin (or as told)."""

    def __init__(self, rate: float = 1 / 16) -> None:
        self._lrus: dict[str, OrderedDict[int, float]] = {}
        self._weights: dict[str, float] = {}
        self._next = 0
        # The deepest sampled block the last ``serve`` found held (None: no hit): names where its
        # hit ended, for ``routing.savings`` to learn what a hit ending there is worth.
        self.boundary: int | None = None
        self.rate = 1.0
        self.threshold = SAMPLE_SPACE
        self.resize(rate)

    def resize(self, rate: float) -> None:
        """Sample at ``rate`` from now on; the shadows start again (sampled at the old rate, they
        would be a different sample)."""
        if not 0 < rate <= 1:
            raise ValueError("rate must be in (0, 1]")
        self.rate = rate
        self.threshold = max(1, round(rate * SAMPLE_SPACE))
        self._lrus.clear()
        self._weights.clear()

    def place(self, replicas: Sequence[str]) -> str | None:
        """The replica round robin gives the next request, over ``replicas`` sorted by name."""
        if not replicas:
            return None
        ordered = sorted(replicas)
        name = ordered[self._next % len(ordered)]
        self._next += 1
        return name

    def serve(self, replica: str, blocks: Sequence[int], capacity: float | None, tail: float = 0.0,
              keep: list[int] | None = None) -> float:
        """Blocks of ``blocks``' prefix ``replica`` would hold (the estimate above), then hold them all.

        ``capacity``: the replica's pool in blocks of this kind (None: not known yet, no eviction).
        ``tail``: blocks of the prompt past ``blocks`` (past ``routing.max_blocks``): never looked
        up, but they take room in the pool, so they take their share of it in the shadow (one
        entry weighing their expected samples). ``keep``: ``sampled(blocks, self.threshold)``,
        when the caller has it."""
        lru = self._lrus.get(replica)
        if lru is None:
            lru = self._lrus[replica] = OrderedDict()
            self._weights[replica] = 0.0
        if keep is None:
            keep = sampled(blocks, self.threshold)
        # The head is always kept (weighing R, as a sampled block stands for 1/R): a hit ends at or
        # past it unless the prompt is cold, so one shorter than the first sampled block is seen.
        head = bool(blocks) and (not keep or keep[0] != 0)
        if head:
            keep = [0, *keep]
        hit, self.boundary = 0.0, None
        for i in range(len(keep) - 1, -1, -1):
            if blocks[keep[i]] in lru:
                end = keep[i + 1] if i + 1 < len(keep) else len(blocks)
                hit, self.boundary = (keep[i] + 1 + end) / 2, blocks[keep[i]]
                break
        weight = self._weights[replica]
        if tail > 0 and blocks:
            key = blocks[-1] ^ _TAIL
            weight -= lru.pop(key, 0.0)
            lru[key] = tail * self.rate
            weight += tail * self.rate
        # The request leaves its prompt on the replica: tail first, so the head is the most
        # recently used and evicted last, as vLLM frees a request's blocks.
        for j in reversed(keep):
            h = blocks[j]
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = w = self.rate if head and j == 0 else 1.0
                weight += w
        if capacity is not None:
            room = max(1.0, capacity * self.rate)
            # Heads weigh R but cost an entry each: many short distinct prompts could fill the room
            # with 1/R times the entries it is sized for, so entries are bounded too.
            while (weight > room or len(lru) > 2 * room) and lru:
                weight -= lru.popitem(last=False)[1]
        self._weights[replica] = weight
        return hit

    def retain(self, replicas: Sequence[str]) -> None:
        """Forget the shadows of replicas that left the pool."""
        for name in [n for n in self._lrus if n not in replicas]:
            del self._lrus[name]
            del self._weights[name]

    def entries(self) -> dict[str, int]:
        return {name: len(lru) for name, lru in sorted(self._lrus.items())}

    def memory_bytes(self) -> int:
        """The shadows' size, estimated from their entries (``ENTRY_BYTES`` each)."""
        return sum(len(lru) for lru in self._lrus.values()) * ENTRY_BYTES
