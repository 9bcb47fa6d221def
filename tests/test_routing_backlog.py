"""The prefill backlog: the prompt work this instance sent each replica, drained at that replica's rate."""

from __future__ import annotations

from routing.backlog import Backlog
from tests.support.clock import Clock


def test_the_backlog_drains_at_each_replicas_own_rate() -> None:
    clock = Clock()
    backlog = Backlog(clock)
    backlog.add("a", 1500, 1000.0)
    backlog.add("slow", 1500, 500.0)
    assert backlog.get("a", 1000.0) == 1500 and backlog.get("b", 1000.0) == 0
    clock.t = 1.0
    assert backlog.queued(["a", "slow", "b"], [1000.0, 500.0, 1000.0]) == [500, 1000, 0]
    backlog.add("a", 100, 1000.0)
    clock.t = 1.5
    assert backlog.get("a", 1000.0) == 100
    clock.t = 9.0
    assert backlog.get("a", 1000.0) == 0


def test_without_a_rate_only_replies_drain_it() -> None:
    # No evidence of the replica's speed, no assumed drain: a reply proves its request's
    # prefill done, and all sent before it.
    clock = Clock()
    backlog = Backlog(clock)
    first = backlog.add("a", 1000, None)
    backlog.add("a", 300, None)
    clock.t = 100.0
    assert backlog.get("a", None) == 1300
    backlog.done("a", first, None)
    assert backlog.get("a", None) == 300
