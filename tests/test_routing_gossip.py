"""Instances sharing what they learn (routing.share_index): the facts, the policy, and kvgate over Redis."""

from __future__ import annotations

import asyncio
import itertools
import json
import time

import httpx
import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.routing_sim import BenchTruth
from bench.routing_sim import SimView as View
from gateway.admin import operations
from gateway import redis_client
from gateway.app import build_app
from gateway.routing_sync import RoutingSync
from gateway.settings import load_settings
from routing import RouteFeedback, RouteRequest, RoutingSettings
from routing.gossip import BLOCKS, DONE, HELD, MAX_HASHES, PLACED, BlockFact, Gossip, KeyFact, decode, encode
from routing.keys import analyse
from routing.kv_index import KVEventIndex
from routing.prefix_affinity import PrefixAffinity
from routing.ttft_affinity import TTFTAffinity
from tests.support import chats
from tests.support.clock import Clock
from tests.support.redis_server import PrivateRedis
from tests.support.servers import ServerThread
from tests.support.stack import MODEL, start_stack

facts = st.lists(st.tuples(st.sampled_from([HELD, PLACED, DONE]), st.integers(0, 2**64 - 1),
                           st.text(min_size=1, max_size=64)), max_size=20)


# A block fact names its request (a token, with its uncached tokens) or not (token 0, none).
block_facts = st.builds(lambda key, replica, hashes, extra, uncached, token: BlockFact(
    BLOCKS, key, replica, len(hashes) + extra, tuple(hashes), uncached if token else 0, token),
    st.integers(0, 2**64 - 1), st.text(min_size=1, max_size=64),
    st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=MAX_HASHES), st.integers(0, 1000),
    st.integers(0, 1 << 24), st.one_of(st.just(0), st.integers(1, 2**64 - 1)))


@given(facts)
def test_facts_survive_the_wire(batch: list[tuple[str, int, str]]) -> None:
    assert decode(encode(batch)) == batch


@given(st.lists(st.one_of(facts.map(lambda fs: [KeyFact(*f) for f in fs]), st.lists(block_facts, max_size=3)),
                max_size=4).map(lambda groups: [f for g in groups for f in g]))
def test_block_facts_survive_the_wire_beside_key_facts(batch: list[KeyFact | BlockFact]) -> None:
    assert decode(encode(batch)) == batch
    assert all(type(got) is type(sent) for got, sent in zip(decode(encode(batch)), batch))


# JSON a stream entry could hold: near misses of both fact shapes, and anything else.
_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False),
                     st.text(max_size=40), st.sampled_from(["b", "h", "p", "0" * 16, "f" * 32, "0x" + "0" * 14]))
_json = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=6), max_leaves=30)


@given(st.lists(_json, max_size=8))
def test_malformed_facts_are_skipped_never_raised(items: list[object]) -> None:
    got = decode(json.dumps(items))
    assert all(isinstance(f, (KeyFact, BlockFact)) for f in got)
    for f in got:
        assert 0 <= f.key < 2**64 and 0 < len(f.replica) <= 256
        if isinstance(f, BlockFact):
            assert 0 < len(f.hashes) <= min(MAX_HASHES, f.blocks)


def test_block_facts_are_bounded_on_the_wire() -> None:
    key, hashes = "00000000000000ff", "0123456789abcdef"
    assert decode(json.dumps([["b", key, "r1", 3, hashes * 2]])) == [BlockFact(BLOCKS, 255, "r1", 3, (
        0x0123456789abcdef, 0x0123456789abcdef))]
    for bad in (["b", key, "r1", 1, hashes * 2],  # more hashes than blocks
                ["b", key, "r1", 2, hashes[:-1]],  # not 16 digits each
                ["b", key, "r1", 2, "g" * 16],  # not hex
                ["b", key, "r1", 2, " +" + hashes[2:]],  # int() would take these
                ["b", key, "r1", True, hashes],  # a bool is not a count
                ["b", key, "r1", 10**6, hashes * (MAX_HASHES + 1)],  # past the cap
                ["b", key, "r1", 2, ""],  # no hashes
                ["h", key, "r1", 2, hashes],  # a key fact's kind with blocks
                ["b", key, "r1"]):  # a block fact's kind without them
        assert decode(json.dumps([bad])) == [], bad


@given(st.one_of(st.text(), st.binary()))
def test_garbage_on_the_wire_is_skipped_not_raised(text: str | bytes) -> None:
    assert isinstance(decode(text), list)
    assert decode('[["x","00000000000000ff","r1"],["h","zz","r1"],["p","00000000000000ff","r2"],7]') == [
        (PLACED, 255, "r2")]


def test_with_no_one_listening_nothing_is_noted_and_what_was_pending_is_dropped() -> None:
    gossip = Gossip()
    gossip.note(HELD, 1, "r")
    gossip.listening = False
    gossip.note(HELD, 2, "r")
    gossip.note_blocks(3, "r", 1, [7], 10, 5)
    assert len(gossip) == 1
    gossip.clear()
    assert gossip.drain() == [] and gossip.published == 0


def test_the_outbox_is_bounded_and_drains_in_order() -> None:
    gossip = Gossip(capacity=3)
    for i in range(5):
        gossip.note(HELD, i, "r")
    assert [k for _, k, _ in gossip.drain(2)] == [2, 3] and len(gossip) == 1 and gossip.published == 2


def conversation(i: int, turns: int = 1) -> RouteRequest:
    # No shared system prompt: every instance keys it on its first turn from the start
    # (a prompt shared by all traffic is recognised as such only after some traffic).
    return chats.conversation(i, turns, filler="tell me about routing. ")


def busy_fleet(n: int = 8) -> list[View]:
    # Others' traffic is on the replicas too: no instance is alone.
    return [View(f"r{i}", running=6.0, waiting=0.0) for i in range(n)]


def relay(src: PrefixAffinity, *dst: PrefixAffinity) -> None:
    assert src.gossip is not None
    for fact in src.gossip.drain():
        for d in dst:
            d.learn_remote(fact)


def test_a_placed_conversation_is_followed_by_the_instances_told_of_it() -> None:
    shared = RoutingSettings(share_index=True, prefill_tokens_per_s=1000.0)
    a, b = PrefixAffinity(shared, Clock()), PrefixAffinity(shared, Clock())
    unaware = PrefixAffinity(RoutingSettings(), Clock())
    replicas = busy_fleet()
    crowded = "r0"
    a.backlog.add(crowded, 100_000, 1000.0)  # long prompts queued on one replica ...
    # ... so new conversations that hash there are placed elsewhere by instance a.
    moved = []
    for i in range(200):
        if unaware.peek(conversation(i), replicas)[0].name != crowded:
            continue
        placed = a.prefer(conversation(i), replicas)[0].name
        if placed != crowded:
            moved.append((i, placed))
    assert len(moved) >= 5
    relay(a, b)
    for i, placed in moved:
        assert b.peek(conversation(i, turns=2), replicas)[0].name == placed
        assert unaware.peek(conversation(i, turns=2), replicas)[0].name == crowded
    assert b.stats()["shared_facts"]["applied"] >= len(moved)  # type: ignore[index]


def test_a_replica_found_holding_a_key_is_followed_elsewhere() -> None:
    shared = RoutingSettings(share_index=True)
    a, b = PrefixAffinity(shared, Clock()), PrefixAffinity(shared, Clock())
    replicas = busy_fleet()
    first = b.peek(conversation(3, turns=2), replicas)[0].name
    elsewhere = next(r.name for r in replicas if r.name != first)
    # Instance a's request was served by another replica (a retry, a spill) ...
    a.observe(conversation(3), RouteFeedback(elsewhere, 500, 0, True))
    assert b.peek(conversation(3, turns=2), replicas)[0].name == first  # ... b does not know yet
    relay(a, b)
    assert b.peek(conversation(3, turns=2), replicas)[0].name == elsewhere
    # A fact is published once: what this instance already knew is not news.
    a.observe(conversation(3), RouteFeedback(elsewhere, 500, 0, True))
    assert a.gossip is not None and len(a.gossip) == 0


def _fleet(kv_tokens: float | None = None, n: int = 4) -> list[View]:
    # Rates known (figures in seconds) and others' traffic on the replicas: no instance alone.
    return [View(f"r{i}", running=2.0, waiting=0.0, prefill_rate=10_000.0, kv_tokens=kv_tokens) for i in range(n)]


def test_a_block_fact_records_what_the_pool_keeps_and_forgets_what_it_evicts() -> None:
    shared = RoutingSettings(share_index=True)
    a, told, blind = TTFTAffinity(shared, Clock()), TTFTAffinity(shared, Clock()), TTFTAffinity(shared, Clock())
    blocks = len(analyse(conversation(0), shared, a.keyer.chains).hashes)
    # Each pool holds about three of these prompts (64 characters a block, 4 a token).
    replicas = _fleet(kv_tokens=3 * blocks * 16, n=2)
    told.prefer(conversation(99_999), replicas)  # ``told`` has seen the pools' sizes; ``blind`` has not
    assert told.gossip is not None and told.gossip.drain()
    went = [a.prefer(conversation(i), replicas)[0].name for i in range(12)]
    assert a.gossip is not None
    sent = a.gossip.drain()
    assert len(sent) == 12 and all(isinstance(f, BlockFact) for f in sent)  # every placement, not only news
    for fact in sent:
        told.learn_remote(fact)
        blind.learn_remote(fact)

    def depth(p: TTFTAffinity, i: int) -> int:
        bit = p.bits.get(went[i])
        assert bit is not None
        return p.index.depth_of(analyse(conversation(i), shared, p.keyer.chains).hashes, bit)

    # The last prompt sent to each replica is held at its whole depth; the first ones were evicted
    # from the model of the pool they went to, and forgotten, as by the instance that sent them.
    for r in {"r0", "r1"} & set(went):
        last = max(i for i, w in enumerate(went) if w == r)
        assert depth(told, last) == blocks == depth(a, last)
    first = [min(i for i, w in enumerate(went) if w == r) for r in set(went)]
    assert [depth(told, i) for i in first] == [depth(a, i) for i in first] == [0] * len(first)
    # Told nothing of the pools' sizes, an instance records the blocks and forgets none.
    assert all(depth(blind, i) == blocks for i in first)
    assert told.pools.used(told.bits.bit_for(went[0], told.index)) > 0 and blind.pools.used(0) == 0


def test_with_block_facts_nothing_is_presumed() -> None:
    # The replicas' queues are mostly other instances': without facts, a home is presumed.
    busy = [View(f"r{i}", running=8.0, waiting=0.0, prefill_rate=10_000.0, in_flight_at_scrape=0) for i in range(4)]
    request = chats.conversation(7, 2, system="policies " * 200, filler="my profile. ")
    alone = TTFTAffinity(RoutingSettings(), Clock()).explain(request, busy)
    told = TTFTAffinity(RoutingSettings(share_index=True), Clock()).explain(request, busy)
    assert any(t.source == "home" for t in alone) and any(t.astray > 0 for t in alone)
    assert all(t.source != "home" and t.astray == 0 for t in told)


def _with_ids(request: RouteRequest) -> RouteRequest:
    """The request with token ids, as the gateway gives them where the model has a tokenizer: one a
    character of its user turns (precise mode keys blocks by them)."""
    text = "".join(m["content"] for m in request.body["messages"])
    request.token_ids = [ord(ch) for ch in text]
    return request


def test_in_precise_mode_another_instances_placement_counts_before_its_events() -> None:
    # Two precise instances over one fleet's events, which show nothing yet: a's request is still
    # prefilling at the replica it chose. Told by a's block fact, b finds the prompt held there (the
    # events say what is stored, the facts what was placed) and sends the next turn after it.
    # Events alone, every replica looked cold to b, and eight instances sent an organisation's
    # people everywhere (the benchmark page, twelfth stop).
    shared = RoutingSettings(share_index=True)
    events = KVEventIndex(16)
    a, b, alone = (TTFTAffinity(s, Clock()) for s in (shared, shared, RoutingSettings()))
    for p in (a, b, alone):
        p.truth = BenchTruth(events, lambda: 0.0)
    replicas = _fleet(kv_tokens=1e6)
    went = a.prefer(_with_ids(conversation(5)), replicas)[0].name
    relay(a, b)
    nxt = _with_ids(conversation(5, turns=2))
    told = {t.replica: t for t in b.explain(nxt, replicas)}
    assert told[went].source in ("index", "key") and told[went].held > 0
    assert all(t.held == 0 for name, t in told.items() if name != went)
    assert b.peek(nxt, replicas)[0].name == went
    # Without the facts the events are all there is: nothing is known held (a home is only presumed).
    assert all(t.source in ("none", "home") for t in alone.explain(nxt, replicas))


async def _carry(url: str) -> tuple[TTFTAffinity, TTFTAffinity, int, str]:
    """Instance a places conversations until instance b, told through Redis, holds one's blocks:
    the policies, the conversation, and where a sent it."""
    shared = RoutingSettings(share_index=True)
    a, b = TTFTAffinity(shared, Clock()), TTFTAffinity(shared, Clock())
    syncs = [RoutingSync(lambda p=p: p, redis_client.connect(url, timeout_s=2.0),  # type: ignore[misc]
                         redis_client.connect(url, timeout_s=2.0, read_timeout_s=3.0), flush_s=0.01)
             for p in (a, b)]
    tasks = [asyncio.ensure_future(s.run()) for s in syncs]
    replicas = _fleet(kv_tokens=1e6)
    # b has seen the pools; its request's first token came (its block fact and DONE reach a
    # together, or neither does if b hears no one yet: either way nothing stays queued in a).
    seen = conversation(99_999)
    b.started(seen, b.prefer(seen, replicas)[0].name)
    try:
        # b tails the stream from when its read starts: each poll places a new conversation
        # (a fact published before that is not replayed).
        deadline = time.monotonic() + 20.0
        for i in itertools.count(50_000):
            placed = conversation(i, turns=1)
            went = a.prefer(placed, replicas)[0].name
            a.started(placed, went)  # its first token: a DONE fact follows the block fact
            hashes = analyse(conversation(i), shared, b.keyer.chains).hashes
            for _ in range(20):
                await asyncio.sleep(0.02)
                if b.index.depths(hashes, (1 << len(b.bits)) - 1):
                    return a, b, i, went
            if time.monotonic() > deadline:
                raise AssertionError("no block fact reached b")
        raise AssertionError("unreachable")
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in syncs:
            await s.aclose()


def test_a_placement_reaches_another_instance_through_redis_as_blocks(redis_service: str) -> None:
    a, b, i, went = asyncio.run(_carry(redis_service))
    # b's index holds the whole prompt, block by block, at the replica a chose and nowhere else
    # (a key fact records no blocks) ...
    hashes = analyse(conversation(i), a.settings, b.keyer.chains).hashes
    bit = b.bits.get(went)
    assert bit is not None and b.index.depths(hashes, (1 << len(b.bits)) - 1) == {bit: len(hashes)}
    # ... so for the conversation's next turn b believes what a does, replica by replica.
    replicas = _fleet(kv_tokens=1e6)
    mine, told = a.explain(conversation(i, turns=2), replicas), b.explain(conversation(i, turns=2), replicas)
    assert [(t.replica, t.held, t.source) for t in told] == [(t.replica, t.held, t.source) for t in mine]
    assert told[0].replica == went and told[0].held > 0.9 * (told[0].held + told[0].uncached)
    # ... and nothing a sent is still queued in b's backlog: each DONE cleared its block fact's tokens.
    assert b.backlog.queued([r.name for r in replicas], [None] * len(replicas)) == [0.0] * len(replicas)


def test_the_others_prompts_are_queued_until_their_first_token() -> None:
    """A block fact queues the sender's uncached prompt in the receiver's backlog of that replica,
    and its DONE fact (the first token) clears it, with all that was queued there before it."""
    shared = RoutingSettings(share_index=True)
    a, b = TTFTAffinity(shared, Clock()), TTFTAffinity(shared, Clock())
    replicas = _fleet(kv_tokens=1e6)
    first, second = conversation(1, turns=1), conversation(2, turns=1)
    went = a.prefer(first, replicas)[0].name
    other = a.prefer(second, [r for r in replicas if r.name != went])[0].name
    assert a.gossip is not None
    for fact in a.gossip.drain():
        b.learn_remote(fact)
    names = [r.name for r in replicas]

    def queued() -> dict[str, float]:
        return dict(zip(names, b.backlog.queued(names, [None] * len(names))))

    tokens = queued()
    assert tokens[went] > 0 and tokens[other] > 0 and sum(tokens.values()) == tokens[went] + tokens[other]
    ahead = {t.replica: t.ahead for t in b.explain(conversation(3, turns=1), replicas)}
    assert ahead[went] > 0 and ahead[other] > 0 and min(ahead.values()) == 0.0
    a.started(first, went)
    for fact in a.gossip.drain():
        b.learn_remote(fact)
    assert queued()[went] == 0.0 and queued()[other] == tokens[other]


def test_sharing_without_redis_shares_nothing_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    # Placing new keys by load is only safe when the other instances hear of it.
    stack = start_stack(2, routing={"policy": "prefix_affinity", "share_index": True})
    try:
        assert getattr(stack.runtime.policy, "gossip", "missing") is None
        assert stack.runtime.routing_sync is None
        assert "share_index needs redis_url" in caplog.text
    finally:
        stack.close()


@pytest.mark.parametrize("routing, with_redis, shares", [
    ({}, True, True),  # the default policy (ttft) with a Redis: its block facts are shared
    ({}, False, False),  # no channel: nothing to share, and nothing to warn about
    ({"share_index": False}, True, False),  # asked not to
    ({"policy": "prefix_affinity"}, True, False),  # key facts did not pay: only when asked
    ({"policy": "prefix_affinity", "share_index": True}, True, True),
])
def test_sharing_is_on_where_ttft_has_a_redis_unless_configured(
        routing: dict[str, object], with_redis: bool, shares: bool, redis_service: str,
        caplog: pytest.LogCaptureFixture) -> None:
    stack = start_stack(2, routing=routing, **({"redis_url": redis_service} if with_redis else {}))
    try:
        assert (getattr(stack.runtime.policy, "gossip", None) is not None) is shares
        assert "share_index needs redis_url" not in caplog.text
        assert ("shared_facts" in operations.routing_stats(stack.runtime)) is shares
    finally:
        stack.close()


def test_two_fleets_on_one_redis_keep_their_facts_apart(redis_service: str) -> None:
    # Two deployments (each its own replicas, under the same names r1, r2) on one Redis: a fact
    # names a replica by name, so the other fleet's would be read as news of its own replicas,
    # and its backlog as a queue here. Instances of one deployment (the same replicas) share.
    first = start_stack(2, redis_url=redis_service)
    other = start_stack(2, redis_url=redis_service)
    twin = ServerThread(build_app(load_settings(environ={}, overrides={
        "redis_url": redis_service, "pool": first.settings.pool.model_dump(),
        "replicas": [{"name": n, "url": first.sim_url(n)} for n in first.sims]}))).start()
    try:
        sent = first.runtime.policy.gossip
        heard_by_twin = twin.config.app.state.runtime.policy.gossip
        heard_by_other = other.runtime.policy.gossip
        assert sent is not None and heard_by_twin is not None and heard_by_other is not None
        client = openai.OpenAI(base_url=first.base_url, api_key="none", max_retries=0)
        fresh = itertools.count(20_000)
        # The twin tails the stream from when it starts: ask until it hears.
        assert _wait(lambda: _ask(client, next(fresh), 1) and heard_by_twin.applied > 0)
        assert sent.published > 0 and heard_by_other.applied == 0
        # The other fleet's one instance hears no one on its stream: it notes and publishes no
        # facts (only its heartbeat), so a lone instance with a Redis costs what sharing nothing does.
        alone = openai.OpenAI(base_url=other.base_url, api_key="none", max_retries=0)
        for i in range(5):
            _ask(alone, i, 1)
        assert heard_by_other.published == 0 and len(heard_by_other) == 0 and not heard_by_other.listening
        assert operations.routing_stats(other.runtime)["shared_facts"]["instances_heard"] == 0
        assert operations.routing_stats(first.runtime)["shared_facts"]["instances_heard"] == 1
        metrics = httpx.get(first.url + "/metrics", timeout=5).text
        assert "kvgate_routing_facts_instances_heard 1.0" in metrics
        assert "kvgate_routing_facts_published_total 0.0" not in metrics
        assert "kvgate_routing_facts_instances_heard 0.0" in httpx.get(other.url + "/metrics", timeout=5).text
    finally:
        twin.stop()
        other.close()
        first.close()


def _ask(client: openai.OpenAI, i: int, turns: int) -> str:
    body = conversation(i, turns).body
    raw = client.chat.completions.with_raw_response.create(model=MODEL, max_tokens=2, messages=body["messages"])
    return raw.headers["x-kvgate-replica"]


def _wait(predicate: object, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.02)
    return False


@pytest.mark.parametrize("redis_kind", ["server", "cluster"])
def test_two_kvgates_sharing_redis_send_each_turn_where_the_first_went(redis_kind: str,
                                                                     request: pytest.FixtureRequest) -> None:
    url = request.getfixturevalue("redis_service") if redis_kind == "server" else \
        request.getfixturevalue("redis_cluster").url
    routing = {"policy": "prefix_affinity", "share_index": True}
    stack = start_stack(4, redis_url=url, routing=routing)
    # The second instance scrapes the replicas as rarely as the first: a scrape that caught
    # the first instance's request still running would make its replica look busy (past the
    # bound, even), and the turn would go elsewhere for a reason that is not the facts'.
    second = ServerThread(build_app(load_settings(environ={}, overrides={
        "redis_url": url, "routing": routing, "pool": stack.settings.pool.model_dump(),
        "replicas": [{"name": n, "url": stack.sim_url(n)} for n in stack.sims]}))).start()
    try:
        one = openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0)
        two = openai.OpenAI(base_url=second.url + "/v1", api_key="none", max_retries=0)
        b = second.config.app.state.runtime.policy
        # The second instance tails the stream from when it starts: wait until it hears.
        # Each poll places a new conversation: a fact published before the tail started is
        # not replayed, and a conversation already placed publishes nothing new.
        fresh = itertools.count(10_000)
        assert _wait(lambda: _ask(one, next(fresh), 1) and b.gossip.applied > 0)
        # The first instance has stopped sending to r1 (drained for it alone, say
        # after a failed health check): conversations that hash there go elsewhere.
        stack.runtime.pool.drain("r1")
        a = stack.runtime.policy
        for i in range(20):
            went = _ask(one, i, 1)
            assert went != "r1"
            # Every fact the first instance published (where it placed a conversation away
            # from its home) has reached the second.
            assert _wait(lambda: a.gossip.published + len(a.gossip) <= b.gossip.applied)
            # Without the facts, about a quarter of these would go to their first choice, r1.
            assert _ask(two, i, 2) == went
        stats = operations.routing_stats(stack.runtime)["shared_facts"]
        assert stats["published"] >= 3 and stats["failing"] is False
    finally:
        second.stop()
        stack.close()


def test_a_redis_outage_costs_the_sharing_not_the_serving(private_redis: PrivateRedis) -> None:
    stack = start_stack(2, redis_url=private_redis.url, routing={"policy": "prefix_affinity", "share_index": True})
    try:
        client = openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0)
        _ask(client, 0, 1)
        private_redis.stop()
        replicas = {_ask(client, i, 1) for i in range(1, 5)}
        assert replicas <= {"r1", "r2"} and _ask(client, 1, 2) in replicas
        sync = stack.runtime.routing_sync
        assert sync is not None and _wait(lambda: sync.failing)
        assert operations.routing_stats(stack.runtime)["shared_facts"]["failing"] is True
        ready = httpx.get(stack.url + "/readyz", timeout=5)
        assert ready.status_code == 200 and any("routing facts" in d for d in ready.json()["degraded"])
    finally:
        stack.close()
