"""An approximate index of which replica holds which prefix blocks.

Learned only from this instance's own traffic (``observe`` after each served
request: the replica now holds that prompt's blocks), so it is a hint, never
the truth: replicas evict on their own, other gateway instances route
elsewhere. The policy uses it for one decision only: whether a replica other
than the rendezvous first choice already holds this request's key prefix (or a
clearly deeper one), so the request should follow it there.

Cost and memory are bounded by design:

* Only sampled block positions are indexed, plus (with ``tails``) every block
  of a prompt's tail past its last sampled one: every block of the first 16, then eight
  positions per doubling of depth (16, 18, ..., 32, 36, ...). A prompt of 2,000
  blocks (128K characters) costs at most about 200 entries. A match is exact for
  a prompt that extends a recorded one (a conversation's next turn finds its
  last turn's whole prompt: the cost model charges every block it does not know
  of) and known to within 1/8 of its depth otherwise.
* Entries map a chained block hash (or a routing key, which is the hash of
  the exact prefix it names) to a bitmask of replica ids and live in one LRU
  of ``capacity`` entries; hashes that stop being used age out.
* A lookup is a binary search over the sampled positions (a prefix held by a
  replica is held all the way down, so presence is monotone along a chain),
  then one over the blocks up to the next sampled position: only recorded
  tails are there, each recorded from that sampled block on, so presence is
  monotone there too.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import OrderedDict
from itertools import chain
from typing import Iterable, Sequence

__all__ = ["BlockIndex", "sampled_positions"]


def sampled_positions(max_blocks: int) -> tuple[int, ...]:
    """Block positions the index records, ascending: dense near the root, then geometric."""
    out: list[int] = []
    i = 0
    while i < max_blocks:
        out.append(i)
        i += 1 if i < 16 else max(1, (1 << (i.bit_length() - 1)) >> 3)
    return tuple(out)


class BlockIndex:
    __slots__ = ("_entries", "_capacity", "_positions", "_tails")

    def __init__(self, capacity: int, max_blocks: int, tails: bool = False) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self._entries: OrderedDict[int, int] = OrderedDict()
        self._capacity = capacity
        self._positions = sampled_positions(max_blocks)
        # Record each prompt's tail too (exact depths for the cost model).
        self._tails = tails

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()

    def _upto(self, n_blocks: int) -> int:
        return bisect_right(self._positions, n_blocks - 1)

    def add(self, hashes: Sequence[int], bit: int) -> None:
        """Record that replica ``bit`` holds every block of ``hashes``."""
        flag = 1 << bit
        entries = self._entries
        sampled = self._positions[: self._upto(len(hashes))]
        at: Iterable[int] = sampled
        if sampled and self._tails:
            at = chain(sampled, range(sampled[-1] + 1, len(hashes)))  # the tail: exact depth for the next turn
        for p in at:
            h = hashes[p]
            mask = entries.get(h)
            if mask is None:
                entries[h] = flag
            else:
                entries[h] = mask | flag
                entries.move_to_end(h)
        while len(entries) > self._capacity:
            entries.popitem(last=False)

    def add_key(self, key: int, bit: int) -> None:
        """Record that replica ``bit`` holds the prefix a routing key names (its exact cut)."""
        entries = self._entries
        entries[key] = entries.get(key, 0) | (1 << bit)
        entries.move_to_end(key)
        if len(entries) > self._capacity:
            entries.popitem(last=False)

    def holders(self, key: int) -> int:
        """Bitmask of replicas believed to hold the prefix ``key`` names (no side effects)."""
        return self._entries.get(key, 0)

    def deepest(self, hashes: Sequence[int], among: int) -> tuple[int, int]:
        """(blocks matched, bitmask of replicas matching that deep) over replicas in ``among``.

        Binary search for the last sampled position any of ``among`` holds; no
        side effects (a lookup does not refresh recency: only serving does).
        """
        entries = self._entries
        positions = self._positions
        lo, hi = 0, self._upto(len(hashes))
        best_pos, best_mask = -1, 0
        while lo < hi:
            mid = (lo + hi) // 2
            mask = entries.get(hashes[positions[mid]], 0) & among
            if mask:
                best_pos, best_mask = positions[mid], mask
                lo = mid + 1
            else:
                hi = mid
        if not self._tails:
            return best_pos + 1, best_mask
        # Then between it and the next sampled position, where only tails are recorded.
        lo, hi = best_pos + 1, min(positions[lo] if lo < len(positions) else len(hashes), len(hashes))
        while lo < hi:
            mid = (lo + hi) // 2
            mask = entries.get(hashes[mid], 0) & among
            if mask:
                best_pos, best_mask = mid, mask
                lo = mid + 1
            else:
                hi = mid
        return best_pos + 1, best_mask

    def depth_of(self, hashes: Sequence[int], bit: int) -> int:
        """Blocks of this chain that replica ``bit`` is believed to hold."""
        return self.deepest(hashes, 1 << bit)[0]
