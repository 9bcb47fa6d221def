"""Batched Redis writes: concurrent stores share pipelined round trips, every write
lands as if it went alone, and an outage in the middle of a batch degrades caching
without touching what is served.

On real Redis (one server and a 3-node cluster for the sharing tests; a private
server for the outage, which the test pauses), and through a real kvgate with the
openai SDK for what clients see.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
import uuid
from typing import Any

import openai
import pytest

from gateway.redis_client import connector
from semantic_cache import CachedAnswer, SemanticCache, SemanticCacheSettings, cache_request
from tests.support.redis_fixtures import pfx, redis_service  # noqa: F401 (fixtures)
from tests.support.redis_server import PrivateRedis
from tests.support.stack import MODEL, start_stack

ANSWER = CachedAnswer("Hold the reset button for ten seconds.", "stop", "m1", 5, 7, 1)


def settings(prefix: str, **kw: Any) -> SemanticCacheSettings:
    return SemanticCacheSettings(enabled=True, embedder="hash", threshold=0.5, key_prefix=prefix,
                                 probe_interval_s=0.1, sync_block_ms=100, **kw)


def req(s: SemanticCacheSettings, i: int, question: str = "How do I reset router"):  # type: ignore[no-untyped-def]
    body = {"model": "m1", "messages": [{"role": "system", "content": f"Context {i}."},
                                        {"role": "user", "content": f"{question} number {i}?"}]}
    return cache_request("chat", "t1", body, {}, settings=s)


async def open_cache(s: SemanticCacheSettings, url: str, timeout_s: float = 2.0) -> SemanticCache:
    cache = await SemanticCache.open(s, url, timeout_s, connect=connector(url))
    assert await cache.wait_ready(10)
    return cache


@pytest.mark.anyio
async def test_concurrent_stores_share_round_trips_and_each_lands(redis_service: str, pfx: str) -> None:
    s = settings(pfx)
    writer, reader = await open_cache(s, redis_service), await open_cache(s, redis_service)
    try:
        trips0 = writer.stats()["redis_write_batches"]
        # Exact entries first, then their vectors: both kinds of write go through batches.
        stored = await asyncio.gather(*[writer.store(req(s, i), ANSWER) for i in range(16)])
        assert all(stored)
        st = writer.stats()
        trips, writes = st["redis_write_batches"] - trips0, st["redis_writes"]
        assert writes >= 16 and trips < 16  # fewer round trips than writes
        assert st["stores"]["ok"] == 16 and st["stores"]["vector_ok"] == 16
        # Another instance, reading Redis alone, serves every one of them, by both tiers.
        for i in range(16):
            assert (await reader.lookup(req(s, i))).tier == "exact"
        assert (await writer.lookup(req(s, 3, "how do I reset my router"))).tier == "semantic"
    finally:
        for cache in (writer, reader):
            await cache.purge(namespace="t1")
            await cache.aclose()


@pytest.mark.anyio
async def test_the_namespace_cap_holds_when_its_writes_share_a_batch(redis_service: str, pfx: str) -> None:
    """Scripts in one pipeline still run one after another, each atomic: a namespace cap
    enforced by one write is seen by the next write in the same batch."""
    s = settings(pfx, max_entries_per_namespace=10)
    cache = await open_cache(s, redis_service)
    try:
        assert all(await asyncio.gather(*[cache.store(req(s, i), ANSWER) for i in range(10)]))
        await asyncio.gather(*[cache.store(req(s, 100 + i), ANSWER) for i in range(10)])
        hits = [(await cache.lookup(req(s, i))).status == "hit" for i in range(10)]
        newer = [(await cache.lookup(req(s, 100 + i))).status == "hit" for i in range(10)]
        assert sum(hits) + sum(newer) <= 10 and all(newer)  # the cap held; the newest ten kept
    finally:
        await cache.purge(namespace="t1")
        await cache.aclose()


@pytest.mark.anyio
async def test_an_outage_mid_batch_fails_each_write_quickly_and_caching_recovers(
        private_redis: PrivateRedis) -> None:
    timeout_s = 0.3
    s = settings("kvgate:test:outage:", breaker_failures=3)
    cache = await open_cache(s, private_redis.url, timeout_s)
    try:
        assert await cache.store(req(s, 0), ANSWER)
        private_redis.pause()  # hung: the batch goes out and no reply comes back
        started = time.monotonic()
        results = await asyncio.gather(*[cache.store_exact(req(s, i), ANSWER) for i in range(1, 9)])
        took = time.monotonic() - started
        assert results == [False] * 8  # told, not raised, not hung
        assert took < 2 * timeout_s + 0.5, took  # one round trip's timeout, not one per write
        assert cache.stats()["stores"]["failed:store_unavailable"] == 8
        assert (await cache.lookup(req(s, 0))).status == "miss"  # a fault is a miss
        private_redis.resume()
        deadline = time.monotonic() + 10
        while not (cache.healthy and await cache.store(req(s, 20), ANSWER)):
            assert time.monotonic() < deadline, "caching did not recover"
            await asyncio.sleep(0.1)
        assert (await cache.lookup(req(s, 20))).tier == "exact"
    finally:
        private_redis.resume()
        await cache.aclose()


def test_a_redis_outage_mid_batch_loses_no_response(private_redis: PrivateRedis) -> None:
    """Eight users wait on a slow replica; Redis hangs while their answers are in flight, so
    their stores hit it as one batch. Every user still gets the whole answer, promptly."""
    stack = start_stack(1, redis_url=private_redis.url, redis_timeout_s=2.0,
                        semantic_cache={"enabled": True, "embedder": "hash",
                                        "key_prefix": f"kvgate:test:{uuid.uuid4().hex[:8]}:"})
    try:
        cache = stack.runtime.cache
        assert cache is not None
        client = openai.OpenAI(base_url=stack.base_url, api_key="x", max_retries=0, timeout=30)

        def ask(i: int, stream: bool) -> tuple[str, str]:
            messages = [{"role": "system", "content": f"Context {uuid.uuid4().hex}."},
                        {"role": "user", "content": f"How do I reset router {i}?"}]
            raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                                                    stream=stream)
            if stream:
                chunks = list(raw.parse())
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                finish = next(c.choices[0].finish_reason for c in reversed(chunks) if c.choices)
            else:
                choice = raw.parse().choices[0]
                text, finish = choice.message.content or "", choice.finish_reason
            return text, finish or ""

        reference = ask(0, False)  # what a whole answer looks like, Redis up
        assert reference[0] and reference[1] == "stop"
        lookups0 = sum(cache.stats()["lookups"].values())
        stack.faults("r1", stall_before_first_token_s=1.0)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(ask, i, bool(i % 2)) for i in range(1, 9)]
            # Every lookup done (a miss): the eight are upstream, their stores still to come.
            assert stack.wait_for(lambda: sum(cache.stats()["lookups"].values()) - lookups0 == 8, timeout=10)
            private_redis.pause()
            started = time.monotonic()
            answers = [f.result(timeout=30) for f in futures]
            took = time.monotonic() - started
        assert all(text and finish == "stop" for text, finish in answers)
        # The replica's stall plus at most store_wait_ms (50 ms) and slack: not the Redis timeout.
        assert took < 1.0 + 1.5, took
    finally:
        private_redis.resume()
        stack.close()
