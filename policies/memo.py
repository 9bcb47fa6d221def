"""A bounded memo of pure results, keyed by a 128-bit digest of their input.

Hygiene's work on a request is mostly work on its system prompt, which an
application sends unchanged with every request: the scan of a 25,000-character
prompt costs ~300 us, its digest ~2 us. ``DigestMemo`` keeps results by
``xxh3_128`` of the input bytes; two inputs sharing a digest by accident is a
2**-128 event per pair, far below any fault the hardware itself makes, so a hit
is taken as the result itself, never re-checked against the input. Inputs are
not stored, only digests and results.

Memory is bounded: two generations of ``capacity / 2`` entries (as in
``routing.hotness``). A result found is in the young one; when it fills, the
old one is dropped and the young one becomes old. A prompt sent with every
request is found on every request, so it is never dropped; a result unused
for a whole generation is. (An LRU would do the same at an ordered-dict move
per hit.) ``computed`` counts the results computed, i.e. the misses.

Not thread-safe beyond what the GIL gives dict operations: one memo per event
loop. A race could only compute a result twice, never return a wrong one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

import xxhash

__all__ = ["DigestMemo", "digest", "scope_seed"]

A = TypeVar("A")
V = TypeVar("V")


def digest(text: str, seed: int = 0) -> int:
    """128-bit digest of ``text`` (any str: lone surrogates pass through as in fingerprints)."""
    return xxhash.xxh3_128_intdigest(text.encode("utf-8", "surrogatepass"), seed)


def scope_seed(scope: str) -> int:
    """The seed that keeps one scope's (a tenant's, a namespace's) entries apart from every other's."""
    return xxhash.xxh3_64_intdigest(scope.encode("utf-8", "surrogatepass"))


class DigestMemo(Generic[V]):
    __slots__ = ("_young", "_old", "_half", "computed")

    def __init__(self, capacity: int = 4096) -> None:
        if capacity < 2:
            raise ValueError("capacity must be >= 2")
        self._young: dict[int, V] = {}
        self._old: dict[int, V] = {}
        self._half = capacity // 2
        self.computed = 0

    def __len__(self) -> int:
        return len(self._young) + len(self._old)

    def get(self, key: int, compute: Callable[[A], V], arg: A) -> V:
        """The result kept for ``key``, else ``compute(arg)`` kept and returned."""
        young = self._young
        if key in young:
            return young[key]
        if key in self._old:
            value = self._old.pop(key)
        else:
            value = compute(arg)
            self.computed += 1
        young[key] = value
        if len(young) >= self._half:
            self._old, self._young = young, {}
        return value

    def clear(self) -> None:
        self._young.clear()
        self._old.clear()
