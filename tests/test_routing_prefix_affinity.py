"""Prefix affinity's cost model: where the prompt is warm, what is queued, a cap at every decision."""

from __future__ import annotations

import math
import random

import pytest

from routing import RouteFeedback, RouteRequest, RoutingSettings
from routing.prefix_affinity import PrefixAffinity
from routing.ttft_affinity import TTFTAffinity
from routing.rendezvous import Rendezvous

from bench.routing_sim import SimView as View
from tests.support.chats import conversation
from tests.support.clock import Clock

ORG = "Policies of Example Corp: refunds within 30 days, escalate legal threats. " * 60  # ~4.4K chars


def twin(t: int, q: int, org: str = ORG) -> RouteRequest:
    system = org + f"You are twin {t}, " + f"profile line {t}. " * 12
    return RouteRequest("chat", "m", "org", {"model": "m", "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": f"question {q}: " + "details " * 30}]})


def one_off(i: int, chars: int) -> RouteRequest:
    text = f"prompt {i}: " + "".join(f"w{i}x{j} " for j in range(chars // 8))
    return RouteRequest("chat", "m", "t", {"model": "m", "messages": [{"role": "user", "content": text[:chars]}]})


def fleet(n: int = 8) -> list[View]:
    return [View(f"r{i}") for i in range(n)]


# The scenarios both prefix policies must pass (agreement without talking, keys, ties).
BOTH = pytest.mark.parametrize("make", [PrefixAffinity, TTFTAffinity], ids=["prefix_affinity", "ttft"])


def served(policy: PrefixAffinity | TTFTAffinity, request: RouteRequest, replicas: list[View]) -> View:
    chosen = policy.prefer(request, replicas)[0]
    policy.observe(request, RouteFeedback(chosen.name, None, None, True))
    return chosen


def cap(loads: list[int], epsilon: float) -> int:
    """ceil((1 + epsilon) x mean in flight, the new request included)."""
    return max(1, math.ceil((1 + epsilon) * (sum(loads) + 1) / len(loads) - 1e-9))


def test_the_bound_holds_at_every_decision_under_seeded_concurrent_load() -> None:
    # Hot organisations, as many as replicas, and one-off prompts, with clients that
    # hold requests for random times: at every decision the replica that takes the
    # request stays within ceil((1 + eps) x mean in flight), counting this request.
    for seed, epsilon in ((1, 0.25), (2, 0.25), (3, 0.1), (4, 1.0)):
        rng = random.Random(seed)
        policy, replicas = PrefixAffinity(RoutingSettings(epsilon=epsilon), Clock()), fleet(4)
        orgs = [f"Organisation {o} handbook. " * 200 for o in range(4)]
        held: list[tuple[RouteRequest, View]] = []
        for step in range(6000):
            if held and (rng.random() < 0.45 or len(held) >= 24):
                request, replica = held.pop(rng.randrange(len(held)))
                replica.in_flight -= 1
                policy.observe(request, RouteFeedback(replica.name, None, None, True))
                continue
            if rng.random() < 0.8:
                request = twin(rng.randrange(50), step, orgs[min(3, int(rng.expovariate(1.0)))])
            else:
                request = one_off(step, rng.randrange(100, 8000))
            loads = [r.in_flight for r in replicas]
            chosen = policy.prefer(request, replicas)[0]
            assert chosen.in_flight + 1 <= cap(loads, epsilon), (seed, step, loads, chosen.name)
            chosen.in_flight += 1
            held.append((request, chosen))
        for _request, replica in held:
            replica.in_flight -= 1
        assert all(r.in_flight == 0 for r in replicas)


def test_the_bound_counts_what_other_instances_have_in_flight() -> None:
    # Other clients have 24 requests in flight over the 4 replicas, as last reported;
    # where they are by now is not known, so each replica counts a quarter of them.
    policy, replicas = PrefixAffinity(), fleet(4)
    home = served(policy, twin(1, 1), replicas)
    for r in replicas:
        r.running, r.waiting = (12.0 if r is home else 4.0), 0.0
    # 0 + 6 + this one = 7, within ceil(1.25 x (24 + 1) / 4) = 8: the warm home takes it.
    assert policy.prefer(twin(1, 2), replicas)[0] is home
    # With 3 of this instance's there, 3 + 6 + 1 = 10 would pass ceil(1.25 x 28 / 4) = 9.
    home.in_flight = 3
    assert policy.prefer(twin(1, 2), replicas)[0] is not home


def test_a_warm_prefix_outweighs_a_short_queue_but_not_a_long_one() -> None:
    clock = Clock()
    policy, replicas = PrefixAffinity(RoutingSettings(prefill_tokens_per_s=1000.0), clock), fleet(4)
    home = served(policy, twin(1, 1), replicas)
    clock.t = 100.0  # everything drained
    prompt_tokens = len(twin(1, 2).body["messages"][0]["content"]) / 4
    # Work queued at home worth less than the warm prefix: the twin stays.
    policy.backlog.add(home.name, prompt_tokens * 0.5, 1000.0)
    assert policy.prefer(twin(1, 2), replicas)[0] is home
    # Queued work past the prefix's whole prefill: it is cheaper to start afresh elsewhere.
    clock.t = 200.0
    policy.backlog.add(home.name, prompt_tokens * 3, 1000.0)
    assert policy.prefer(twin(1, 3), replicas)[0] is not home


def test_one_off_prompts_avoid_the_replica_handed_a_long_prompt() -> None:
    # Counting requests, a replica given one 10K-token prompt looks as free as one
    # given a 250-token prompt; its prefill queue says otherwise.
    clock = Clock()
    policy, replicas = PrefixAffinity(RoutingSettings(prefill_tokens_per_s=1000.0), clock), fleet()
    big = policy.prefer(one_off(0, 40_000), replicas)[0]
    small = [policy.prefer(one_off(i, 1000), replicas)[0] for i in range(1, 15)]
    assert big not in small


def test_a_new_conversations_requests_stay_together_before_its_first_answer() -> None:
    # The index learns at decision time: the second copy, sent before any answer,
    # finds the prompt warm (or about to be) where the first went.
    policy, replicas = PrefixAffinity(RoutingSettings(prefill_tokens_per_s=1000.0), Clock()), fleet()
    for r in replicas:
        r.in_flight = 4  # room under the bound for a second copy
    first = policy.prefer(one_off(7, 20_000), replicas)[0]
    first.in_flight += 1
    assert policy.prefer(one_off(7, 20_000), replicas)[0] is first


@BOTH
def test_instances_that_share_nothing_agree_where_a_new_conversation_lives(make: type) -> None:
    # Its first turn reaches instance a, its later turns instance b, which never saw
    # it: both presume the key's home holds it, so both send it there.
    clock = Clock()  # a second between conversations: queues drain
    a, b = make(clock=clock), make(clock=clock)
    # The replicas report traffic neither instance sent: each knows it is not alone.
    replicas_a, replicas_b = ([View(f"r{i}", running=4.0, waiting=0.0) for i in range(8)] for _ in range(2))
    for c in range(1000, 1020):  # each instance sees the application's system prompt in every request
        served(a, conversation(c, 1, ORG), replicas_a)
        served(b, conversation(c, 1, ORG), replicas_b)
    for c in range(60):
        clock.t += 1.0
        first = served(a, conversation(c, 1, ORG), replicas_a).name
        assert served(b, conversation(c, 2, ORG), replicas_b).name == first
        assert served(b, conversation(c, 4, ORG), replicas_b).name == first


def flat(c: int, turns: int) -> RouteRequest:
    """A completions conversation (no messages): a system prompt in every request, then turns appended."""
    text = ORG + "".join(f"conversation {c} turn {t}: " + f"c{c}t{t} words " * 120 for t in range(turns))
    return RouteRequest("completions", "m", "t", {"model": "m", "prompt": text})


@BOTH
def test_a_flat_prompts_turns_keep_one_key_and_instances_that_share_nothing_agree_on_it(make: type) -> None:
    # A flat prompt has no message end before its own end: its key is where its
    # conversation starts (past the system prompt every request carries), not all of it,
    # so its later turns keep its key and its home.
    clock = Clock()
    a, b = make(clock=clock), make(clock=clock)
    replicas_a, replicas_b = ([View(f"r{i}", running=4.0, waiting=0.0) for i in range(8)] for _ in range(2))
    for c in range(1000, 1020):  # each instance sees the system prompt in every request
        served(a, flat(c, 1), replicas_a)
        served(b, flat(c, 1), replicas_b)
    keys = [a.keyer.key_for(flat(7, t), 8, learn=False) for t in (1, 2, 5)]
    assert len({k.key for k in keys}) == 1 and len(ORG) < keys[0].cut < len(flat(7, 1).body["prompt"])
    for c in range(40):
        clock.t += 1.0
        first = served(a, flat(c, 1), replicas_a).name
        assert served(b, flat(c, 2), replicas_b).name == first
        assert served(b, flat(c, 4), replicas_b).name == first


@BOTH
def test_two_instances_fed_the_same_facts_agree_on_every_decision(make: type) -> None:
    rng = random.Random(5)
    clock = Clock()
    a, b = make(clock=clock), make(clock=clock)
    replicas = fleet(6)
    for step in range(2000):
        clock.t += rng.expovariate(50.0)
        for r in replicas:
            r.in_flight = rng.randrange(4)
            r.running, r.waiting = float(r.in_flight + rng.randrange(3)), float(rng.randrange(3))
        request = twin(rng.randrange(40), step) if rng.random() < 0.5 else conversation(rng.randrange(40),
                                                                                       1 + rng.randrange(4))
        order_a = [r.name for r in a.prefer(request, replicas)]
        # b ranks its own copy of the request (nothing shared between the instances)
        copy = RouteRequest(request.endpoint, request.model, request.namespace, request.body)
        assert [r.name for r in b.prefer(copy, replicas)] == order_a, step
        a.observe(request, RouteFeedback(order_a[0], None, None, True))
        b.observe(copy, RouteFeedback(order_a[0], None, None, True))


@BOTH
def test_equal_costs_fall_to_the_rendezvous_order(make: type) -> None:
    policy, replicas = make(), fleet()
    request = one_off(3, 2000)
    key = policy.keyer.key_for(request, len(replicas), learn=False).key
    assert [r.name for r in policy.peek(request, replicas)] == [r.name for r in Rendezvous().order(key, replicas)]


def test_a_new_conversation_goes_where_fewer_are_decoding_and_a_warm_turn_stays_unless_home_is_much_busier() -> None:
    # Every prefill is done (nothing queued anywhere); the replicas differ only in how
    # many requests they are decoding. Queued prefill alone would call them all empty.
    clock = Clock()
    policy, replicas = PrefixAffinity(RoutingSettings(prefill_tokens_per_s=1000.0), clock), fleet(4)
    for k, r in enumerate(replicas):
        r.in_flight = 3 if k else 1
    for i in range(6):
        clock.t += 100.0  # the last one's prefill is done too
        assert policy.prefer(one_off(100 + i, 2000), replicas)[0] is replicas[0]
    # A twin's next turn at a warm home with one more in flight than elsewhere stays ...
    for r in replicas:
        r.in_flight = 2
    home = served(policy, twin(3, 1), replicas)
    clock.t += 100.0
    home.in_flight = 3
    assert policy.prefer(twin(3, 2), replicas)[0] is home
    # ... and leaves for an idle replica when home is decoding for four (still within the bound).
    others = [r for r in replicas if r is not home]
    home.in_flight, others[0].in_flight, others[1].in_flight, others[2].in_flight = 4, 0, 4, 4
    assert policy.prefer(twin(3, 3), replicas)[0] is others[0]
