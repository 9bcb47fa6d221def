"""How much of the traffic shares a prefix: the estimate that decides how deep to key.

A prefix carried by more traffic than one replica's fair share cannot live on
one replica, and keying on it would send every request that shares it to the
same first choice. ``Popularity`` estimates, per candidate key, its share of
the requests this gateway instance has routed: ``count / max(age, window)``,
where age counts requests since the key was first seen. Every instance sees a
random sample of the same traffic, so independent instances reach the same
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

__all__ = ["Popularity"]


class Popularity:
    __slots__ = ("_young", "_old", "_half", "_tick")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        # key -> [count, tick when first seen]
        self._young: dict[int, list[int]] = {}
        self._old: dict[int, list[int]] = {}
        self._half = max(1, capacity // 2)
        self._tick = 0

    def __len__(self) -> int:
        return len(self._young) + len(self._old)

    def tick(self) -> None:
        """One more request routed (the denominator of every share)."""
        self._tick += 1

    def first_narrow(self, keys: list[int], window: int, wide: float, record: bool) -> int:
        """The index of the first key whose share is at most ``wide`` (else the last),
        and with ``record`` each key counted for this request: one pass for both."""
        young, old, tick = self._young, self._old, self._tick
        # count / max(age, window) <= wide, without a division or a max per key.
        floor = wide * window
        found = -1
        for j, key in enumerate(keys):
            entry = young.get(key)
            if entry is None:
                entry = old.pop(key, None) if record else old.get(key)
                if entry is None:
                    found = j  # never seen: share 0
                    if record:
                        young[key] = [1, tick]
                        self._count(keys, j + 1)
                    break
                if record:
                    young[key] = entry
            age = tick - entry[1] + 1
            narrow = entry[0] <= (wide * age if age > window else floor)
            if record:
                entry[0] += 1
            if narrow:
                found = j
                if record:
                    self._count(keys, j + 1)
                break
        if record and len(young) > self._half:
            self._old, self._young = young, {}
        return found if found >= 0 else len(keys) - 1

    def _count(self, keys: list[int], start: int) -> None:
        """Count ``keys[start:]`` for this request (past the one chosen: no share needed)."""
        young, old, tick = self._young, self._old, self._tick
        for key in keys[start:]:
            entry = young.get(key)
            if entry is None:
                entry = old.pop(key, None)
                if entry is None:
                    young[key] = [1, tick]
                    continue
                young[key] = entry
            entry[0] += 1
