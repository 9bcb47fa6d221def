"""Balanced homes for the few keys that carry much of the traffic.

Rendezvous hashing balances many small keys well and a few big ones badly:
twelve organisations, each a twelfth of the traffic, land on eight replicas
like twelve balls in eight bins (one replica gets three, another none), and
the load bound then sheds whole organisations back and forth, each move
paying their whole prefix again. ``Placement`` gives the *heavy* keys (each at
least ``heavy`` of one replica's fair share; a hot prefix arrives here already
split into sub-keys no bigger than half a replica, see ``routing.keys``) a
packed home instead: walking the heavy keys in hash order, each goes to the
first replica of its own rendezvous order that still has room under
(1 + ``epsilon``) x its fair share, counting the light traffic as spread
evenly. Light keys (conversations) keep their plain rendezvous order.

Every instance estimates the same shares from its own sample of the traffic
and packs in the same order, so instances agree on the homes of clearly heavy
keys; a key near the threshold may be packed on one instance and hashed on
another, which costs what any disagreement costs and nothing more. The table
is rebuilt every ``refresh`` decisions and whenever membership changes, and
only covers keys seen recently (``routing.hotness`` bounds the memory).
"""

from __future__ import annotations

import math
from typing import Sequence

from .base import ReplicaView
from .hotness import Popularity
from .rendezvous import rendezvous_order

__all__ = ["Placement"]

# A key leaves the heavy set only below half the threshold that admits it, so
# an estimate wobbling around the threshold does not move it back and forth.
_HYSTERESIS = 0.5
_MIN_WINDOW = 64
_MIN_COUNT = 8


class Placement:
    __slots__ = ("_heavy", "_epsilon", "_refresh", "_counts", "_candidates", "_table", "_members", "_since")

    def __init__(self, heavy: float, epsilon: float, refresh: int = 256, capacity: int = 50_000) -> None:
        self._heavy = heavy  # fraction of one replica's fair share that makes a key heavy
        self._epsilon = epsilon
        self._refresh = refresh
        self._counts = Popularity(capacity)
        self._candidates: set[int] = set()
        self._table: dict[int, str] = {}
        self._members: tuple[tuple[str, float], ...] = ()
        self._since = 0

    def __len__(self) -> int:
        return len(self._table)

    def record(self, key: int, replicas: int) -> None:
        """One routed request with routing key ``key`` in a fleet of ``replicas``."""
        self._counts.tick()
        self._counts.record_all([key])
        self._since += 1
        threshold = self._heavy / max(1, replicas)
        if key not in self._candidates and self._share(key, replicas) >= threshold * _HYSTERESIS:
            self._candidates.add(key)

    def home(self, key: int, replicas: Sequence[ReplicaView], salts: dict[str, int],
             refresh: bool = True) -> str | None:
        """The packed home of a heavy ``key`` (a replica name), or None for a light key.

        ``refresh=False`` (a side-effect free peek) reuses the table as it is, on a
        membership it was not built for too (a home no longer offered is ignored).
        """
        members = tuple(sorted((r.name, r.weight) for r in replicas))
        if refresh and (members != self._members or self._since >= self._refresh):
            self._rebuild(replicas, members, salts)
        return self._table.get(key)

    # -- internals ---------------------------------------------------------------------
    def _window(self, replicas: int) -> int:
        # A key must be seen _MIN_COUNT times before it can be heavy: a burst of
        # turns from one conversation never qualifies.
        return max(_MIN_WINDOW, math.ceil(_MIN_COUNT * max(1, replicas) / self._heavy))

    def _share(self, key: int, replicas: int) -> float:
        return self._counts.share(key, self._window(replicas))

    def _rebuild(self, replicas: Sequence[ReplicaView], members: tuple[tuple[str, float], ...],
                 salts: dict[str, int]) -> None:
        self._members, self._since = members, 0
        n = len(replicas)
        if n < 2:
            self._table = {}
            return
        threshold = self._heavy / n
        shares = {k: self._share(k, n) for k in self._candidates}
        self._candidates = {k for k, s in shares.items() if s >= threshold * _HYSTERESIS}
        heavy = sorted(k for k in self._candidates if shares[k] >= threshold)
        if not heavy:
            self._table = {}
            return
        total_weight = sum(r.weight for r in replicas)
        light = max(0.0, 1.0 - sum(shares[k] for k in heavy))
        used = {r.name: light * r.weight / total_weight for r in replicas}
        cap = {r.name: (1.0 + self._epsilon) * r.weight / total_weight for r in replicas}
        old, table = self._table, {}
        # Sticky first: a key keeps its home (a newly heavy key: its rendezvous first
        # choice, where it has lived so far) while that home has room, so packing
        # moves only what must move (each move costs the key's prefix once).
        orders = {key: rendezvous_order(key, replicas, salts) for key in heavy}
        for key in heavy:
            home = old.get(key, orders[key][0].name)
            if home in used and used[home] + shares[key] <= cap[home]:
                used[home] += shares[key]
                table[key] = home
        for key in heavy:
            if key in table:
                continue
            share = shares[key]
            order = orders[key]
            pick = next((r.name for r in order if used[r.name] + share <= cap[r.name]), None)
            if pick is None:
                pick = min(order, key=lambda r: (used[r.name] + share) / r.weight).name
            used[pick] += share
            table[key] = pick
        self._table = table
