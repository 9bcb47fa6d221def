"""Weighted rendezvous (highest-random-weight) hashing and the bounded-load split.

Rendezvous hashing gives every key its own full preference order over the
replicas: score each replica by a hash of (key, replica) and sort. Every
gateway instance computes the same order from the same key and membership, with
no shared state; removing a replica moves only the keys it was first for (each
to its own next choice, about 1/N of keys), and adding it back restores them.
Weights follow Schindelhauer and Schomaker's logarithmic method: score =
weight / -ln(u), u uniform in (0, 1), so a replica of weight 2 is first for
twice the keys. O(N) per lookup: fine for tens of replicas.

"""

from __future__ import annotations

import math
from typing import Sequence, TypeVar

import xxhash

from .base import ReplicaView

__all__ = ["replica_salt", "Rendezvous", "within_bound", "first_choice"]

_xxh = xxhash.xxh3_64_intdigest
_TWO64 = float(1 << 64)
_log = math.log

R = TypeVar("R", bound=ReplicaView)


def replica_salt(name: str) -> int:
    """A replica's stable identity in the hash: its name, never its URL or position."""
    return _xxh(name.encode("utf-8", "surrogatepass"), 0x6B76676174650001)


class Rendezvous:
    """Each key's preference order over the replicas, remembered: computed once per membership.

    The order is a pure function of the key and the (name, weight) list, and a
    key (a conversation, an organisation) comes back for many requests: so the
    order is kept, as positions in the list, until the membership changes. At
    most ``capacity`` keys are kept (then all are forgotten at once: recomputing
    one is a microsecond or two a replica).
    """

    __slots__ = ("_salts", "_orders", "_members", "_capacity")

    def __init__(self, capacity: int = 1 << 14) -> None:
        self._salts: dict[str, int] = {}
        self._orders: dict[int, tuple[int, ...]] = {}
        self._members: tuple[tuple[str, float], ...] = ()
        self._capacity = capacity

    def order(self, key: int, replicas: Sequence[R]) -> list[R]:
        """Replicas in ``key``'s preference order, best first (ties, vanishingly rare, by name)."""
        members = tuple([(r.name, r.weight) for r in replicas])
        orders = self._orders
        if members != self._members:
            self._members = members
            orders.clear()
            if len(self._salts) > 4 * len(members) + 64:
                self._salts.clear()  # names churned (DNS pods): keep only the current ones' salts
        at = orders.get(key)
        if at is None:
            if len(orders) >= self._capacity:
                orders.clear()
            at = orders[key] = tuple(_scored(key, replicas, self._salts))
        return [replicas[i] for i in at]


def _scored(key: int, replicas: Sequence[R], salts: dict[str, int]) -> list[int]:
    """Positions of ``replicas`` in ``key``'s rendezvous order."""
    kb = (key & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "little")
    scored = []
    for i, r in enumerate(replicas):
        name = r.name
        salt = salts.get(name)
        if salt is None:
            salt = salts[name] = replica_salt(name)
        # Score weight / -ln(u), u uniform in (0, 1) from the hash. The position last: it
        # breaks no tie that the name does not (a stable sort on score, then name).
        scored.append((-(r.weight / -_log((_xxh(kb, salt) + 0.5) / _TWO64)), name, i))
    scored.sort()
    return [t[2] for t in scored]


def first_choice(key: int, names: Sequence[str]) -> str:
    """The unweighted first choice among ``names``: the membership tests' reference mapping."""
    kb = (key & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "little")
    return max(names, key=lambda n: (_xxh(kb, replica_salt(n)), n))


def within_bound(loads: Sequence[float], weights: Sequence[float], epsilon: float) -> list[bool]:
    """For each replica, whether one more request keeps it within the bound.

    ``loads`` are weighted (requests per unit weight, as ``routing.base.load_now``); the cap is
    ceil((1 + epsilon) x mean load including this request x weight), at least 1.
    """
    # Plain loops over floats (no map, zip or sum): this runs on every request, compiled.
    n = len(loads)
    total_weight = weighted = 0.0
    for i in range(n):
        w = float(weights[i])
        total_weight += w
        weighted += float(loads[i]) * w
    if total_weight <= 0:
        return [True] * n
    mean = (weighted + 1.0) / total_weight
    out = []
    last_w, cap = -1.0, 0  # by weight: most fleets have one, so one cap
    for i in range(n):
        w = float(weights[i])
        if w != last_w:
            last_w = w
            cap = max(math.ceil((1.0 + epsilon) * mean * w - 1e-9), 1)
        out.append(float(loads[i]) * w + 1.0 <= cap)
    return out
