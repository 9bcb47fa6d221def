"""Redis faults: killed, paused (SIGSTOP), absent at start-up, restarted. A fault is a bounded miss."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from typing import AsyncIterator

import pytest
import redis

from semantic_cache import CachedAnswer, SemanticCache, SemanticCacheSettings, cache_request
from tests.support.redis_server import PrivateRedis

pytestmark = pytest.mark.anyio

TIMEOUT_S = 0.2
# Failing fast: well under one socket timeout (a call that waited on the paused Redis would take
# TIMEOUT_S), with room for a scheduling pause on a loaded 2-core machine.
FAST_S = TIMEOUT_S / 4
ANSWER = CachedAnswer("Paris.", "stop", "m1", 5, 2, 1)
S = SemanticCacheSettings(enabled=True, embedder="hash", threshold=0.5, probe_interval_s=0.1,
                          sync_block_ms=100)


def req(question: str = "What is the capital of France?"):
    return cache_request("chat", "t1", {"model": "m1", "messages": [{"role": "user", "content": question}]},
                         {}, settings=S)


@pytest.fixture
async def cache_on(private_redis: PrivateRedis) -> AsyncIterator[SemanticCache]:
    cache = await SemanticCache.open(S, private_redis.url, redis_timeout_s=TIMEOUT_S)
    await cache.wait_ready(5)
    yield cache
    await cache.aclose()


async def timed(coro):  # type: ignore[no-untyped-def]
    start = time.monotonic()
    result = await coro
    return result, time.monotonic() - start


def restart_on_same_port(server: PrivateRedis) -> None:
    """Bring a killed private Redis back on its old port (empty, as after a crash)."""
    server.proc = subprocess.Popen(
        [shutil.which("redis-server") or "redis-server", "--port", str(server.port), "--bind", "127.0.0.1",
         "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while True:
        try:
            redis.Redis.from_url(server.url, socket_timeout=0.5).ping()
            return
        except redis.ConnectionError:
            assert time.monotonic() < deadline, "redis did not restart"
            time.sleep(0.05)


# Probes and checks run every 0.1 s (S.probe_interval_s): 5 s is room for a loaded 2-core machine.
async def wait_until(predicate, timeout_s: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


async def test_killed_redis_degrades_to_fast_misses_and_recovers(cache_on: SemanticCache,
                                                                 private_redis: PrivateRedis) -> None:
    cache = cache_on
    assert await cache.store(req(), ANSWER)
    assert (await cache.lookup(req())).status == "hit"
    private_redis.stop()
    for _ in range(3):  # the pooled socket fails first (reset), then a reconnect is refused
        result, took = await timed(cache.lookup(req()))
        assert result.status == "miss" and result.reason == "store_unavailable" and took < 2 * TIMEOUT_S + 0.1
        if not cache.healthy:
            break
    assert not cache.healthy and cache.stats()["redis"] == "degraded"
    # The breaker is open: later calls do not touch the socket at all.
    for _ in range(20):
        result, took = await timed(cache.lookup(req("Where is Paris?")))
        assert result.reason == "store_degraded" and took < FAST_S
        stored, took = await timed(cache.store(req("Where is Paris?"), ANSWER))
        assert stored is False and took < FAST_S
    restart_on_same_port(private_redis)
    await wait_until(lambda: cache.healthy)
    assert await cache.store(req(), ANSWER)  # Redis came back empty; the cache works again
    assert (await cache.lookup(req())).status == "hit"


async def test_paused_redis_costs_one_timeout_then_fails_fast(cache_on: SemanticCache,
                                                              private_redis: PrivateRedis) -> None:
    cache = cache_on
    assert await cache.store(req(), ANSWER)
    with private_redis.paused():
        results = await asyncio.gather(*[timed(cache.lookup(req())) for _ in range(10)])
        for result, took in results:
            assert result.status == "miss" and took < 3 * TIMEOUT_S + 0.2
        stored, took = await timed(cache.store(req("other?"), ANSWER))
        assert stored is False and took < 3 * TIMEOUT_S + 0.2
        assert not cache.healthy
        result, took = await timed(cache.lookup(req()))
        assert result.reason == "store_degraded" and took < FAST_S
    await wait_until(lambda: cache.healthy)
    await wait_until(lambda: cache.stats()["sync"]["resyncs"] >= 2)
    assert (await cache.lookup(req())).status == "hit"


async def test_starts_without_redis_and_connects_later(private_redis: PrivateRedis) -> None:
    private_redis.stop()
    cache, took = await timed(SemanticCache.open(S, private_redis.url, redis_timeout_s=TIMEOUT_S))
    try:
        assert took < 2 * TIMEOUT_S + 0.5 and not cache.healthy
        assert (await cache.lookup(req())).status == "miss"
        assert not await cache.store(req(), ANSWER)
        restart_on_same_port(private_redis)
        await wait_until(lambda: cache.healthy)
        assert await cache.store(req(), ANSWER)
        assert (await cache.lookup(req())).status == "hit"
    finally:
        await cache.aclose()


async def test_restarted_redis_drops_stale_index_entries(cache_on: SemanticCache,
                                                         private_redis: PrivateRedis) -> None:
    cache = cache_on
    assert await cache.store(req("How do I install packages in Python?"), ANSWER)
    assert cache.stats()["indexed_vectors"] == 1
    private_redis.stop()
    await cache.lookup(req())  # trips the breaker
    restart_on_same_port(private_redis)  # empty: the entry is gone
    await wait_until(lambda: cache.healthy and cache.stats()["indexed_vectors"] == 0)
    assert (await cache.lookup(req("how do I install packages in python"))).status == "miss"


async def test_a_flushed_redis_drops_stale_index_entries(cache_on: SemanticCache,
                                                         private_redis: PrivateRedis) -> None:
    """Redis lost its data while no call of ours failed (a flush; or a restart between two calls,
    which the client reconnects silently): the index must not keep what is gone."""
    cache = cache_on
    assert await cache.store(req("How do I install packages in Python?"), ANSWER)
    assert cache.stats()["indexed_vectors"] == 1
    redis.Redis.from_url(private_redis.url).flushall()
    await wait_until(lambda: cache.stats()["indexed_vectors"] == 0)
    assert cache.healthy and cache.stats()["sync"]["redis_data_lost"] == 1
    assert (await cache.lookup(req("how do I install packages in python"))).status == "miss"
    assert await cache.store(req(), ANSWER)  # and it goes on caching in the new data set
    assert (await cache.lookup(req())).status == "hit"


async def test_purge_reports_a_dead_redis(cache_on: SemanticCache, private_redis: PrivateRedis) -> None:
    from semantic_cache import StoreUnavailable

    private_redis.stop()
    with pytest.raises(StoreUnavailable):
        await cache_on.purge(namespace="t1")
