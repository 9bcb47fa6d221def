"""Routing policies over fake replica views: orders, stickiness, spreading, bounds, membership."""

from __future__ import annotations

import random
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from routing import RouteFeedback, RouteRequest, RoutingSettings, load_now, make_policy
from routing.consistent_hash import ConsistentHash
from routing.least_load import LeastLoad
from routing.prefix_affinity import PrefixAffinity
from routing.ttft_affinity import TTFTAffinity
from routing.rendezvous import Rendezvous, within_bound
from routing.round_robin import RoundRobin
from gateway.observe.metrics import _PolicyCollector

# The benchmark's replica view is the same fake of routing.base.ReplicaView.
from bench.routing_sim import SimView as View


def fleet(n: int = 8) -> list[View]:
    return [View(f"r{i}") for i in range(n)]


SYSTEM = "You are the assistant of Example Corp. Follow the policies below. " * 20


def turn(conv: int, k: int, system: str = SYSTEM) -> RouteRequest:
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": f"conversation {conv}: " + "q " * 40}]
    for i in range(1, k):
        msgs += [{"role": "assistant", "content": f"answer {i} " * 30}, {"role": "user", "content": f"follow {i}"}]
    return RouteRequest("chat", "m", "tenant", {"model": "m", "messages": msgs})


def serve(policy, request: RouteRequest, replicas: list[View]) -> str:
    chosen = policy.prefer(request, replicas)[0].name
    policy.observe(request, RouteFeedback(chosen, None, None, True))  # no prompt-token details
    return chosen


def warm_up(policy, replicas: list[View], n: int = 200) -> None:
    for i in range(n):
        serve(policy, turn(100_000 + i, 1), replicas)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 12), conv=st.integers(0, 10_000), loads=st.lists(st.integers(0, 30), min_size=12, max_size=12))
def test_every_policy_returns_a_permutation(n: int, conv: int, loads: list[int]) -> None:
    replicas = fleet(n)
    for r, load in zip(replicas, loads):
        r.in_flight = load
    for name in ("prefix_affinity", "least_load", "round_robin", "consistent_hash"):
        order = make_policy(RoutingSettings(policy=name)).prefer(turn(conv, 1 + conv % 3), replicas)
        assert sorted(r.name for r in order) == sorted(r.name for r in replicas)


def test_make_policy_defaults_to_ttft() -> None:
    assert RoutingSettings().policy == "ttft"
    assert isinstance(make_policy(RoutingSettings()), TTFTAffinity)
    assert isinstance(make_policy(RoutingSettings(policy="prefix_affinity")), PrefixAffinity)
    assert isinstance(make_policy(RoutingSettings(policy="round_robin")), RoundRobin)
    assert isinstance(make_policy(RoutingSettings(policy="least_load")), LeastLoad)
    assert isinstance(make_policy(RoutingSettings(policy="consistent_hash")), ConsistentHash)


@given(key=st.integers(0, 2**64 - 1))
def test_rendezvous_orders_agree_across_instances_and_ignore_list_order(key: int) -> None:
    a, b = fleet(), list(reversed(fleet()))
    assert [r.name for r in Rendezvous().order(key, a)] == [r.name for r in Rendezvous().order(key, b)]


def test_weighted_rendezvous_gives_first_choices_in_proportion_to_weight() -> None:
    replicas = fleet(4)
    replicas[0].weight = 3.0
    firsts = Counter(Rendezvous().order(random.Random(i).getrandbits(64), replicas)[0].name for i in range(12_000))
    assert abs(firsts["r0"] / 12_000 - 0.5) < 0.03  # 3 / (3 + 1 + 1 + 1)


def test_multi_turn_requests_stay_on_their_replica() -> None:
    policy, replicas = PrefixAffinity(), fleet()
    warm_up(policy, replicas)
    for conv in range(40):
        homes = {serve(policy, turn(conv, k), replicas) for k in range(1, 6)}
        assert len(homes) == 1, f"conversation {conv} moved: {homes}"


def test_a_system_prompt_in_every_request_spreads_over_all_replicas() -> None:
    # Sixteen conversations in flight at any time: the load spreads them, though every
    # replica would serve the shared system prompt equally warm.
    policy, replicas = PrefixAffinity(), fleet()
    held: list[tuple[RouteRequest, View]] = []
    firsts: Counter[str] = Counter()
    for conv in range(800):
        if len(held) == 16:
            request, replica = held.pop(0)
            replica.in_flight -= 1
            policy.observe(request, RouteFeedback(replica.name, None, None, True))
        request = turn(conv, 1)
        chosen = policy.prefer(request, replicas)[0]
        chosen.in_flight += 1
        firsts[chosen.name] += 1
        held.append((request, chosen))
    assert set(firsts) == {r.name for r in replicas}
    assert max(firsts.values()) < 800 / 8 * 1.6


def test_a_hot_shared_prefix_spreads_under_load() -> None:
    # One conversation is extremely hot: the bound moves its excess elsewhere.
    policy, replicas = PrefixAffinity(), fleet()
    for r in replicas:
        r.running, r.waiting = 4.0, 0.0
    home = policy.prefer(turn(7, 1), replicas)[0]
    home.in_flight = 30  # swamped right now, as this instance sees it
    spread = Counter(policy.prefer(turn(7, 1), replicas)[0].name for _ in range(20))
    assert home.name not in spread
    home.in_flight = 0
    home.waiting = 100.0  # a long queue of other clients' requests there, as the replica reports
    shed = Counter(policy.prefer(turn(conv, 1), replicas)[0].name for conv in range(400))
    assert shed[home.name] < 400 / 8 / 2


def test_the_bound_and_the_load_it_reads() -> None:
    # 20 in flight on 4 replicas plus this one: the cap is ceil(1.25 x 21 / 4) = 7.
    assert within_bound([10, 0, 9, 1], [1, 1, 1, 1], 0.25) == [False, True, False, True]
    # Others' requests as last scraped, plus ours now (not ours twice).
    assert load_now(View("x", weight=2.0, in_flight=4, running=6.0, in_flight_at_scrape=4)) == 3.0
    assert load_now(View("x", weight=2.0, in_flight=1, running=6.0, in_flight_at_scrape=4)) == 1.5
    assert load_now(View("x", weight=2.0, in_flight=5, running=1.0, in_flight_at_scrape=4)) == 2.5
    assert load_now(View("x", weight=1.0, in_flight=3)) == 3.0  # not scraped yet


def test_removing_draining_or_ejecting_a_replica_reroutes_only_its_keys() -> None:
    # Nothing known of where prefixes live and no load: the keys' rendezvous orders decide.
    policy, replicas = PrefixAffinity(), fleet()
    for conv in range(600):  # the shared system prompt is known to be in every request
        policy.keyer.key_for(turn(conv, 1), len(replicas))
    requests = [turn(conv, 1) for conv in range(600)]
    before = {id(q): policy.peek(q, replicas)[0].name for q in requests}
    for gone in ("r3", "r6"):
        remaining = [r for r in replicas if r.name != gone]
        moved = [q for q in requests if policy.peek(q, remaining)[0].name != before[id(q)]]
        assert all(before[id(q)] == gone for q in moved)
        assert 0 < len(moved) <= len(requests) * (1 / 8 + 0.05)
    assert all(policy.peek(q, replicas)[0].name == before[id(q)] for q in requests), "adding it back restores"


def test_a_key_that_spilled_is_followed_by_the_instance_that_saw_it() -> None:
    policy, replicas = PrefixAffinity(), fleet()
    warm_up(policy, replicas)
    first = turn(5, 1)
    home = policy.prefer(first, replicas)[0]
    home.in_flight = 50
    spilled = policy.prefer(first, replicas)[0]
    assert spilled is not home
    policy.observe(first, RouteFeedback(spilled.name, None, None, True))
    home.in_flight = 0
    assert policy.prefer(turn(5, 2), replicas)[0] is spilled
    assert policy.moved >= 1  # counted: it left its key's home


def test_concurrent_acquire_release_returns_every_in_flight_count_to_zero() -> None:
    rng = random.Random(1234)
    policy, replicas = PrefixAffinity(), fleet()
    held: list[tuple[RouteRequest, View]] = []
    firsts: Counter[str] = Counter()
    for _ in range(20_000):
        if held and (rng.random() < 0.5 or len(held) > 64):
            request, replica = held.pop(rng.randrange(len(held)))
            replica.in_flight -= 1
            policy.observe(request, RouteFeedback(replica.name, 500, rng.randrange(500), rng.random() > 0.01))
        else:
            request = turn(rng.randrange(300), 1 + rng.randrange(3))
            chosen = policy.prefer(request, replicas)[0]
            chosen.in_flight += 1
            firsts[chosen.name] += 1
            held.append((request, chosen))
    for _request, replica in held:
        replica.in_flight -= 1
    assert all(r.in_flight == 0 for r in replicas)
    mean = sum(firsts.values()) / len(replicas)
    assert max(firsts.values()) < mean * 1.5


def test_round_robin_and_least_load_orders() -> None:
    replicas = fleet(3)
    rr = RoundRobin()
    assert [rr.prefer(turn(0, 1), replicas)[0].name for _ in range(4)] == ["r0", "r1", "r2", "r0"]
    replicas[0].in_flight, replicas[1].in_flight = 5, 1
    assert [r.name for r in LeastLoad().prefer(turn(0, 1), replicas)] == ["r2", "r1", "r0"]


def test_popularity_needs_repeated_evidence_before_a_prefix_is_wide() -> None:
    from routing.hotness import Popularity

    pop = Popularity(capacity=100)
    wide = 1 / 8
    for _ in range(3):  # a burst of three turns of one conversation
        pop.first_narrow([1], wide, record=True)
        pop.tick()
    assert pop.first_narrow([1], wide, record=False) == 0  # not wide: chosen
    for _ in range(10):  # a prefix in every request
        pop.first_narrow([2], wide, record=True)
        pop.tick()
    assert pop.first_narrow([2, 1], wide, record=False) == 1  # wide: passed over
    # The first key not wide is chosen; a peek records nothing.
    assert pop.first_narrow([2, 1, 3], wide, record=False) == 1
    assert pop.first_narrow([2, 2], wide, record=False) == 1  # all wide: the deepest
    assert pop.first_narrow([3], wide, record=False) == 0  # never seen: share 0
    for k in range(1000):
        pop.first_narrow([2, 1000 + k], wide, record=True)
    assert len(pop) <= 100, "bounded memory"
    assert pop.first_narrow([2, 1], wide, record=False) == 1, "a key in every request stays wide"


def test_decisions_the_bound_made_against_the_cost_are_counted() -> None:
    # Short requests make a typical request cheap, so a warm replica with more in flight
    # still costs less than a cold one would. One in flight everywhere: the cap is
    # ceil(1.25 x 5 / 4) = 2 with this request, so the home takes it; with two there,
    # ceil(1.25 x 6 / 4) = 2 again, the home is past it, and the bound decides.
    policy, replicas = PrefixAffinity(clock=lambda: 1e9), fleet(4)  # backlogs long drained
    for i in range(100):
        serve(policy, turn(200_000 + i, 1, system="short"), replicas)
    assert policy.bound_overrides == 0
    long_system = "A long policy document that only this conversation carries. " * 400
    home = policy.prefer(first := turn(7, 1, system=long_system), replicas)[0]
    policy.observe(first, RouteFeedback(home.name, None, None, True))
    for r in replicas:
        r.in_flight = 1
    assert policy.prefer(turn(7, 2, system=long_system), replicas)[0] is home  # within the bound: it stays
    assert policy.bound_overrides == 0
    home.in_flight = 2
    moved = policy.prefer(turn(7, 2, system=long_system), replicas)[0]
    assert moved is not home and policy.bound_overrides == 1
    assert policy.stats()["bound_overrides"] == 1
    # What /metrics exports of it.
    samples = {s.name: s.value for family in _PolicyCollector(lambda: policy).collect() for s in family.samples}
    assert samples["kvgate_routing_bound_overrides_total"] == 1


def test_popularity_counts_the_requests_since_a_prefix_turned_wide_and_forgets_them_when_narrow() -> None:
    from routing.hotness import Popularity

    pop = Popularity(capacity=100)
    wide = 1 / 2  # two replicas: count - 1.645 sqrt(count) > age / 2 first holds at 13 of 14
    seen = []
    for _ in range(16):
        pop.first_narrow([7], wide, record=True)
        pop.tick()
        seen.append(pop.since_wide(7))
    assert seen == [0] * 13 + [1, 2, 3]  # judged on the count before each request: wide at the 14th
    assert pop.first_narrow([7, 8], wide, record=False) == 1 and pop.since_wide(7) == 3  # a peek moves nothing
    for k in range(40):  # other traffic: its share falls below a replica's
        pop.first_narrow([100 + k], wide, record=True)
        pop.tick()
    assert pop.first_narrow([7, 8], wide, record=True) == 0
    assert pop.since_wide(7) == 0 and pop.since_wide(12345) == 0


def test_a_share_near_a_replicas_is_not_judged_wide_by_chance() -> None:
    from routing.hotness import Popularity

    # Four organisations on four replicas: each has exactly a replica's share. A point
    # estimate over a short window flips them; the 95th percentile of the count does not.
    pop = Popularity(capacity=1000)
    rng = random.Random(5)
    flips = 0
    for _ in range(2000):
        org = rng.randrange(4)
        flips += pop.first_narrow([org, 1000 + rng.randrange(10**6)], 1 / 4, record=True) != 0
        pop.tick()
    assert flips < 2000 * 0.05, flips  # the old point estimate: 791, two in five
