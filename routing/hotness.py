"""How much of the traffic shares a prefix: the estimate that decides how deep to key.

A prefix carried by more traffic than one replica's fair share cannot live on
one replica, and keying on it would send every request that shares it to the
same first choice. ``Popularity`` estimates, per candidate key, its share of
the requests this gateway instance has routed: ``count / max(age, window)``,
where age counts requests since the key was first seen. Every instance sees a
random sample of the same traffic, so independent instances reach the same
verdict on anything clearly hot (a global system prompt) or clearly not (one
conversation), which is all the routing key needs.

Memory is bounded: an LRU of ``capacity`` keys. Hot keys are touched on every
request that carries them, so they are the last to be evicted.
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["Popularity"]


class Popularity:
    __slots__ = ("_entries", "_capacity", "_tick")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        # key -> [count, tick when first seen]
        self._entries: OrderedDict[int, list[int]] = OrderedDict()
        self._capacity = capacity
        self._tick = 0

    def __len__(self) -> int:
        return len(self._entries)

    def tick(self) -> None:
        """One more request routed (the denominator of every share)."""
        self._tick += 1

    def share(self, key: int, window: int) -> float:
        """Estimated fraction of requests carrying ``key``; 0.0 for a key never seen.

        The ``window`` floor keeps a young key from looking hot: two turns of one
        conversation a second apart are 2 of ``window`` requests, not 2 of 2.
        """
        entry = self._entries.get(key)
        if entry is None:
            return 0.0
        return entry[0] / max(self._tick - entry[1] + 1, window)

    def shares(self, keys: list[int], window: int) -> list[float]:
        """``share`` of each key (one call per request instead of one per key)."""
        entries, tick = self._entries, self._tick
        out = []
        for key in keys:
            entry = entries.get(key)
            out.append(0.0 if entry is None else entry[0] / max(tick - entry[1] + 1, window))
        return out

    def record_all(self, keys: list[int]) -> None:
        entries = self._entries
        for key in keys:
            entry = entries.get(key)
            if entry is None:
                entries[key] = [1, self._tick]
            else:
                entry[0] += 1
                entries.move_to_end(key)
        while len(entries) > self._capacity:
            entries.popitem(last=False)
