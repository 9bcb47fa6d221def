"""How much of the traffic shares a prefix: the estimate that decides how deep to key.

A prefix carried by more traffic than one replica's fair share cannot live on
one replica, and keying on it would send every request that shares it to the
same first choice. ``Popularity`` counts, per candidate key, the requests this
gateway instance has routed that carried it, over its age (the requests routed
since it was first seen), and judges it wide once the count is past the share
at the 95th percentile of a Poisson count: ``count - z sqrt(count) > share *
age``. So a prefix in every request is wide from its 5th request in a fleet of
8 (or 16), its 7th in one of 4 and its 14th in one of 2, while a prefix whose
share is near a replica's (4 organisations on 4 replicas) is not judged wide by
chance, as the old point estimate judged it two requests in five. Every instance sees
a random sample of the same traffic, so independent instances reach the same
verdict on anything clearly hot (a global system prompt) or clearly not (one
conversation), which is all the routing key needs.

Memory is bounded: two generations of ``capacity / 2`` keys each. A key
touched is in the young one; when it fills, the old one is dropped and the
young one becomes old. Hot keys are touched on every request that carries them,
so they are never dropped; a key untouched for a whole generation is. (An LRU
would do the same, at an ordered-dict move per key per request: dozens per
request with cuts inside a long system prompt.)
"""

from __future__ import annotations

import math

__all__ = ["P95_Z", "Popularity"]

# The 95th percentile of a normal deviate: the percentile users judge a time to first
# token by, used wherever a count that comes and goes is read (here, and the pool's room
# for running requests in ``routing.ttft_affinity``).
P95_Z = 1.645


class Popularity:
    __slots__ = ("_young", "_old", "_half", "_tick")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        # key -> [count, tick when first seen, count when last judged wide (0: narrow)]
        self._young: dict[int, list[int]] = {}
        self._old: dict[int, list[int]] = {}
        self._half = max(1, capacity // 2)
        self._tick = 0

    def __len__(self) -> int:
        return len(self._young) + len(self._old)

    def tick(self) -> None:
        """One more request routed (the denominator of every share)."""
        self._tick += 1

    def first_narrow(self, keys: list[int], wide: float, record: bool) -> int:
        """The index of the first key not judged wide, its count not past ``wide`` of its age at
        the 95th percentile (module doc; else the last), and with ``record`` each key counted
        for this request: one pass for both."""
        young, old, tick = self._young, self._old, self._tick
        found = -1
        for j, key in enumerate(keys):
            entry = young.get(key)
            if entry is None:
                entry = old.pop(key, None) if record else old.get(key)
                if entry is None:
                    found = j  # never seen: share 0
                    if record:
                        young[key] = [1, tick, 0]
                        self._count(keys, j + 1)
                    break
                if record:
                    young[key] = entry
            age = tick - entry[1] + 1
            count = entry[0]
            narrow = count - P95_Z * math.sqrt(count) <= wide * age
            if record:
                if narrow:
                    entry[2] = 0
                elif not entry[2]:
                    entry[2] = count
                entry[0] += 1
            if narrow:
                found = j
                if record:
                    self._count(keys, j + 1)
                break
        if record and len(young) > self._half:
            self._old, self._young = young, {}
        return found if found >= 0 else len(keys) - 1

    def since_wide(self, key: int) -> int:
        """How many requests have carried ``key`` since it turned wide (0: it is narrow, or unknown)."""
        entry = self._young.get(key) or self._old.get(key)
        return entry[0] - entry[2] if entry is not None and entry[2] else 0

    def _count(self, keys: list[int], start: int) -> None:
        """Count ``keys[start:]`` for this request (past the one chosen: no share needed)."""
        young, old, tick = self._young, self._old, self._tick
        for key in keys[start:]:
            entry = young.get(key)
            if entry is None:
                entry = old.pop(key, None)
                if entry is None:
                    young[key] = [1, tick, 0]
                    continue
                young[key] = entry
            entry[0] += 1
