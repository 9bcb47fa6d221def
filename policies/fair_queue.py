"""Weighted fair queueing over tenants, in strict priority bands. Pure: no I/O, no clock, no asyncio.

What waits in kvgate when every replica is full is ordered here, and only here
(``gateway.proxy.admission`` holds the waiting requests and asks this who is next).

* **Bands.** Every waiting entry of band 0 (``interactive``) goes before any of
  band 1 (``standard``), and those before band 2 (``batch``): a class is the
  operator's promise about latency, not a share.
* **Within a band: self-clocked fair queueing** (Golestani, 1994). An entry
  carries its work (a request's prompt tokens: what the replica must prefill
  before the request holds its seat lightly) and its tenant's weight. On arrival
  it is tagged ``finish = max(V, tenant's last finish) + work / weight``; the
  entry with the smallest tag goes next, and ``V`` becomes its tag. A tenant's
  entries leave in their order of arrival (their tags increase).
* **The bound.** While two tenants ``i`` and ``j`` both have entries waiting in a
  band, the work served to them, each divided by its weight, differs by at most
  ``Lmax_i / w_i + Lmax_j / w_j`` (``Lmax``: the largest single entry of each),
  over any stretch of time: weighted shares are exact to within one request of
  each. A tenant that was idle earns no credit for it: it rejoins at ``V``.
* **Leaving early** (a deadline, a disconnect): the tenant's later entries are
  re-tagged as if the entry had never arrived, so work not done is not charged.

Choosing the next entry looks at the head of each tenant's line: O(tenants)
per pop, a few dozen at most, which is cheaper than keeping a heap consistent
with removals.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

__all__ = ["Entry", "FairQueue"]

T = TypeVar("T")


@dataclass(slots=True, eq=False)
class Entry(Generic[T]):
    """One waiting item and its tags; the handle ``remove`` takes."""

    item: T
    tenant: str
    band: int
    cost: float
    weight: float
    seq: int  # arrival order: breaks ties between equal tags
    arrived_at: float  # the band's virtual time on arrival: the least its tag may start from
    prev_finish: float  # the tenant's last tag in the band when this arrived
    finish: float = 0.0
    queued: bool = True

    def tag(self) -> None:
        self.finish = max(self.arrived_at, self.prev_finish) + self.cost / self.weight


@dataclass(slots=True)
class _Band(Generic[T]):
    vtime: float = 0.0
    lines: dict[str, deque[Entry[T]]] = field(default_factory=dict)
    last_finish: dict[str, float] = field(default_factory=dict)
    size: int = 0

    def emptied(self) -> None:
        # Every tag given so far is <= vtime once the band is empty, so starting again
        # from zero orders every later arrival exactly as before, with small numbers.
        self.vtime = 0.0
        self.last_finish.clear()


class FairQueue(Generic[T]):
    def __init__(self, bands: int = 3) -> None:
        self._bands: list[_Band[T]] = [_Band() for _ in range(bands)]
        self._seq = 0
        self._depth: dict[str, int] = {}

    def __len__(self) -> int:
        return sum(b.size for b in self._bands)

    def depth(self, tenant: str) -> int:
        """Entries of ``tenant`` waiting, all bands."""
        return self._depth.get(tenant, 0)

    def depths(self) -> dict[str, int]:
        return {t: n for t, n in self._depth.items() if n}

    def push(self, item: T, *, tenant: str, band: int, cost: float, weight: float) -> Entry[T]:
        """Queue ``item``; ``cost`` > 0 (work, e.g. prompt tokens), ``weight`` > 0."""
        if not (cost > 0 and weight > 0):
            raise ValueError("cost and weight must be positive")
        b = self._bands[band]
        self._seq += 1
        entry = Entry(item, tenant, band, float(cost), float(weight), self._seq, b.vtime,
                      b.last_finish.get(tenant, 0.0))
        entry.tag()
        b.last_finish[tenant] = entry.finish
        b.lines.setdefault(tenant, deque()).append(entry)
        b.size += 1
        self._depth[tenant] = self._depth.get(tenant, 0) + 1
        return entry

    def pop(self, accept: Callable[[T], bool] | None = None) -> Entry[T] | None:
        """The next entry in order, taken out of the queue; None if nothing (acceptable) waits.

        ``accept``: only entries it approves may go (a freed slot on a replica that serves
        some models only); a tenant's first acceptable entry stands for its line."""
        for b in self._bands:
            if not b.size:
                continue
            best: Entry[T] | None = None
            for line in b.lines.values():
                head = line[0] if accept is None else next((e for e in line if accept(e.item)), None)
                if head is not None and (best is None or (head.finish, head.seq) < (best.finish, best.seq)):
                    best = head
            if best is None:
                continue
            line = b.lines[best.tenant]
            if line[0] is best:
                line.popleft()
            else:
                line.remove(best)
            b.vtime = max(b.vtime, best.finish)
            self._taken(b, best)
            return best
        return None

    def remove(self, entry: Entry[T]) -> bool:
        """Take a waiting entry out unserved (its tenant's later entries re-tagged); False if
        it already left."""
        if not entry.queued:
            return False
        b = self._bands[entry.band]
        line = b.lines[entry.tenant]
        at = line.index(entry)
        del line[at]
        prev = entry.prev_finish
        for later in list(line)[at:]:
            later.prev_finish = prev
            later.tag()
            prev = later.finish
        b.last_finish[entry.tenant] = prev
        self._taken(b, entry)
        return True

    def _taken(self, b: _Band[T], entry: Entry[T]) -> None:
        entry.queued = False
        b.size -= 1
        self._depth[entry.tenant] -= 1
        if not b.lines[entry.tenant]:
            del b.lines[entry.tenant]
        if not b.size:
            b.emptied()
