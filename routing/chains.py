"""Block hashes of prefixes seen before, so a request hashes only its new bytes.

Most of a request's prompt is a prefix some earlier request carried: the
system prompt and tools every request of an application sends, the turns a
conversation sent last time. Chaining xxh3 over its blocks costs about 0.3 us a
block in Python (100 us for a 4K-token prompt); one xxh3-128 digest of the same
bytes, in C, costs about a microsecond. So the chain of a prefix ending at a
message boundary is kept, keyed by (seed, blocks, digest of those bytes), and a
request that starts with it chains only the blocks after it.

Which boundaries: the end of the first span (tools or system prompt: what an
application repeats) and the end of the request's context (everything before
its last message: what its conversation's next turn repeats). Two digests a
request, at most two chains stored per miss.

A digest match is taken as a byte match: xxh3-128 collisions are out of reach
of accident, and a crafted one could only misroute, never cross a tenant (the
seed, the tenant's namespace, is part of the key). Memory is bounded: an LRU
holding at most ``capacity`` block hashes in all, kept as lists (about 40 bytes
a hash) because a hit then copies pointers rather than making 400 integers.

The same holds for the boundary marker (``routing.boundary.marker_ends``):
where it occurs inside a stored prefix is stored with it, and a request
searches for it only past that prefix.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import xxhash

from .boundary import marker_ends
from .hashing import Span, chain_hashes

__all__ = ["ChainCache"]

_digest = xxhash.xxh3_128_intdigest
# Prefixes shorter than this many blocks are cheaper to chain than to look up.
_MIN_BLOCKS = 8


class ChainCache:
    __slots__ = ("_entries", "_capacity", "_held", "calls", "hits", "misses")

    def __init__(self, capacity: int = 1 << 18) -> None:
        # (seed, blocks, digest) -> (the prefix's block hashes, the marker's ends inside it)
        self._entries: OrderedDict[tuple[int, int, int], tuple[list[int], tuple[int, ...]]] = OrderedDict()
        self._capacity = capacity
        self._held = 0
        # Chains asked for (one per request analysed), and how many a stored prefix served.
        self.calls = 0
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def chain(self, data: bytes, seed: int, block: int, max_blocks: int, spans: Sequence[Span]) -> list[int]:
        """``chain_hashes(data, seed, block, max_blocks)``, reusing a known prefix's chain."""
        return self.analyse(data, seed, block, max_blocks, spans, b"")[0]

    def analyse(self, data: bytes, seed: int, block: int, max_blocks: int, spans: Sequence[Span],
                marker: bytes) -> tuple[list[int], list[int]]:
        """(``chain_hashes(...)``, ``boundary.marker_ends(data, marker)``), reusing what a known prefix had.

        Both are per prefix: the chain of a stored prefix is continued, and the marker
        is searched for only past it.
        """
        self.calls += 1
        n = min(len(data) // block, max_blocks)
        ends = [e for e in _boundaries(spans, block, n) if e >= _MIN_BLOCKS]
        if not ends:
            return chain_hashes(data, seed, block, max_blocks), marker_ends(data, marker)
        view = memoryview(data)
        keys = [(seed, e, _digest(view[: e * block])) for e in ends]
        entries = self._entries
        for key in keys:
            got = entries.get(key)
            if got is not None:
                break
        if got is None:
            self.misses += 1
            out = chain_hashes(data, seed, block, max_blocks)
            found = marker_ends(data, marker)
        else:
            self.hits += 1
            prefix, inside = got
            entries.move_to_end(key)
            out = prefix + chain_hashes(data, prefix[-1], block, max_blocks, start=len(prefix))
            # A marker may straddle the prefix's end: search from one marker's length before it.
            found = list(inside) + marker_ends(data, marker, max(0, key[1] * block - len(marker) + 1))
        for k in keys:
            if k not in entries:
                end = k[1] * block
                self._store(k, out[: k[1]], tuple(e for e in found if e <= end))
        return out, found

    def _store(self, key: tuple[int, int, int], hashes: list[int], markers: tuple[int, ...]) -> None:
        # A stored chain is shared by every request that reuses it: never mutated.
        self._entries[key] = (hashes, markers)
        self._held += len(hashes)
        while self._held > self._capacity and self._entries:
            _, (gone, _) = self._entries.popitem(last=False)
            self._held -= len(gone)


def _boundaries(spans: Sequence[Span], block: int, n: int) -> tuple[int, ...]:
    """In blocks, deepest first and distinct: the end of everything before the last span
    and the first span's end (none for a single span)."""
    if len(spans) < 2:
        return ()
    first, context = min(spans[0].end // block, n), min(spans[-2].end // block, n)
    return (context, first) if context > first else (first,)  # spans are in order: context >= first
