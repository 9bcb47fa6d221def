"""Each tenant's share of a full fleet's slots, and the slots held back for tenants below it.
Pure: no I/O, no asyncio; the clock is the caller's.

Weighted fair queueing (``policies.fair_queue``) orders what waits. It cannot
keep a tenant that asks for less than its share from waiting: when every slot
is busy, a request that arrives waits for one to free, however little its
tenant holds. On a fleet of a few slots, each held for a whole answer, that
wait is a whole decode, and the tenant that asked for little pays for the
excess of another. So the slots a tenant below its share has shown it uses are
held back from the others' excess: *the excess of others waits, not it*.

* **Demand.** A tenant's demand is the slots it holds, and each slot it let go
  within the last stretch of one of its own requests' time in a slot
  (``lease_s``, a smoothed mean of how long its requests hold one, as TCP
  smooths its round trip, RFC 6298's 1/8) and has not taken again. A client
  that sends its next request as its last one ends, or within the time one
  takes, keeps its slot; one that pauses longer than that lets it go. Each slot
  is timed on its own: several users of a tenant are out of step, and never
  all in a slot at one moment. Before any of its requests has ended, a tenant's
  demand is what it holds.
* **Active** tenants are those with demand, or with requests waiting.
* **Share.** The instance's slots (the sum of its replicas' limits) in
  proportion to weight among the active tenants.
* **Held back** for an active tenant with nothing waiting: its demand, at most
  its share, less what it holds. A tenant with requests waiting is not held for:
  it competes in the queue, where a request of a tenant below its share goes
  first (``within_share``).

What this costs: a slot held back stays idle until its tenant's next request,
which in a closed loop is one round trip; a tenant whose demand shrinks keeps
its old demand for one ``lease_s`` more.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

__all__ = ["Shares"]

# RFC 6298's smoothing of a round-trip time: the new sample's weight.
_GAIN = 1 / 8


@dataclass(slots=True)
class _Use:
    held: int = 0
    # When each slot it let go was let go, oldest first, while it has not taken one again and the
    # slot's time (``lease_s`` from then) has not run out. Per slot, not one peak for the tenant:
    # two users out of step are never both in a slot at one moment, so a peak renewed only when
    # all its slots were held at once lapsed while both still used theirs (a user who let go just
    # after the other took one back renewed nothing), and the other tenant took the slot.
    idle: deque[float] = field(default_factory=deque)
    lease_s: float = 0.0  # smoothed time its requests hold a slot; 0 before any ended

    def _prune(self, now: float) -> None:
        while self.idle and now - self.idle[0] > self.lease_s:
            self.idle.popleft()

    def demand(self, now: float) -> int:
        """Slots held, and slots let go within one of its requests' times and not taken again."""
        self._prune(now)
        return self.held + len(self.idle)

    def take(self, now: float) -> None:
        """It took a slot: one it let go, if any is still its own."""
        self._prune(now)
        if self.idle:
            self.idle.popleft()
        self.held += 1

    def expires(self) -> float:
        """When the demand next falls, unless a slot is taken again (``demand`` pruned the idle)."""
        return self.idle[0] + self.lease_s


class Shares:
    def __init__(self) -> None:
        self._use: dict[str, _Use] = {}

    # -- what happened ----------------------------------------------------------------------
    def hold(self, tenant: str, now: float) -> None:
        """A request of ``tenant`` took a slot: one it let go, if any is still its own."""
        self._use.setdefault(tenant, _Use()).take(now)

    def release(self, tenant: str, now: float, held_s: float) -> None:
        """A request of ``tenant`` gave its slot back after ``held_s`` seconds."""
        use = self._use.get(tenant)
        if use is None or use.held <= 0:
            return
        use.held -= 1
        use.lease_s = held_s if use.lease_s == 0 else use.lease_s + _GAIN * (held_s - use.lease_s)
        use.idle.append(now)

    def unhold(self, tenant: str) -> None:
        """A slot taken for ``tenant`` went unused (its request gave up as it was handed the slot)."""
        use = self._use.get(tenant)
        if use is not None and use.held > 0:
            use.held -= 1

    def forget_idle(self, now: float) -> None:
        """Drop tenants with nothing held and no demand left (bounded memory)."""
        for name in [t for t, u in self._use.items() if u.held == 0 and u.demand(now) == 0]:
            del self._use[name]

    # -- what follows -----------------------------------------------------------------------
    def _active(self, waiting: dict[str, int], now: float) -> set[str]:
        """Tenants with demand or with requests waiting."""
        return {t for t, u in self._use.items() if u.demand(now) > 0} | {t for t, n in waiting.items() if n}

    def held(self, tenant: str) -> int:
        use = self._use.get(tenant)
        return use.held if use is not None else 0

    def share(self, tenant: str, slots: float, weights: dict[str, float], waiting: dict[str, int],
              now: float) -> float:
        """``tenant``'s share of ``slots`` among the active tenants (``tenant`` counted active)."""
        active = self._active(waiting, now)
        active.add(tenant)
        total = sum(weights.get(t, 1.0) for t in active)
        return slots * weights.get(tenant, 1.0) / total

    def within_share(self, tenant: str, slots: float, weights: dict[str, float], waiting: dict[str, int],
                     now: float) -> bool:
        """Whether one more slot for ``tenant`` keeps it within its share."""
        return self.held(tenant) + 1 <= self.share(tenant, slots, weights, waiting, now)

    def promised(self, waiting: dict[str, int], now: float) -> bool:
        """Whether a tenant shows demand with nothing waiting: the slots it uses, up to its share,
        are promised to it, and a full fleet's next free slot may be its own as soon as it asks."""
        return any(not waiting.get(name) and use.demand(now) > 0 for name, use in self._use.items())

    def held_back(self, for_others_than: str | None, slots: float, weights: dict[str, float],
                  waiting: dict[str, int], now: float) -> tuple[float, float | None]:
        """Slots held back for active tenants below their share with nothing waiting (other than
        ``for_others_than``), and when the soonest of those holds lapses (None: none does)."""
        active = self._active(waiting, now)
        if for_others_than is not None:
            active.add(for_others_than)
        total = sum(weights.get(t, 1.0) for t in active) or 1.0
        back = 0.0
        lapse: float | None = None
        for name, use in self._use.items():
            if name == for_others_than or waiting.get(name):
                continue
            demand = use.demand(now)
            share = slots * weights.get(name, 1.0) / total
            keep = min(float(demand), share) - use.held
            if keep > 0:
                back += keep
                end = use.expires()
                lapse = end if lapse is None else min(lapse, end)
        return back, lapse
