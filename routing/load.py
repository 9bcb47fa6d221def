"""The load view that gateway instances share, averaged over time.

Two routers agree only while their load views agree. Each instance's own
in-flight count is private, but the replicas' scraped metrics
(``running + waiting``) are the same for every instance. ``SharedLoad`` keeps
a time-weighted average of that shared part per replica (time constant
``tau_s``): it follows persistent imbalance within tens of seconds but not the
Poisson noise of a few requests, and it is nearly identical on every instance
(each samples the same piecewise-constant scrape series, at different moments).

The policy uses it to decide where a key *lives* (its home moves only when a
replica is persistently past the bound, on every instance at once), and the
instantaneous ``load_of`` only to refuse a replica that is swamped right now.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Sequence

from .base import ReplicaView, reported

__all__ = ["SharedLoad"]


# This instance is "alone" while its own in-flight requests are at least this
# share of the replicas' reported queues (averaged): no other gateway instance
# (or direct client) sends them traffic it cannot see.
_ALONE_SHARE = 0.75
_ALONE_MIN_LOAD = 1.0


class SharedLoad:
    __slots__ = ("_tau", "_clock", "_avg", "_seen", "_own", "_fleet", "_last")

    def __init__(self, tau_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._tau = tau_s
        self._clock = clock
        self._avg: dict[str, float] = {}
        self._seen: dict[str, float] = {}
        # Averaged totals over the fleet: this instance's in-flight, and the queues
        # the replicas report (everyone's requests).
        self._own = 0.0
        self._fleet = 0.0
        self._last: float | None = None

    def alone(self) -> bool:
        """Whether this instance sends (nearly) all the traffic the replicas see."""
        return self._fleet >= _ALONE_MIN_LOAD and self._own >= _ALONE_SHARE * self._fleet

    def update(self, replicas: Sequence[ReplicaView]) -> None:
        """Fold the current scraped values in (call once per routed request)."""
        now = self._clock()
        self._fold_totals(replicas, now)
        for r in replicas:
            queue = reported(r)
            if queue is None:
                continue
            x = queue / r.weight
            old = self._avg.get(r.name)
            self._avg[r.name] = x if old is None else self._blend(old, x, now - self._seen.get(r.name, now))
            self._seen[r.name] = now
        if len(self._avg) > 4 * max(1, len(replicas)) + 64:
            # Replicas come and go (DNS): forget the ones no longer offered.
            live = {r.name for r in replicas}
            for name in [n for n in self._avg if n not in live]:
                del self._avg[name], self._seen[name]

    def _fold_totals(self, replicas: Sequence[ReplicaView], now: float) -> None:
        queues = [(r.in_flight, q) for r in replicas if (q := reported(r)) is not None]
        if not queues:
            return
        own = float(sum(mine for mine, _ in queues))
        fleet = sum(q for _, q in queues)
        if self._last is None and fleet <= 0:
            # An idle fleet says nothing of who sends it traffic: averaging from its
            # zeros would keep a lone instance from seeing that it is alone for
            # tens of seconds (the first 30 s of every start-up).
            return
        if self._last is None:
            self._own, self._fleet = own, fleet
        else:
            self._own = self._blend(self._own, own, now - self._last)
            self._fleet = self._blend(self._fleet, fleet, now - self._last)
        self._last = now

    def _blend(self, old: float, x: float, dt: float) -> float:
        """The time-weighted average after ``dt`` seconds at ``x`` (just ``x`` without averaging)."""
        if self._tau <= 0:
            return x
        return old + (1.0 - math.exp(-max(0.0, dt) / self._tau)) * (x - old)

    def get(self, replica: ReplicaView) -> float:
        """Averaged shared load, or this instance's in-flight count before any scrape."""
        avg = self._avg.get(replica.name)
        return avg if avg is not None else replica.in_flight / replica.weight
