"""SemanticCache behaviour on a real Redis (and the in-process store), with the hash embedder."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import AsyncIterator, Awaitable, Callable

import pytest
import redis

from semantic_cache import CachedAnswer, HashEmbedder, SemanticCache, SemanticCacheSettings, cache_request
from semantic_cache.cache import PendingVector
from semantic_cache.normalize import embedding_text

pytestmark = pytest.mark.anyio

Make = Callable[..., Awaitable[SemanticCache]]
ANSWER = CachedAnswer(content="Use a virtualenv.", finish_reason="stop", model="m1", prompt_tokens=9,
                      completion_tokens=4, created=1_700_000_000)


def settings(**overrides: object) -> SemanticCacheSettings:
    base = dict(enabled=True, embedder="hash", threshold=0.5, probe_interval_s=0.1, sync_block_ms=100)
    return SemanticCacheSettings(**{**base, **overrides})  # type: ignore[arg-type]


def chat_req(question: str, *, ns: str = "t1", model: str = "m1", system: str = "You are helpful.",
             history: list[dict] | None = None, s: SemanticCacheSettings | None = None, **params: object):
    messages = [{"role": "system", "content": system}, *(history or []), {"role": "user", "content": question}]
    return cache_request("chat", ns, {"model": model, "messages": messages, **params}, {}, settings=s or settings())


@pytest.fixture
async def make_cache(redis_service: str) -> AsyncIterator[Make]:
    """Caches on the session Redis under a private key prefix, closed and cleaned after the test."""
    prefix = f"kvgate:sc:test-{uuid.uuid4().hex[:8]}:"
    opened: list[SemanticCache] = []

    async def make(url: str | None = redis_service, redis_timeout_s: float = 0.2, **overrides: object) -> SemanticCache:
        cache = await SemanticCache.open(settings(key_prefix=prefix, **overrides), url, redis_timeout_s=redis_timeout_s)
        opened.append(cache)
        await cache.wait_ready(5)
        return cache

    yield make
    for cache in opened:
        await cache.aclose()
    client = redis.Redis.from_url(redis_service)
    for key in client.scan_iter(prefix + "*"):
        client.delete(key)
    client.close()


@pytest.mark.parametrize("backend", ["redis", "memory"])
async def test_exact_then_semantic_hit(make_cache: Make, redis_service: str, backend: str) -> None:
    cache = await make_cache(redis_service if backend == "redis" else None)
    req = chat_req("How do I install packages in Python?")
    assert (await cache.lookup(req)).status == "miss"
    assert await cache.store(req, ANSWER)
    exact = await cache.lookup(req)
    assert (exact.status, exact.tier, exact.answer) == ("hit", "exact", ANSWER)
    near = await cache.lookup(chat_req("how do I install packages in python"))
    assert (near.status, near.tier) == ("hit", "semantic") and near.answer == ANSWER
    assert near.similarity is not None and 0.5 <= near.similarity < 1
    stats = cache.stats()
    assert stats["lookups"]["hit_exact"] == 1 and stats["lookups"]["hit_semantic"] == 1
    assert stats["entries"] == {"t1": 1} and stats["healthy"]


async def test_never_crosses_namespace_model_system_or_history(make_cache: Make) -> None:
    cache = await make_cache()
    q = "How do I install packages in Python?"
    assert await cache.store(chat_req(q), ANSWER)
    others = [
        chat_req(q, ns="t2"),
        chat_req(q, model="m2"),
        chat_req(q, system="You are a pirate."),
        chat_req(q, history=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]),
        chat_req(q, temperature=0.1),
    ]
    for other in others:
        result = await cache.lookup(other)
        assert result.status == "miss" and result.reason == "empty_partition", other
        near = await cache.lookup(chat_req("how do I install packages in python", ns=other.namespace,
                                           model=other.model))
        if other.namespace != "t1" or other.model != "m1":
            assert near.status == "miss"
    assert (await cache.lookup(chat_req(q))).status == "hit"  # control: same partition hits


async def test_verifier_rejects_a_near_trap(make_cache: Make) -> None:
    cache = await make_cache(threshold=0.3)
    assert await cache.store(chat_req("How do I install packages in Python 3?"), ANSWER)
    for trap, reason in [("How do I install packages in Python 2?", "number"),
                         ("How do I not install packages in Python 3?", "negation"),
                         ("How do I install packages in Ruby 3?", "entity")]:
        result = await cache.lookup(chat_req(trap))
        assert result.status == "miss" and result.reason == f"verifier:{reason}", trap
    assert cache.stats()["rejected"] == {"number": 1, "negation": 1, "entity": 1}


@pytest.mark.parametrize("answer, reason", [
    (CachedAnswer("cut off", "length", "m1"), "finish_reason:length"),
    (CachedAnswer("", "stop", "m1"), "empty"),
    (CachedAnswer("  \n", "stop", "m1"), "empty"),
    (CachedAnswer("partial", "error", "m1"), "finish_reason:error"),
    (CachedAnswer("flagged", "content_filter", "m1"), "finish_reason:content_filter"),
    (CachedAnswer("", "tool_calls", "m1", tool_calls=[{"id": "c", "type": "function",
                                                       "function": {"name": "f", "arguments": "{}"}}]),
     "tool_calls"),
])
async def test_failed_or_partial_answers_are_never_stored(make_cache: Make, answer: CachedAnswer,
                                                          reason: str) -> None:
    cache = await make_cache()
    req = chat_req("What is the capital of France?")
    assert not await cache.store(req, answer)
    assert (await cache.lookup(req)).status == "miss"
    assert cache.stats()["refused"] == {reason: 1}


async def test_tool_calls_stored_only_when_allowed(make_cache: Make) -> None:
    cache = await make_cache(cache_tool_calls=True)
    calls = [{"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}]
    req = chat_req("Weather in Paris?", tools=[{"type": "function", "function": {"name": "weather"}}])
    assert await cache.store(req, CachedAnswer("", "tool_calls", "m1", tool_calls=calls))
    hit = await cache.lookup(req)
    assert hit.status == "hit" and hit.answer is not None and hit.answer.tool_calls == calls


async def test_bypassed_requests_neither_look_up_nor_store(make_cache: Make) -> None:
    cache = await make_cache()
    q = "What is the capital of France?"
    assert await cache.store(chat_req(q), ANSWER)
    for req in [chat_req(q, n=2), chat_req(q, logprobs=True),
                cache_request("chat", "t1", {"model": "m1", "messages": [{"role": "user", "content": q}]},
                              {"Cache-Control": "no-store"}, settings=settings())]:
        assert (await cache.lookup(req)).status == "bypass"
        assert not await cache.store(req, ANSWER)
    # no-cache: skip the cached answer, but the fresh one replaces it.
    body = {"model": "m1", "messages": [{"role": "system", "content": "You are helpful."},
                                        {"role": "user", "content": q}]}
    refresh = cache_request("chat", "t1", body, {"cache-control": "no-cache"}, settings=settings())
    assert (await cache.lookup(refresh)).reason == "no_cache"
    fresh = CachedAnswer("Paris.", "stop", "m1")
    assert await cache.store(refresh, fresh)
    assert (await cache.lookup(chat_req(q))).answer == fresh


async def test_purge_by_namespace_model_and_age(make_cache: Make) -> None:
    cache = await make_cache()
    for ns, model in [("a", "m1"), ("a", "m2"), ("b", "m1"), ("b", "m2")]:
        assert await cache.store(chat_req("Where is the Eiffel Tower?", ns=ns, model=model), ANSWER)
    assert await cache.purge(older_than_s=60) == 0
    assert await cache.purge(namespace="a", model="m1") == 1
    assert (await cache.lookup(chat_req("Where is the Eiffel Tower?", ns="a", model="m1"))).status == "miss"
    assert (await cache.lookup(chat_req("Where is the Eiffel Tower?", ns="a", model="m2"))).status == "hit"
    assert await cache.purge(model="m2") == 2
    await asyncio.sleep(0.05)
    assert await cache.purge(older_than_s=0.01) == 1
    assert cache.stats()["entries"] == {}


async def test_ttl_expires_entries(make_cache: Make) -> None:
    cache = await make_cache(ttl_s=1)
    req = chat_req("What is the capital of France?")
    assert await cache.store(req, ANSWER)
    assert (await cache.lookup(req)).status == "hit"
    await asyncio.sleep(1.1)
    assert (await cache.lookup(req)).status == "miss"
    assert (await cache.lookup(chat_req("what is the capital of france"))).status == "miss"


@pytest.mark.parametrize("backend", ["redis", "memory"])
async def test_namespace_cap_evicts_least_recently_used(make_cache: Make, redis_service: str,
                                                        backend: str) -> None:
    cache = await make_cache(redis_service if backend == "redis" else None, max_entries_per_namespace=10)
    reqs = [chat_req(f"Question number {i}?") for i in range(12)]
    for req in reqs[:10]:
        assert await cache.store(req, ANSWER)
    assert (await cache.lookup(reqs[0])).status == "hit"  # touched: now #1 is least recently used
    assert await cache.store(chat_req("Other namespace?", ns="t2"), ANSWER)
    for req in reqs[10:]:
        assert await cache.store(req, ANSWER)
    hits = [(await cache.lookup(r)).tier == "exact" for r in reqs]
    assert hits[0] and not hits[1] and not hits[2] and all(hits[3:])
    assert cache.stats()["entries"] == {"t1": 10, "t2": 1}


async def test_two_instances_share_entries_within_a_second(make_cache: Make) -> None:
    a, b = await make_cache(), await make_cache()
    assert await a.store(chat_req("How do I install packages in Python?"), ANSWER)
    deadline = time.monotonic() + 1.0
    while True:  # semantic hit needs b's own index to hold the vector, not just Redis
        result = await b.lookup(chat_req("how do I install packages in python"))
        if result.status == "hit" or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.02)
    assert (result.status, result.tier) == ("hit", "semantic")
    assert await b.purge(namespace="t1") == 1
    await asyncio.sleep(0.3)
    assert (await a.lookup(chat_req("how do I install packages in python"))).status == "miss"
    assert a.stats()["indexed_vectors"] == 0


@pytest.mark.parametrize("interval_ms", [900, 0])
async def test_a_burst_of_writes_wakes_the_change_log_tail_once_not_once_each(make_cache: Make,
                                                                              interval_ms: int) -> None:
    """Every write (our own too) wakes a blocked log reader, and each re-arm is a socket
    write on the event loop the stores share: the tail reads at most once per interval.
    With no interval (the counter-case) it re-arms after nearly every write."""
    a = await make_cache(sync_interval_ms=interval_ms)
    b = await make_cache(sync_interval_ms=interval_ms)
    reads0 = a.stats()["sync"]["log_reads"]
    for i in range(12):  # 24 log events: each store writes the entry, then its vector
        assert await a.store(chat_req(f"How do I install package number {i} in Python?"), ANSWER)
    reads = a.stats()["sync"]["log_reads"] - reads0
    if interval_ms:
        # The first write wakes the tail; the rest wait in the stream (12 stores take far less
        # than 0.9 s; a machine so loaded that they do not gets one more read per 0.9 s).
        assert reads <= 3
    else:
        assert reads >= 6
    # Another instance still serves them, from its own index, within a second.
    deadline = time.monotonic() + 2.0
    while True:
        result = await b.lookup(chat_req("how do I install package number 11 in python"))
        if result.status == "hit" or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.02)
    assert (result.status, result.tier) == ("hit", "semantic")


@pytest.mark.parametrize("backend", ["redis", "memory"])
async def test_a_vector_added_after_the_exact_write_is_shared_and_never_revives_a_gone_entry(
        make_cache: Make, redis_service: str, backend: str) -> None:
    """store_exact serves the exact tier at once; store_vector adds the semantic tier later,
    here and (through the change log) on other instances, but never to an entry that went."""
    url = redis_service if backend == "redis" else None
    a = await make_cache(url)
    b = await make_cache(url) if backend == "redis" else None  # tails a's change log
    vector = HashEmbedder().encode([embedding_text(chat_req("How do I install packages in Python?").query)])[0]
    paraphrase = chat_req("how do I install packages in python")
    req = chat_req("How do I install packages in Python?")
    later: asyncio.Future[object] = asyncio.get_running_loop().create_future()
    stored = await a.store_exact(req, ANSWER, later)
    assert isinstance(stored, PendingVector)
    assert (await a.lookup(req)).tier == "exact" and (await a.lookup(paraphrase)).tier is None
    later.set_result(vector)
    assert await a.store_vector(stored)
    assert (await a.lookup(paraphrase)).tier == "semantic"
    if b is not None:  # the vector's "add" event: b fetches the entry again, now indexed
        deadline = time.monotonic() + 2.0
        while (await b.lookup(paraphrase)).tier != "semantic" and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert (await b.lookup(paraphrase)).tier == "semantic"
    # Purged while its embedding was still running: the vector write must not bring it back.
    gone = chat_req("How do I upgrade pip?")
    later = asyncio.get_running_loop().create_future()
    stored = await a.store_exact(gone, ANSWER, later)
    assert isinstance(stored, PendingVector)
    assert await a.purge(namespace="t1") == 2
    later.set_result(vector)
    assert not await a.store_vector(stored)
    assert a.stats()["stores"]["vector_dropped"] == 1 and a.stats()["indexed_vectors"] == 0
    assert (await a.lookup(gone)).status == "miss"
    if backend == "redis":
        client = redis.Redis.from_url(redis_service)
        assert not client.keys(f"{a.settings.key_prefix}e:*")
        client.close()


async def test_new_instance_rebuilds_index_from_redis(make_cache: Make) -> None:
    a = await make_cache()
    for i in range(5):
        assert await a.store(chat_req(f"How do I install package number {i} in Python?"), ANSWER)
    b = await make_cache(brute_force_max=2)  # 5 > 2: the partition is rebuilt as one graph
    assert b.stats()["indexed_vectors"] == 5 and b.stats()["entries"] == {"t1": 5}
    assert (await b.lookup(chat_req("how do I install package number 3 in python"))).tier == "semantic"


async def test_completions_use_exact_tier(make_cache: Make) -> None:
    cache = await make_cache()
    body = {"model": "m1", "prompt": "Once upon a time", "max_tokens": 5}
    req = cache_request("completions", "t1", body, {}, settings=settings())
    assert await cache.store(req, ANSWER)
    assert (await cache.lookup(req)).tier == "exact"
    near = cache_request("completions", "t1", {**body, "prompt": "once upon a time"}, {}, settings=settings())
    assert (await cache.lookup(near)).reason == "no_exact_match"


async def test_concurrent_stores_and_lookups_stay_consistent(make_cache: Make, redis_service: str) -> None:
    """A seeded burst of interleaved stores and lookups: nothing raises, every count adds up."""
    import random

    # A generous timeout: this test is about consistency under concurrency, not about faults
    # (on a starved CI core a 0.2 s timeout trips the breaker, which other tests cover).
    cache = await make_cache(max_entries_per_namespace=50, redis_timeout_s=2.0)
    rng = random.Random(7)
    ops = [(rng.choice(["store", "lookup"]), rng.choice(["t1", "t2"]), rng.randrange(80)) for _ in range(400)]

    async def run(op: str, ns: str, i: int) -> object:
        r = chat_req(f"Question number {i} about topic {i % 7}?", ns=ns)
        return await (cache.store(r, ANSWER) if op == "store" else cache.lookup(r))

    results = await asyncio.gather(*[run(*op) for op in ops])
    lookups = [r for r, op in zip(results, ops) if op[0] == "lookup"]
    assert all(getattr(r, "status", None) in ("hit", "miss") for r in lookups)
    # Under CPU starvation a store may give up (queued past the Redis timeout): False, never raise.
    assert all(isinstance(r, bool) for r, op in zip(results, ops) if op[0] == "store")
    # Interleaved evictions and re-stores can leave the local catalog briefly off; the
    # resynchronisation (periodic safety net) repairs it.
    for _ in range(100):  # should the breaker have opened anyway, let its probe close it
        if cache.healthy:
            break
        await asyncio.sleep(0.05)
    await cache._sync.resync()  # type: ignore[union-attr]
    stats = cache.stats()
    assert sum(stats["lookups"].values()) == len(lookups)
    assert all(n <= 50 for n in stats["entries"].values())
    assert stats["indexed_vectors"] == sum(stats["entries"].values())
    client = redis.Redis.from_url(redis_service)
    try:
        for ns, n in stats["entries"].items():
            assert client.zcard(f"{cache.settings.key_prefix}ns:{ns}") == n
    finally:
        client.close()


async def test_injected_redis_connector_is_used(redis_service: str) -> None:
    """The gateway builds the clients (single server or cluster); the cache asks for two."""
    import redis.asyncio as aioredis

    made: list[tuple[float, float]] = []

    def connect(timeout_s: float, read_timeout_s: float) -> aioredis.Redis:
        made.append((timeout_s, read_timeout_s))
        return aioredis.Redis.from_url(redis_service, socket_timeout=read_timeout_s,
                                       socket_connect_timeout=timeout_s)

    prefix = f"kvgate:sc:test-{uuid.uuid4().hex[:8]}:"
    cache = await SemanticCache.open(settings(key_prefix=prefix), redis_service, 0.2, connect=connect)
    try:
        await cache.wait_ready(5)
        assert made == [(0.2, 0.2), (0.2, pytest.approx(0.3))]  # commands; the blocking log reader
        assert await cache.store(chat_req("What is the capital of France?"), ANSWER)
        assert (await cache.lookup(chat_req("What is the capital of France?"))).tier == "exact"
    finally:
        await cache.purge()
        await cache.aclose()
        client = redis.Redis.from_url(redis_service)
        for key in client.scan_iter(prefix + "*"):
            client.delete(key)
        client.close()
