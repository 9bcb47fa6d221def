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

from .base import ReplicaView

__all__ = ["SharedLoad", "shared_load"]


def shared_load(replica: ReplicaView) -> float | None:
    """The replica's scraped queue per unit weight; None until its metrics were scraped."""
    if replica.running is None and replica.waiting is None:
        return None
    return ((replica.running or 0.0) + (replica.waiting or 0.0)) / replica.weight


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
            x = shared_load(r)
            if x is None:
                continue
            old = self._avg.get(r.name)
            if old is None or self._tau <= 0:
                self._avg[r.name] = x
            else:
                dt = max(0.0, now - self._seen.get(r.name, now))
                self._avg[r.name] = old + (1.0 - math.exp(-dt / self._tau)) * (x - old)
            self._seen[r.name] = now
        if len(self._avg) > 4 * max(1, len(replicas)) + 64:
            # Replicas come and go (DNS): forget the ones no longer offered.
            live = {r.name for r in replicas}
            for name in [n for n in self._avg if n not in live]:
                del self._avg[name], self._seen[name]

    def _fold_totals(self, replicas: Sequence[ReplicaView], now: float) -> None:
        scraped = [r for r in replicas if r.running is not None or r.waiting is not None]
        if not scraped:
            return
        own = float(sum(r.in_flight for r in scraped))
        fleet = sum((r.running or 0.0) + (r.waiting or 0.0) for r in scraped)
        if self._last is None or self._tau <= 0:
            self._own, self._fleet = own, fleet
        else:
            a = 1.0 - math.exp(-max(0.0, now - self._last) / self._tau)
            self._own += a * (own - self._own)
            self._fleet += a * (fleet - self._fleet)
        self._last = now

    def get(self, replica: ReplicaView) -> float:
        """Averaged shared load, or this instance's in-flight count before any scrape."""
        avg = self._avg.get(replica.name)
        return avg if avg is not None else replica.in_flight / replica.weight
