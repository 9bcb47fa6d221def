"""The prefill backlog: the prompt work this instance sent each replica, drained at the prefill rate."""

from __future__ import annotations

from routing.backlog import Backlog
from tests.support.clock import Clock


def test_the_backlog_drains_at_the_prefill_rate() -> None:
    clock = Clock()
    backlog = Backlog(1000.0, clock)
    backlog.add("a", 1500)
    assert backlog.get("a") == 1500 and backlog.get("b") == 0
    clock.t = 1.0
    assert backlog.get("a") == 500
    backlog.add("a", 100)
    clock.t = 1.5
    assert backlog.get("a") == 100
    clock.t = 9.0
    assert backlog.get("a") == 0
