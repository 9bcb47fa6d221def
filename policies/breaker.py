"""A circuit breaker for a shared dependency (Redis): fail once, skip it for a while, probe.

A hung Redis costs every request its socket timeout. After one failure the
breaker opens for ``open_s``; calls skip Redis and use their local fallback.
When the time is up, the next call is let through as a probe (only one at a
time); its success closes the breaker, its failure reopens it. A probe that
never reports (its request was cancelled) stops blocking others after
``open_s``.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class Breaker:
    def __init__(self, open_s: float = 5.0, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._open_s = open_s
        self._clock = clock
        self._open_until: float | None = None
        self._probe_started: float | None = None

    @property
    def degraded(self) -> bool:
        """True from the first failure until a probe succeeds."""
        return self._open_until is not None

    def allow(self) -> bool:
        if self._open_until is None:
            return True
        now = self._clock()
        if now < self._open_until:
            return False
        if self._probe_started is not None and now - self._probe_started < self._open_s:
            return False  # one probe at a time
        self._probe_started = now
        return True

    def success(self) -> None:
        self._open_until = None
        self._probe_started = None

    def failure(self) -> None:
        self._open_until = self._clock() + self._open_s
        self._probe_started = None
