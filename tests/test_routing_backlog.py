"""New keys placed by prefill backlog while one instance carries all the traffic."""

from __future__ import annotations

import collections
import math

from routing import RouteFeedback, RouteRequest, RoutingSettings
from routing.backlog import Backlog, Committed, LastSent
from routing.load import SharedLoad
from routing.prefix_affinity import PrefixAffinity

from bench.routing_sim import SimView as View
from tests.support.clock import Clock


def one_off(i: int, chars: int) -> RouteRequest:
    text = f"prompt {i}: " + "".join(f"w{i}x{j} " for j in range(chars // 8))
    return RouteRequest("chat", "m", "t", {"model": "m", "messages": [{"role": "user", "content": text[:chars]}]})


def alone_fleet(n: int = 8) -> list[View]:
    # The replicas report exactly this instance's requests (one each, already
    # in flight), so the instance knows it is alone.
    return [View(f"r{i}", in_flight=1, running=1.0, waiting=0.0, in_flight_at_scrape=1) for i in range(n)]


def send(policy: PrefixAffinity, request: RouteRequest, replicas: list[View]) -> View:
    chosen = policy.prefer(request, replicas)[0]
    chosen.in_flight += 1
    return chosen


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


def test_committed_work_fades_with_its_time_constant() -> None:
    clock = Clock()
    committed = Committed(10.0, clock)
    committed.add("a", 1000)
    assert committed.get("a") == 1000 and committed.get("b") == 0
    clock.t = 10.0
    assert abs(committed.get("a") - 1000 / math.e) < 1e-6
    committed.add("a", 100)
    clock.t = 20.0
    assert abs(committed.get("a") - (1000 / math.e + 100) / math.e) < 1e-6


def test_young_keys_remember_the_newest_placements_only() -> None:
    young = LastSent()
    for k in range(5000):
        young.put(k, f"r{k % 8}")
    assert len(young) == 4096 and young.get(0) is None and young.get(4999) == "r7"


def test_one_off_prompts_avoid_the_replica_handed_a_long_prompt() -> None:
    # Counting requests, a replica given one 10K-token prompt looks as free as one
    # given a 250-token prompt; its prefill queue says otherwise.
    clock = Clock()
    policy, replicas = PrefixAffinity(RoutingSettings(prefill_tokens_per_s=1000.0), clock), alone_fleet()
    policy.prefer(one_off(-1, 400), replicas)  # the instance first sees that it is alone
    clock.t = 100.0  # every queue drained
    big = send(policy, one_off(0, 40_000), replicas)
    small = [send(policy, one_off(i, 1000), replicas) for i in range(1, 15)]
    assert big not in small
    assert {r.name for r in small} == {r.name for r in replicas} - {big.name}
    assert policy.stats()["alone"] is True
    # Without the view that it is alone (another instance shares the replicas),
    # the same prompts hash to their rendezvous choices regardless of backlog.
    shared = [View(f"r{i}", in_flight=1, running=9.0, waiting=0.0, in_flight_at_scrape=1) for i in range(8)]
    other, fresh = (PrefixAffinity(RoutingSettings(prefill_tokens_per_s=1000.0), Clock()) for _ in range(2))
    other.prefer(one_off(0, 40_000), shared)
    firsts = [other.prefer(one_off(i, 1000), shared)[0].name for i in range(1, 15)]
    assert firsts == [fresh.peek(one_off(i, 1000), shared)[0].name for i in range(1, 15)]
    assert other.stats()["alone"] is False


def test_a_new_conversations_requests_stay_together_before_its_first_answer() -> None:
    clock = Clock()
    policy, replicas = PrefixAffinity(RoutingSettings(prefill_tokens_per_s=1000.0), clock), alone_fleet()
    policy.prefer(one_off(-1, 400), replicas)
    clock.t = 100.0
    first = send(policy, one_off(7, 20_000), replicas)
    # Its queue is now the longest, but the same prompt's next requests follow it ...
    again = [send(policy, one_off(7, 20_000), replicas) for _ in range(5)]
    assert again[0] is first and again[1] is first
    assert any(r is not first for r in again)  # ... but not without limit: the bound holds
    # ... and once answered, the index takes over from the young-key memory.
    for r in replicas:
        r.in_flight = 1
    policy.observe(one_off(7, 20_000), RouteFeedback(first.name, None, None, True))
    assert policy.prefer(one_off(7, 20_000), replicas)[0] is first


def sibling(i: int) -> RouteRequest:
    """One of several agents under a shared organisation prompt: same key, its own context."""
    system = "Organisation handbook: answer politely, cite policy numbers. " * 40 + f"You are agent {i}."
    return RouteRequest("chat", "m", "t", {"model": "m", "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": f"question for agent {i}"}]})


def test_a_new_keys_next_requests_follow_it_past_the_tight_new_key_bound() -> None:
    clock = Clock()
    policy, replicas = PrefixAffinity(RoutingSettings(prefill_tokens_per_s=1000.0), clock), alone_fleet()
    policy.prefer(one_off(-1, 400), replicas)
    clock.t = 100.0
    first = send(policy, sibling(1), replicas)  # a new organisation: placed by backlog
    first.in_flight += 2  # now past the tight bound for new keys (1.25 x mean, floor 1) ...
    # ... but its siblings, before any answer is back, still follow it: the usual bound holds.
    assert send(policy, sibling(2), replicas) is first
    first.in_flight += 4  # swamped: past twice the mean
    assert send(policy, sibling(3), replicas) is not first


def test_an_instance_starting_on_an_idle_fleet_sees_at_once_that_it_is_alone() -> None:
    clock = Clock()
    load = SharedLoad(30.0, clock)
    load.update([View(f"r{i}", running=0.0, waiting=0.0) for i in range(4)])  # nothing running yet
    clock.t += 1.0
    # Its own requests are all the replicas report: averaging from the idle zeros
    # would take tens of seconds to say so.
    load.update([View(f"r{i}", in_flight=2, running=2.0, waiting=0.0) for i in range(4)])
    assert load.alone()
    clock.t += 1.0
    load.update([View(f"r{i}", in_flight=2, running=2.0, waiting=10.0) for i in range(4)])
    clock.t += 120.0
    load.update([View(f"r{i}", in_flight=2, running=2.0, waiting=10.0) for i in range(4)])
    assert not load.alone()  # others' requests wait there too


def placements(memory_s: float) -> collections.Counter[str]:
    """Where 64 new keys go, each arriving after the previous one's prefill is done."""
    clock = Clock()
    settings = RoutingSettings(prefill_tokens_per_s=100_000.0, placement_memory_s=memory_s)
    policy, replicas = PrefixAffinity(settings, clock), alone_fleet()
    policy.prefer(one_off(-1, 400), replicas)
    counts: collections.Counter[str] = collections.Counter()
    for i in range(64):
        clock.t = 100.0 + i  # every queue drained since the last placement
        counts[policy.prefer(one_off(i, 8000), replicas)[0].name] += 1
    return counts


def test_new_keys_spread_by_the_work_placed_lately_not_only_by_queues() -> None:
    # Each new key brings more requests (a group's next prompts). With drained
    # queues only, the rendezvous order places them, unevenly; remembering what
    # went where in the last half-minute spreads them as evenly as they come.
    remembered, forgotten = placements(30.0), placements(1e-3)
    assert len(remembered) == 8 and max(remembered.values()) - min(remembered.values()) <= 1
    assert max(forgotten.values()) - min(forgotten.values()) >= 3
