"""What each replica's KV pool can still hold of what this instance recorded there.

vLLM evicts least-recently-used blocks once its pool is full, and frees a
request's blocks tail first, so a prompt's deepest blocks go before its root
(``vllm/v1/core/block_pool.py``). The approximate index (``routing.block_index``)
learns what this instance sent each replica; without a model of the pool it
would remember all of it, and under pressure every organisation would look
warm everywhere while the pools keep only part of it.

``PoolModel`` keeps, per replica, the index entries this instance recorded
there in LRU order, each weighing the blocks it stands for (the gap from the
position recorded before it), and evicts from the cold end once their sum
passes the pool's real size (``vllm:cache_config_info``: ``num_gpu_blocks`` x
``block_size``, read as ``ReplicaView.kv_tokens``). What it evicts, the
index forgets. Recording a prompt touches its entries tail first, so its root
ends most recent, as vLLM's free queue orders them.

It models one instance's traffic only: other clients' prompts evict too, so
it errs towards believing too much is warm, never too little; the replica's
reported ``cached_tokens`` measure how far (``PrefixAffinity.stats``,
``belief``). Where the pool's size is unknown nothing is modelled.

**What an eviction costs.** Each replica also keeps the entries it evicted, as
many as its pool holds (the ghost list of ARC, Megiddo and Modha). A request
that brings back a ghost would have hit with a pool twice the size: the
share of evicted blocks that come back (``refill``) is what evicting a block
costs the fleet in future prefill, learned from the traffic. Where nothing
that is evicted returns (one-off prompts) it is 0; where pools are under
pressure and the evicted layers are wanted again, it approaches 1.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

__all__ = ["PoolModel"]


class PoolModel:
    __slots__ = ("_lru", "_used", "_ghosts", "_ghost_used", "_capacity", "evicted", "returned")

    def __init__(self) -> None:
        self._lru: dict[int, OrderedDict[int, int]] = {}
        self._used: dict[int, int] = {}
        self._ghosts: dict[int, OrderedDict[int, int]] = {}
        self._ghost_used: dict[int, int] = {}
        self._capacity: dict[int, int] = {}
        # Blocks evicted, and of them blocks a later request brought back (``refill``).
        self.evicted = 0
        self.returned = 0

    def refill(self) -> float:
        """The share of evicted blocks that requests brought back (0 before any eviction)."""
        return self.returned / self.evicted if self.evicted else 0.0

    def overflow(self, bit: int, blocks: float) -> float:
        """Blocks that adding ``blocks`` new ones at replica ``bit`` would evict (0 where unmodelled)."""
        capacity = self._capacity.get(bit)
        if capacity is None:
            return 0.0
        return max(0.0, self._used.get(bit, 0) + blocks - capacity)

    def used(self, bit: int) -> int:
        """Blocks this instance believes replica ``bit`` holds of its recordings."""
        return self._used.get(bit, 0)

    def touch(self, bit: int, entries: Sequence[int], weights: Sequence[int], capacity: int) -> list[int]:
        """Record ``entries`` (root first, each standing for ``weights`` blocks) as just used at
        replica ``bit``, whose pool holds ``capacity`` blocks; returns the entries it evicted."""
        lru = self._lru.get(bit)
        if lru is None:
            lru = self._lru[bit] = OrderedDict()
            self._ghosts[bit] = OrderedDict()
        ghosts = self._ghosts[bit]
        self._capacity[bit] = capacity
        used = self._used.get(bit, 0)
        move = lru.move_to_end
        for i in range(len(entries) - 1, -1, -1):  # tail first: the root ends most recent
            h = entries[i]
            w = lru.get(h)
            if w is None:
                lru[h] = weights[i]
                used += weights[i]
                back = ghosts.pop(h, None)
                if back is not None:
                    self.returned += back
                    self._ghost_used[bit] = self._ghost_used.get(bit, 0) - back
            else:
                move(h)
        evicted: list[int] = []
        ghost_used = self._ghost_used.get(bit, 0)
        while used > capacity and lru:
            h, w = lru.popitem(last=False)
            used -= w
            evicted.append(h)
            self.evicted += w
            ghosts[h] = w
            ghost_used += w
        while ghost_used > capacity and ghosts:  # a pool's worth of ghosts, the oldest forgotten
            ghost_used -= ghosts.popitem(last=False)[1]
        self._ghost_used[bit] = ghost_used
        self._used[bit] = used
        return evicted

    def clear(self) -> None:
        for d in (self._lru, self._used, self._ghosts, self._ghost_used, self._capacity):
            d.clear()
