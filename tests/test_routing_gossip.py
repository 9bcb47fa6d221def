"""Instances sharing what they learn (routing.share_index): the facts, the policy, and kvgate over Redis."""

from __future__ import annotations

import itertools
import time

import httpx
import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.routing_sim import SimView as View
from gateway.admin import operations
from gateway.app import build_app
from gateway.settings import load_settings
from routing import RouteFeedback, RouteRequest, RoutingSettings
from routing.gossip import HELD, PLACED, Gossip, decode, encode
from routing.prefix_affinity import PrefixAffinity
from tests.support import chats
from tests.support.clock import Clock
from tests.support.redis_server import PrivateRedis
from tests.support.servers import ServerThread
from tests.support.stack import MODEL, start_stack

facts = st.lists(st.tuples(st.sampled_from([HELD, PLACED]), st.integers(0, 2**64 - 1),
                           st.text(min_size=1, max_size=64)), max_size=20)


@given(facts)
def test_facts_survive_the_wire(batch: list[tuple[str, int, str]]) -> None:
    assert decode(encode(batch)) == batch


@given(st.one_of(st.text(), st.binary()))
def test_garbage_on_the_wire_is_skipped_not_raised(text: str | bytes) -> None:
    assert isinstance(decode(text), list)
    assert decode('[["x","00000000000000ff","r1"],["h","zz","r1"],["p","00000000000000ff","r2"],7]') == [
        (PLACED, 255, "r2")]


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


def test_sharing_without_redis_shares_nothing_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    # Placing new keys by load is only safe when the other instances hear of it.
    stack = start_stack(2, routing={"policy": "prefix_affinity", "share_index": True})
    try:
        assert getattr(stack.runtime.policy, "gossip", "missing") is None
        assert stack.runtime.routing_sync is None
        assert "share_index needs redis_url" in caplog.text
    finally:
        stack.close()


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
