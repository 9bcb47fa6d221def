"""Embedders (hash, remote over a MockTransport, micro-batching) and the partitioned index."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import numpy as np
import pytest

from semantic_cache import EmbedderError, HashEmbedder, RemoteEmbedder
from semantic_cache.embedder import LocalEmbedder, MicroBatcher
from semantic_cache.index import VectorIndex

pytestmark = pytest.mark.anyio


def unit(rng: np.random.Generator, n: int, dim: int = 16) -> np.ndarray:
    v = rng.normal(size=(n, dim)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


async def test_hash_embedder_is_deterministic_unit_vectors() -> None:
    emb = HashEmbedder(dim=32)
    a = await emb.embed(["how do i learn python", "how do i learn python", "something else entirely"])
    assert a.shape == (3, 32) and np.allclose(np.linalg.norm(a, axis=1), 1, atol=1e-5)
    assert np.array_equal(a[0], a[1]) and float(a[0] @ a[2]) < 0.9


async def test_micro_batcher_coalesces_concurrent_calls() -> None:
    calls: list[int] = []

    async def encode(texts: list[str]) -> np.ndarray:
        calls.append(len(texts))
        await asyncio.sleep(0.01)  # while one batch runs, the next fills up
        return np.array([[float(len(t)), 1.0] for t in texts], dtype=np.float32)

    batcher = MicroBatcher(encode, batch_max=8)
    try:
        results = await asyncio.gather(*[batcher.embed(["x" * i]) for i in range(20)])
        assert [float(r[0][0]) for r in results] == [float(i) for i in range(20)]  # each got its own
        assert len(calls) < 20 and max(calls) <= 8 and sum(calls) == 20
    finally:
        await batcher.aclose()


async def test_micro_batcher_failure_fails_only_that_batch() -> None:
    fail = True

    async def encode(texts: list[str]) -> np.ndarray:
        if fail:
            raise RuntimeError("model exploded")
        return np.ones((len(texts), 2), dtype=np.float32)

    batcher = MicroBatcher(encode, batch_max=4)
    try:
        with pytest.raises(EmbedderError):
            await batcher.embed(["a"])
        fail = False
        assert (await batcher.embed(["b", "c"])).shape == (2, 2)  # the worker survived
    finally:
        await batcher.aclose()


async def test_local_embedder_runs_off_the_event_loop() -> None:
    """A slow model must not block the loop: a ticker keeps running while it encodes."""
    main = threading.get_ident()
    seen: list[int] = []

    class SlowModel:
        def encode(self, texts: list[str], **_: object) -> np.ndarray:
            seen.append(threading.get_ident())
            time.sleep(0.2)
            return np.ones((len(texts), 4), dtype=np.float32)

    emb = LocalEmbedder(loader=SlowModel, batch_max=4, threads=None)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    task = asyncio.create_task(ticker())
    try:
        await emb.start()
        out = await emb.embed(["a", "b"])
        assert out.shape == (2, 4) and ticks >= 10 and seen and main not in seen
    finally:
        task.cancel()
        await emb.aclose()


async def test_remote_embedder_over_mock_transport() -> None:
    requests: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        requests.append(body)
        data = [{"object": "embedding", "index": i, "embedding": [float(len(t)), 3.0, 4.0]}
                for i, t in reversed(list(enumerate(body["input"])))]  # out of order on purpose
        return httpx.Response(200, json={"object": "list", "data": data, "model": body["model"]})

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        emb = RemoteEmbedder(client, "http://embed.test/v1/embeddings", "mini", batch_max=16)
        out = await asyncio.gather(emb.embed(["a"]), emb.embed(["bbbb"]))
        assert np.allclose(np.linalg.norm(out[0], axis=1), 1)
        assert out[0][0][0] < out[1][0][0]  # rows matched to their own texts
        assert requests[0]["model"] == "mini" and sum(len(r["input"]) for r in requests) == 2
        await emb.aclose()


async def test_remote_embedder_errors_become_embedder_error() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, json={"error": {"message": "down"}})

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        emb = RemoteEmbedder(client, "http://embed.test/v1/embeddings", "mini")
        with pytest.raises(EmbedderError):
            await emb.embed(["a"])
        await emb.aclose()


def test_index_never_returns_another_partition() -> None:
    rng = np.random.default_rng(0)
    vecs = unit(rng, 600)
    index = VectorIndex(brute_force_max=64)
    for i, v in enumerate(vecs):
        index.add(f"p{i % 3}", f"id{i}", v, f"q{i}")
    for i in range(0, 600, 7):
        hits = index.search(f"p{i % 3}", vecs[i], k=5, min_similarity=-1)
        assert hits[0].id == f"id{i}" and abs(hits[0].similarity - 1) < 1e-4
        assert all(int(h.id[2:]) % 3 == i % 3 for h in hits)
    assert index.search("p9", vecs[0], k=5, min_similarity=-1) == []


def test_index_replace_remove_and_graph_conversion() -> None:
    rng = np.random.default_rng(1)
    vecs = unit(rng, 300)
    index = VectorIndex(brute_force_max=50)
    for i, v in enumerate(vecs):
        index.add("p", f"id{i}", v, f"q{i}")
    assert len(index) == 300 and index.memory_bytes() > 0
    index.add("p", "id0", vecs[1], "replaced")  # same id: replaced, not duplicated
    assert len(index) == 300
    top = index.search("p", vecs[1], k=2, min_similarity=0.99)
    assert {h.id for h in top} == {"id0", "id1"}
    for i in range(1, 300):
        assert index.remove(f"id{i}")
    assert not index.remove("id1") and len(index) == 1
    assert [h.query for h in index.search("p", vecs[1], k=3, min_similarity=0.5)] == ["replaced"]
    assert index.search("p", vecs[2], k=3, min_similarity=0.99) == []


def test_small_partition_compacts_after_churn() -> None:
    rng = np.random.default_rng(2)
    index = VectorIndex(brute_force_max=1000)
    for round_ in range(50):
        for i, v in enumerate(unit(rng, 4)):
            index.add("p", f"id{i}", v, f"r{round_}")
    part = index._parts["p"]
    assert len(index) == 4 and part.matrix is not None and part.matrix.shape[0] <= 16
    with pytest.raises(ValueError):
        index.add("p", "bad", np.ones(7, dtype=np.float32), "wrong dim")


def test_bulk_add_builds_one_graph_and_matches_single_adds() -> None:
    rng = np.random.default_rng(3)
    vecs = unit(rng, 500)
    ids = [f"id{i}" for i in range(500)]
    index = VectorIndex(brute_force_max=64)
    index.add_many("p", ids, vecs, [f"q{i}" for i in range(500)])
    assert len(index) == 500 and index._parts["p"].graph is not None
    for i in range(0, 500, 25):
        assert index.search("p", vecs[i], k=1, min_similarity=0.99)[0].id == ids[i]
    index.add_many("p", ["id0", "new"], vecs[:2], ["again", "new"])  # existing partition: one by one
    assert len(index) == 501


async def test_cache_with_remote_embedder_from_settings() -> None:
    from semantic_cache import CachedAnswer, SemanticCache, SemanticCacheSettings, cache_request

    hashing = HashEmbedder(dim=32)

    def handler(request: httpx.Request) -> httpx.Response:
        texts = json.loads(request.content)["input"]
        vecs = hashing.encode(texts)
        return httpx.Response(200, json={"data": [{"index": i, "embedding": v.tolist()} for i, v in enumerate(vecs)]})

    s = SemanticCacheSettings(enabled=True, embedder="remote", embedding_url="http://embed.test/v1/embeddings",
                              threshold=0.5)
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        cache = await SemanticCache.open(s, None, http_client=client)
        try:
            def req(q: str):  # type: ignore[no-untyped-def]
                return cache_request("chat", "t", {"model": "m", "messages": [{"role": "user", "content": q}]},
                                     {}, settings=s)

            assert await cache.store(req("How do I learn Python fast?"), CachedAnswer("Practice.", "stop", "m"))
            hit = await cache.lookup(req("how do I learn python fast"))
            assert (hit.status, hit.tier) == ("hit", "semantic")
            assert cache.stats()["embedder"] == "remote:all-MiniLM-L6-v2"
        finally:
            await cache.aclose()


async def test_cache_starts_before_the_model_is_loaded() -> None:
    """Start-up never waits for the model: the exact tier works at once, the semantic tier after."""
    from semantic_cache import CachedAnswer, SemanticCache, SemanticCacheSettings, cache_request

    gate = threading.Event()
    hashing = HashEmbedder(dim=32)

    class GatedModel:
        def __init__(self) -> None:
            gate.wait(5)

        def encode(self, texts: list[str], **_: object) -> np.ndarray:
            return hashing.encode(texts)

    s = SemanticCacheSettings(enabled=True, threshold=0.5)
    emb = LocalEmbedder(loader=GatedModel, threads=None)
    cache = await SemanticCache.open(s, None, embedder=emb)

    def req(q: str):  # type: ignore[no-untyped-def]
        return cache_request("chat", "t", {"model": "m", "messages": [{"role": "user", "content": q}]}, {},
                             settings=s)

    try:
        assert not cache.stats()["embedder_ready"]
        assert await cache.store(req("How do I learn Python fast?"), CachedAnswer("Practice.", "stop", "m"))
        assert (await cache.lookup(req("How do I learn Python fast?"))).tier == "exact"
        assert cache.stats()["indexed_vectors"] == 0  # stored for the exact tier only
        gate.set()
        assert await cache.wait_ready(5)
        assert await cache.store(req("How do I learn Go fast?"), CachedAnswer("Practice.", "stop", "m"))
        assert (await cache.lookup(req("how do I learn go fast"))).tier == "semantic"
    finally:
        gate.set()
        await cache.aclose()
        await emb.aclose()


async def test_a_lookup_that_gives_up_on_a_slow_model_hands_its_embedding_to_the_store() -> None:
    """The lookup's bound protects the first token; the store then reuses the embedding the
    model finished meanwhile instead of queueing the same text a second time."""
    from semantic_cache import CachedAnswer, SemanticCache, SemanticCacheSettings, cache_request

    hashing = HashEmbedder(dim=32)

    class SlowModel:  # the model is the outside edge: a slow CPU, not our code
        def encode(self, texts: list[str], **_: object) -> np.ndarray:
            time.sleep(0.3)
            return hashing.encode(texts)

    s = SemanticCacheSettings(enabled=True, threshold=0.5, embed_timeout_s=0.1)
    emb = LocalEmbedder(loader=SlowModel, threads=None)
    cache = await SemanticCache.open(s, None, embedder=emb)

    def req(q: str):  # type: ignore[no-untyped-def]
        return cache_request("chat", "t", {"model": "m", "messages": [{"role": "user", "content": q}]}, {},
                             settings=s)

    try:
        assert await cache.wait_ready(5)
        assert await cache.store(req("How do I learn Python fast?"), CachedAnswer("Practice.", "stop", "m"))
        texts = emb.batcher.texts
        lookup = await cache.lookup(req("How do I learn Go fast?"))  # a partition with vectors: embeds
        assert (lookup.status, lookup.reason) == ("miss", "embedder_timeout")
        assert await cache.store(req("How do I learn Go fast?"), CachedAnswer("Practice.", "stop", "m"),
                                 lookup.embedding)
        assert emb.batcher.texts - texts == 1
        assert cache.stats()["indexed_vectors"] == 2
    finally:
        await cache.aclose()
        await emb.aclose()
