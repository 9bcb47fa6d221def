"""KV-event streams over real ZMQ sockets: simulated replicas publish, kvgate's consumer keeps the index.

Each test runs vllm_sim replicas under uvicorn on loopback with their PUB and
replay sockets, and a ``KVEvents`` on the test's own event loop, as the
gateway runs it. Requests go to the replicas over HTTP as completions with
token-id prompts, so the test knows the exact tokens the replica cached.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Callable

import anyio
import pytest

from routing.kv_events import KVEvents
from routing.token_keys import block_keys
from tests.support.kv_sims import EventSim as Replica
from tests.support.kv_sims import token_prompt

BS = 16
pytestmark = pytest.mark.anyio


@pytest.fixture
async def fleet() -> AsyncIterator[KVEvents]:
    kv = KVEvents(BS, stale_s=0.3)
    try:
        yield kv
    finally:
        await kv.aclose()


async def until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    with anyio.fail_after(timeout):
        while not predicate():
            await anyio.sleep(0.01)


def prompt(seed: int, blocks: int) -> list[int]:
    return token_prompt(seed, blocks, BS)  # and a partial block


def held(kv: KVEvents, ids: list[int], name: str, salt: str | None = None) -> float:
    return kv.index.held(block_keys(ids, BS, salt), [name])[name]


@pytest.mark.parametrize("wire", [{}, {"kv_events_legacy": True, "kv_events_int_hashes": False},
                                  {"kv_hash": "sha256_cbor"}], ids=["tagged-int", "legacy-bytes", "vllm-hash"])
async def test_the_index_learns_what_the_replica_caches_including_before_it_subscribed(
        fleet: KVEvents, wire: dict[str, Any]) -> None:
    r = Replica("r1", **wire).start()
    try:
        early, late = prompt(1, 5), prompt(2, 3)
        await r.complete(early)  # before kvgate subscribes: replay from 0 brings it
        fleet.sync({"r1": r.endpoints})
        await until(lambda: fleet.live("r1"))
        await until(lambda: held(fleet, early, "r1") == 5)
        await r.complete(late, salt="acme")
        await until(lambda: held(fleet, late, "r1", "acme") == 3)
        assert held(fleet, late, "r1") == 0  # the salt makes it another chain
        stats = fleet.stats()["replicas"]["r1"]
        assert stats["mode"] == "precise" and stats["events_received"] >= 2 and stats["gaps"] == 0
    finally:
        r.stop()


async def test_a_cut_stream_degrades_the_replica_and_replay_recovers_it(fleet: KVEvents) -> None:
    r = Replica("r1").start()
    try:
        fleet.sync({"r1": r.endpoints})
        await until(lambda: fleet.live("r1"))
        await r.faults(kv_events_drop=True)
        lost = prompt(3, 4)
        fleet.sent("r1", block_keys(lost, BS), new_blocks=True)
        fleet.done(None)
        await r.complete(lost)
        await until(lambda: fleet.streams["r1"].state == "stale")
        assert fleet.held(block_keys(lost, BS), ["r1"]) == {}  # not trusted: the cost model goes approximate
        assert any("r1: stale" in d for d in fleet.degraded())
        await r.faults()
        after = prompt(4, 2)
        await r.complete(after)  # its batch arrives with a sequence jump: the gap is replayed
        await until(lambda: fleet.live("r1"))
        assert held(fleet, lost, "r1") == 4 and held(fleet, after, "r1") == 2
        s = fleet.streams["r1"]
        assert s.gaps == 1 and s.gaps_replayed == 1 and s.resets == 0
    finally:
        r.stop()


async def test_late_events_are_held_in_order_then_applied_with_no_gap(fleet: KVEvents) -> None:
    r = Replica("r1").start()
    try:
        fleet.sync({"r1": r.endpoints})
        await until(lambda: fleet.live("r1"))
        await r.faults(kv_events_delay_s=3600.0)  # held until the delay is lowered
        first, second = prompt(11, 3), prompt(12, 2)
        await r.complete(first)
        await r.complete(second)
        publisher = r.replica.publisher
        assert publisher is not None and publisher.pending >= 2  # handed over at step end, not sent
        assert held(fleet, first, "r1") == 0 and held(fleet, second, "r1") == 0
        await r.faults(kv_events_delay_s=0.0)  # the held batches go out at once, in order
        await until(lambda: held(fleet, first, "r1") == 3 and held(fleet, second, "r1") == 2)
        s = fleet.streams["r1"]
        assert publisher.pending == 0 and s.gaps == 0 and s.resets == 0 and fleet.live("r1")
    finally:
        r.stop()


async def test_a_served_request_stays_presumed_on_its_replica_until_its_late_events_arrive() -> None:
    kv = KVEvents(BS, stale_s=30.0)  # staleness out of the way: the events are late, not lost
    r = Replica("r1").start()
    try:
        kv.sync({"r1": r.endpoints})
        await until(lambda: kv.live("r1"))
        await r.faults(kv_events_delay_s=3600.0)
        ids, failed = prompt(13, 4), prompt(14, 2)
        keys, failed_keys = block_keys(ids, BS), block_keys(failed, BS)
        entry, lost = kv.sent("r1", keys, new_blocks=True), kv.sent("r1", failed_keys, new_blocks=True)
        await r.complete(ids)
        kv.done(entry, served=True)  # answered; its events are held back
        kv.done(lost)  # given up: nothing to presume
        assert held(kv, ids, "r1") == 0  # the index has not heard of it
        assert kv.held(keys, ["r1"]) == {"r1": 4.0} and kv.held(failed_keys, ["r1"]) == {"r1": 0.0}
        assert kv.stats()["presumed"] == 1
        await r.faults(kv_events_delay_s=0.0)
        await until(lambda: held(kv, ids, "r1") == 4)
        assert kv.held(keys, ["r1"]) == {"r1": 4.0}  # now from the index, and the presumption ends
        assert kv.stats()["presumed"] == 0
    finally:
        r.stop()
        await kv.aclose()


async def test_a_restarted_replica_is_cleared_then_relearned(fleet: KVEvents) -> None:
    r = Replica("r1").start()
    try:
        fleet.sync({"r1": r.endpoints})
        await until(lambda: fleet.live("r1"))
        before = prompt(5, 4)
        await r.complete(before)
        await until(lambda: held(fleet, before, "r1") == 4)
        r.stop()
        await until(lambda: fleet.streams["r1"].state == "down")
        assert fleet.held(block_keys(before, BS), ["r1"]) == {}
        r.start()  # same ports, empty cache, sequence from 0
        await until(lambda: fleet.live("r1"))
        assert held(fleet, before, "r1") == 0
        again = prompt(6, 2)
        await r.complete(again)
        await until(lambda: held(fleet, again, "r1") == 2)
        assert fleet.streams["r1"].reconnects == 2
    finally:
        r.stop()


async def test_a_replica_leaving_membership_is_forgotten(fleet: KVEvents) -> None:
    a, b = Replica("a").start(), Replica("b").start()
    try:
        fleet.sync({"a": a.endpoints, "b": b.endpoints})
        await until(lambda: fleet.live("a") and fleet.live("b"))
        ids = prompt(7, 3)
        await a.complete(ids)
        await b.complete(ids)
        await until(lambda: fleet.held(block_keys(ids, BS), ["a", "b"]) == {"a": 3, "b": 3})
        fleet.sync({"b": b.endpoints})
        assert fleet.held(block_keys(ids, BS), ["a", "b"]) == {"b": 3} and fleet.index.size("a") == 0
    finally:
        a.stop()
        b.stop()


async def test_a_replica_with_another_block_size_is_reported(fleet: KVEvents) -> None:
    r = Replica("r1", block_size=32).start()  # kvgate expects 16
    try:
        fleet.sync({"r1": r.endpoints})
        await until(lambda: fleet.live("r1"))
        await r.complete(prompt(8, 4))
        await until(lambda: fleet.index.stats("r1").get("skipped", 0) > 0)
        assert fleet.index.size("r1") == 0
        assert any("blocks skipped (block size is not 16?)" in d for d in fleet.degraded())
    finally:
        r.stop()
