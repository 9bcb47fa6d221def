"""The ttft policy: the time to first token each replica would give, learned rates, the rail, explain."""

from __future__ import annotations

import random
from typing import Callable

from routing import RouteFeedback, RouteRequest, RoutingSettings
from routing.backlog import CHARS_PER_TOKEN
from routing.keys import analyse
from routing.ttft_affinity import TTFTAffinity

from bench.routing_sim import SimView as View
from tests.support.clock import Clock
from tests.test_routing_prefix_affinity import fleet, one_off, served, twin


def rated(n: int = 8, rate: float = 1000.0) -> list[View]:
    """Replicas that have reported their prefill rate (tokens per second)."""
    return [View(f"r{i}", prefill_rate=rate) for i in range(n)]


def test_the_rail_holds_at_every_decision_under_seeded_concurrent_load() -> None:
    # Hot organisations and one-off prompts, replicas of two speeds with pools under
    # pressure, clients that hold requests for random times. At every decision the pick
    # explain() shows is the one prefer() makes, and it keeps the rail: its wait ahead is
    # within the least wait ahead plus (1 + busy) times this request's whole prefill there,
    # plus the learned error.
    for seed in (1, 2, 3):
        rng = random.Random(seed)
        clock = Clock()
        policy = TTFTAffinity(RoutingSettings(), clock)
        replicas = [View(f"r{i}", prefill_rate=(500.0 if i == 0 else 1000.0), kv_tokens=20_000.0,
                         kv_usage=0.0, running=0.0, waiting=0.0) for i in range(4)]
        orgs = [f"Organisation {o} handbook. " * 200 for o in range(4)]
        held: list[tuple[RouteRequest, View]] = []
        refused = 0
        for step in range(3000):
            clock.t += rng.expovariate(20.0)
            for r in replicas:  # what a scrape would have said
                r.kv_usage = min(1.0, r.in_flight * rng.uniform(0.05, 0.2))
                r.waiting = float(rng.randrange(3))
            if held and (rng.random() < 0.45 or len(held) >= 24):
                request, replica = held.pop(rng.randrange(len(held)))
                replica.in_flight -= 1
                policy.observe(request, RouteFeedback(replica.name, 1000, rng.randrange(1000), True,
                                                      ttft_s=rng.uniform(0.0, 0.5)))
                continue
            if rng.random() < 0.8:
                request = twin(rng.randrange(50), step, orgs[min(3, int(rng.expovariate(1.0)))])
            else:
                request = one_off(step, rng.randrange(100, 8000))
            terms = policy.explain(request, replicas)
            chosen = policy.prefer(request, replicas)[0]
            pick = terms[0]
            assert pick.replica == chosen.name, (seed, step)
            assert any(t.rail is None for t in terms)  # the least wait ahead always keeps it
            least = min(t.ahead for t in terms)
            refused += sum(t.rail == "wait" for t in terms)
            assert pick.rail is None
            busy = sum(t.ahead > 0 for t in terms) / len(terms)
            band = policy.learned.error.get(0.0)
            for t in terms:  # the bound each replica was held to, recomputed from the terms
                assert abs(t.bound - (least + (1 + busy) * (t.held + t.uncached) / t.rate + band)) < 1e-6
                assert (t.rail == "wait") == (t.ahead > t.bound), (seed, step)
            assert pick.ahead <= pick.bound + 1e-9, (seed, step)
            # Of the replicas that keep the rails, the pick is within the learned error of the
            # least cost, and computes the fewest tokens among those; the cost adds to the
            # predicted time to first token only what the pick's terms name.
            fit = [t for t in terms if t.rail is None]
            assert pick.cost <= min(t.cost for t in fit) + band + 1e-9
            assert pick.uncached <= min(t.uncached for t in fit if t.cost <= min(x.cost for x in fit) + band)
            assert all(abs(t.cost - t.ttft - t.astray - t.excess - t.refill) < 1e-9 for t in terms)
            fewest = min(t.uncached for t in terms)  # excess: tokens beyond the fewest, priced by busy
            assert all(abs(t.excess - (t.uncached - fewest) / t.rate * busy) < 1e-9 for t in terms)
            chosen.in_flight += 1
            held.append((request, chosen))
        for _request, replica in held:
            replica.in_flight -= 1
        assert all(r.in_flight == 0 for r in replicas)
        assert refused > 0  # the rail did refuse replicas on this traffic


def test_other_clients_waiting_requests_are_work_ahead() -> None:
    # Others' waiting requests, as the replica reports them, each weigh what requests of
    # this instance were reported to compute (prompt minus cached tokens).
    policy, replicas = TTFTAffinity(), rated(4)
    for i in range(20):
        request = one_off(900 + i, 400)
        served(policy, request, replicas)
        policy.observe(request, RouteFeedback("r0", 1000, 200, True))  # teaches the mean: 800
    assert policy.learned.work.get(0.0) == 800
    for r in replicas:
        r.running, r.waiting = 2.0, 0.0
    home = policy.prefer(one_off(1, 2000), replicas)[0]
    home.waiting = 6.0  # six of other clients' requests queued there
    terms = {t.replica: t for t in policy.explain(one_off(1, 2000), replicas)}
    assert terms[home.name].ahead == 6 * 800 / 1000.0
    assert policy.prefer(one_off(1, 2000), replicas)[0] is not home


def test_a_warm_prefix_outweighs_a_short_queue_but_not_a_long_one() -> None:
    clock = Clock()
    policy, replicas = TTFTAffinity(RoutingSettings(), clock), rated(4)
    home = served(policy, twin(1, 1), replicas)
    clock.t = 100.0  # everything drained
    prompt_tokens = len(twin(1, 2).body["messages"][0]["content"]) / 4
    # Work queued at home worth less than the warm prefix: the twin stays.
    policy.backlog.add(home.name, prompt_tokens * 0.5, 1000.0)
    explained = policy.explain(twin(1, 2), replicas)
    # Its blocks are in the index, its key (the system prompt's end) too.
    assert explained[0].replica == home.name and explained[0].source in ("index", "key")
    assert all(t.source == "none" for t in explained[1:])
    assert policy.prefer(twin(1, 2), replicas)[0] is home
    # Queued work past the prefix's whole prefill: it is cheaper to start afresh elsewhere,
    # and the wait rail says so too.
    clock.t = 200.0
    policy.backlog.add(home.name, prompt_tokens * 3, 1000.0)
    assert policy.prefer(twin(1, 3), replicas)[0] is not home
    assert {t.replica: t.rail for t in policy.explain(twin(1, 4), replicas)}[home.name] == "wait"


def test_a_replica_at_half_the_rate_takes_less_cold_work() -> None:
    # One-off prompts at about nine tenths of the fleet's capacity: the replica that reports
    # half the rate is given less of the work, and not none. (Greedy on the time to first
    # token it takes a request only when the others' queues are a whole prefill of its own
    # longer than its own: about a third of a fast replica's share here.)
    clock = Clock()
    policy = TTFTAffinity(RoutingSettings(), clock)
    replicas = [View(f"r{i}", prefill_rate=(500.0 if i == 0 else 1000.0)) for i in range(4)]
    sent: dict[str, float] = {r.name: 0.0 for r in replicas}
    for i in range(2000):
        clock.t += 0.3
        # About 1000 tokens, never answered here: the queues drain at the rates alone.
        chosen = policy.prefer(one_off(i, 4000), replicas)[0]
        sent[chosen.name] += 1000
    fast = sum(v for k, v in sent.items() if k != "r0") / 3
    assert 0.2 < sent["r0"] / fast < 0.7, sent


def test_the_index_forgets_what_a_pool_evicts() -> None:
    # A pool of 4,000 tokens: after 16 one-off prompts of about 1,000 tokens each went
    # there, an organisation's layers it held are gone, and the index says so.
    clock = Clock()
    policy = TTFTAffinity(RoutingSettings(), clock)
    replicas = [View(f"r{i}", prefill_rate=1000.0, kv_tokens=4000.0) for i in range(2)]
    home = served(policy, twin(1, 1), replicas)
    other = next(r for r in replicas if r is not home)
    assert {t.replica: t.source for t in policy.explain(twin(1, 2), replicas)}[home.name] in ("index", "key")
    policy.backlog.add(other.name, 1e9, None)  # everything else goes home
    for i in range(16):
        assert served(policy, one_off(500 + i, 4000), replicas) is home
    terms = {t.replica: t for t in policy.explain(twin(1, 2), replicas)}
    assert terms[home.name].held == 0 and terms[home.name].source == "none"
    assert policy.pools.used(policy.bits.get(home.name)) * policy.settings.block_chars / 4 <= 4000


def test_a_first_token_proves_the_prefill_done_there() -> None:
    # Without a learned rate the backlog drains only by the replicas' signals: the first
    # token of a request proves its prefill, and every earlier one sent there, done.
    policy, replicas = TTFTAffinity(), fleet(4)
    first, second = one_off(1, 8000), one_off(2, 8000)
    a = policy.prefer(first, replicas)[0]
    policy.backlog.add(a.name, 0.0, None)  # nothing else: only these two count
    b = policy.prefer(second, replicas)[0]
    assert b is not a  # the first one's prefill is still ahead at a
    policy.started(first, a.name)
    assert {t.replica: t.ahead for t in policy.explain(one_off(3, 8000), replicas)}[a.name] == 0


def test_decisions_the_rail_made_against_the_formula_are_counted() -> None:
    # A warm home has the least cost while its queue is short; once its queue is longer than
    # the least by more than a whole prefill, the rail refuses it, and the decision is counted.
    from gateway.observe.metrics import _PolicyCollector

    clock = Clock()
    policy, replicas = TTFTAffinity(RoutingSettings(), clock), rated(4)
    long_system = "A long policy document that only this conversation carries. " * 400
    home = served(policy, twin(7, 1, long_system), replicas)
    clock.t = 100.0
    assert policy.prefer(twin(7, 2, long_system), replicas)[0] is home and policy.bound_overrides == 0
    policy.backlog.add(home.name, 1e6, 1000.0)
    # The warm home's cost is still the least (all are cold elsewhere) only if the error band
    # pulled it there; the rail refuses it whatever the cost says.
    terms = {t.replica: t for t in policy.explain(twin(7, 3, long_system), replicas)}
    assert terms[home.name].rail == "wait"
    moved = policy.prefer(twin(7, 3, long_system), replicas)[0]
    assert moved is not home
    samples = {s.name: s.value for family in _PolicyCollector(lambda: policy).collect() for s in family.samples}
    counted = policy.stats()["bound_overrides"]
    assert samples["kvgate_routing_bound_overrides_total"] == policy.bound_overrides == counted


def test_tokens_beyond_the_fewest_cost_more_the_busier_the_fleet() -> None:
    # A warm twin whose home has two cold prefills queued: on an idle fleet it starts sooner
    # cold elsewhere, and goes; when every replica has a queue, the whole prefill it would add
    # delays whoever waits behind it, and it stays home.
    clock = Clock()
    policy, replicas = TTFTAffinity(RoutingSettings(), clock), rated(4)
    home = served(policy, twin(3, 1), replicas)
    clock.t = 100.0  # everything drained
    prompt = (lambda t: t.held + t.uncached)(policy.explain(twin(3, 2), replicas)[0])
    policy.backlog.add(home.name, prompt * 2, 1000.0)
    idle = {t.replica: t for t in policy.explain(twin(3, 2), replicas)}
    assert all(t.excess == 0 for n, t in idle.items() if n == home.name)
    assert policy.peek(twin(3, 2), replicas)[0] is not home
    for r in replicas:
        if r is not home:
            policy.backlog.add(r.name, prompt * 0.5, 1000.0)
    full = {t.replica: t for t in policy.explain(twin(3, 2), replicas)}
    cold = [t for n, t in full.items() if n != home.name]
    assert all(t.excess > idle[t.replica].excess > 0 for t in cold)
    assert policy.peek(twin(3, 2), replicas)[0] is home


def layered(org: int, person: int, q: int) -> RouteRequest:
    """One system message: global instructions > an organisation's policies > a person's profile."""
    system = ("Global instructions. " * 100 + f"Policies of organisation {org}: "
              + "".join(f"rule {org}.{j}; " for j in range(150)) + f"Profile of person {org}.{person}. " * 20)
    return RouteRequest("chat", "m", "t", {"model": "m", "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": f"question {q}: " + "why " * 40}]})


def test_instances_sharing_nothing_agree_on_an_organisations_home() -> None:
    # Four instances, each with a quarter of the traffic (the replicas' queues are the others'),
    # each sees different people of the same organisations. An organisation's policies sit
    # inside one system message, before each person's profile: every instance must send a
    # person it has never seen to the same replica, the one its organisation's layers live on
    # (keyed by the person, each person would have a home of its own, and every replica would
    # have to hold every organisation's layers).
    replicas = rated(8)
    for r in replicas:
        r.running, r.waiting = 1.0, 0.0  # queues that are not this instance's: others exist
    homes: dict[int, set[str]] = {org: set() for org in range(6)}
    for inst in range(4):
        policy = TTFTAffinity()
        # Warm-up: the global instructions are in every request, so wide; an organisation
        # (one of 24) carries less than a replica's share, so it is not.
        for i in range(96):
            served(policy, layered(i % 24, 100 * inst + i, i), replicas)
        for org in range(6):
            chosen = policy.prefer(layered(org, 1000 + 10 * inst + org, 0), replicas)[0]
            homes[org].add(chosen.name)
    assert all(len(names) == 1 for names in homes.values()), homes
    # Not one home for everything: organisations are spread.
    assert len({next(iter(names)) for names in homes.values()}) > 1, homes


def test_home_names_the_presumed_replica_and_learns_nothing() -> None:
    # bench.routing_homes asks every instance where it would presume a request's context; asking
    # must not count the request: two hundred peeks at one organisation would make it wide.
    replicas = rated(8)
    for r in replicas:
        r.running, r.waiting = 1.0, 0.0
    policy = TTFTAffinity()
    for i in range(96):
        served(policy, layered(i % 24, i, i), replicas)
    request = layered(3, 5000, 0)
    home = policy.home(request, replicas)
    for i in range(200):
        policy.home(layered(3, 5001 + i, 0), replicas)
    again = layered(3, 5000, 0)  # the same request, without what the first call kept in its scratch
    assert policy.home(again, replicas) == home
    assert policy.prefer(again, replicas)[0].name == home


def _hold_learned(policy: TTFTAffinity, clock: Clock, replicas: list[View], seconds: float) -> None:
    """Streams that held their seat ``seconds`` from first token to end (what ``hold`` learns)."""
    for i in range(8):
        request = one_off(5000 + i, 400)
        chosen = policy.prefer(request, replicas)[0]
        policy.started(request, chosen.name)
        clock.t += seconds
        policy.observe(request, RouteFeedback(chosen.name, 100, 0, True, ttft_s=0.01))


def test_past_its_seats_a_request_waits_for_one_to_end_and_goes_elsewhere() -> None:
    # vLLM runs --max-num-seqs requests at once; the next waits for one to end, however short
    # its prefill. Known (max_in_flight), that wait is ahead of it; unknown, nothing is presumed.
    for seats in (None, 4.0):
        clock = Clock()
        policy, replicas = TTFTAffinity(RoutingSettings(), clock), rated(2)
        for r in replicas:
            r.seats, r.running, r.waiting = seats, 0.0, 0.0
        _hold_learned(policy, clock, replicas, 2.0)
        assert policy.learned.hold.get(0.0) == 2.0
        home = served(policy, twin(1, 1), replicas)
        home.running, home.waiting = 4.0, 3.0  # every seat taken, three of other clients' waiting
        terms = {t.replica: t for t in policy.explain(twin(1, 2), replicas)}
        chosen = policy.prefer(twin(1, 2), replicas)[0]
        if seats is None:
            assert terms[home.name].seat == 0.0 and chosen is home  # warm, and no wait presumed
        else:
            # Seven there, four seats: it waits for four of them to end, one every 2 s / 4.
            assert terms[home.name].seat == (7 - 4 + 1) * 2.0 / 4
            assert terms[home.name].ahead >= terms[home.name].seat
            assert chosen is not home


def test_other_instances_sends_since_the_scrape_are_counted_as_this_ones() -> None:
    # Eight instances reading one scrape all saw the same free seats and filled them: each now
    # takes the others to have sent where it sent since the scrape, in proportion to their share.
    clock = Clock()
    policy, replicas = TTFTAffinity(RoutingSettings(), clock), rated(2)
    for r in replicas:
        r.seats, r.running, r.waiting = 4.0, 0.0, 0.0
    _hold_learned(policy, clock, replicas, 1.0)
    r0 = replicas[0]
    r0.running, r0.waiting, r0.in_flight_at_scrape = 4.0, 0.0, 2  # half of the queue ours: share 0.5
    replicas[1].running, replicas[1].in_flight_at_scrape = 4.0, 2
    r0.in_flight = 3  # one more of ours since the scrape: as many of the others', presumably
    seat = {t.replica: t.seat for t in policy.explain(one_off(1, 400), replicas)}[r0.name]
    assert seat == ((4 - 2) + 3 + 1 - 4 + 1) * 1.0 / 4


def test_among_replicas_equally_good_the_fewest_requests_for_its_speed_wins() -> None:
    # Cold one-off prompts, nothing queued for prefill: every replica predicts the same time to
    # first token, and the pick falls to how many requests each has now (each decodes beside the
    # new one, and past its seats it waits for one), not to the prompt's hash. (A fresh policy
    # for each decision: a placement queues its own prefill, which would decide the next.)
    replicas = rated(2)

    def picks() -> set[str]:
        return {TTFTAffinity().prefer(one_off(i, 400), replicas)[0].name for i in range(40)}

    replicas[0].in_flight, replicas[1].in_flight = 4, 1
    assert picks() == {"r1"}
    replicas[0].in_flight = 1  # equal: the keys' order spreads them
    assert picks() == {"r0", "r1"}
    replicas[0].prefill_rate, replicas[0].in_flight, replicas[1].in_flight = 2000.0, 2, 1
    # Twice as fast with twice the requests: the same for its speed; the faster one's predicted
    # time is shorter, so it is the pick (the count breaks ties only within the prediction's error).
    assert picks() == {"r0"}


def _layers_outlast(policy: TTFTAffinity, replicas: list[View], prompt_tokens: Callable[[RouteRequest], int | None],
                    completion_tokens: int | None = None) -> int:
    """One-off prompts of 1,000 characters sent to an organisation's home, answered with
    ``prompt_tokens`` (and ``completion_tokens``) each, until the index forgets its layers."""
    home = served(policy, twin(1, 1), replicas)
    policy.backlog.add(next(r for r in replicas if r is not home).name, 1e9, None)  # all else goes home
    for i in range(200):
        request = one_off(500 + i, 1000)
        assert policy.prefer(request, replicas)[0] is home
        policy.observe(request, RouteFeedback(home.name, prompt_tokens(request), 0, True,
                                              completion_tokens=completion_tokens))
        if {t.replica: t for t in policy.explain(twin(1, 2), replicas)}[home.name].held == 0:
            return i + 1
    raise AssertionError("the layers were never forgotten")


def test_the_pool_model_holds_the_pool_in_the_replicas_own_tokens() -> None:
    # The replies say a prompt's tokens: here one for every 8 rendered characters, twice the 4
    # assumed before any reply. A pool of 4,000 tokens then holds twice the characters, and an
    # organisation's layers outlast about twice as many one-off prompts before the index
    # forgets them (with 4 it would forget what the replica still holds: the benchmarks' text
    # runs 5.5 characters a token).
    def pool() -> tuple[TTFTAffinity, list[View]]:
        return TTFTAffinity(RoutingSettings(), Clock()), [View(f"r{i}", kv_tokens=4000.0) for i in range(2)]

    policy, replicas = pool()
    eighths = _layers_outlast(policy, replicas, lambda r: len(analyse(r, policy.settings).rendered.data) // 8)
    assert 7.9 < policy.learned.chars_per_token() < 8.1
    unsaid, replicas = pool()
    assumed = _layers_outlast(unsaid, replicas, lambda r: None)
    assert unsaid.learned.chars_per_token() == CHARS_PER_TOKEN
    assert 1.6 * assumed <= eighths <= 2.4 * assumed, (assumed, eighths)


def test_what_running_requests_generate_takes_room_from_the_cached_prompts() -> None:
    # Ten requests of this instance's run at each replica, and the replies say each generates 200
    # tokens: room is kept for the output of the 95th percentile of their number (10 + 1.645 x
    # sqrt(10), about 15), 3,040 of the pool's 4,000 tokens, so the layers are forgotten several
    # times as soon (5 one-off prompts against 17).
    def outlast(running: int) -> int:
        policy = TTFTAffinity(RoutingSettings(), Clock())
        replicas = [View(f"r{i}", kv_tokens=4000.0, running=float(running), waiting=0.0, in_flight=running,
                         in_flight_at_scrape=running) for i in range(2)]
        return _layers_outlast(policy, replicas, lambda r: len(analyse(r, policy.settings).rendered.data) // 4,
                               completion_tokens=200)

    idle, busy = outlast(0), outlast(10)
    assert 0.1 * idle <= busy <= 0.4 * idle, (idle, busy)
