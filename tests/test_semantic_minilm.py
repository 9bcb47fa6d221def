"""The real all-MiniLM-L6-v2 (loaded offline from its package) through the whole cache."""

from __future__ import annotations

from typing import Any

import pytest

from semantic_cache import CachedAnswer, LocalEmbedder, SemanticCache, SemanticCacheSettings, cache_request

S = SemanticCacheSettings(enabled=True)  # production defaults: threshold, verifier
ANSWER = CachedAnswer("Hold the reset button for 10 seconds.", "stop", "m1", 12, 9, 1)


def req(question: str):
    body = {"model": "m1", "messages": [{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": question}]}
    return cache_request("chat", "t1", body, {}, settings=S)


@pytest.mark.anyio
async def test_paraphrase_hits_and_traps_miss(minilm: Any) -> None:
    embedder = LocalEmbedder(loader=lambda: minilm)
    cache = await SemanticCache.open(S, None, embedder=embedder)
    try:
        assert await cache.wait_ready(30)
        pairs = [
            ("How do I reset my router password?", "how can I reset my router password", None),
            ("What are some tips for learning French?", "What are tips to learn French?", None),
            ("Is it safe to eat raw eggs?", "Is it not safe to eat raw eggs?", "verifier:negation"),
            ("Flights from Paris to Rome", "Flights from Rome to Paris", "verifier:word_order"),
            ("How many calories are in 2 eggs?", "How many calories are in 3 eggs?", "below_threshold"),
        ]
        for stored, asked, miss_reason in pairs:
            assert await cache.store(req(stored), ANSWER)
            result = await cache.lookup(req(asked))
            if miss_reason is None:
                assert (result.status, result.tier) == ("hit", "semantic"), (asked, result)
                assert result.similarity is not None and result.similarity >= S.threshold
            else:
                assert result.status == "miss" and result.reason == miss_reason, (asked, result)
        stats = cache.stats()
        assert stats["embedder"] == "all-MiniLM-L6-v2" and stats["embedder_ready"]
    finally:
        await cache.aclose()
        await embedder.aclose()


@pytest.mark.anyio
async def test_minilm_vectors_are_unit_and_batched(minilm: Any) -> None:
    emb = LocalEmbedder(loader=lambda: minilm, batch_max=8)
    try:
        await emb.start()
        import asyncio

        out = await asyncio.gather(*[emb.embed([f"question number {i}"]) for i in range(12)])
        assert all(o.shape == (1, 384) for o in out)
        assert emb.batcher.batches < 12  # concurrent calls shared forward passes
    finally:
        await emb.aclose()


@pytest.mark.parametrize("backend", ["_onnx_backend", "_traced_backend"])
def test_fast_encoders_give_encodes_vectors(minilm: Any, backend: str) -> None:
    """Each fast path must be an optimisation only: same vectors, any length, padded batches."""
    from semantic_cache import fast_encode

    fast = getattr(fast_encode, backend)(minilm, 1)
    assert fast is not None
    texts = ["hi", "how can i reset my router password",
             "a longer question, with punctuation and numbers like 1998, that needs padding in a batch"]
    want = minilm.encode(texts, normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False)
    got = fast(texts)
    assert got.shape == want.shape
    assert abs(got - want).max() < 1e-5
    for text, row in zip(texts, want):  # one at a time, as the idle hot path calls it
        assert abs(fast([text])[0] - row).max() < 1e-5


def test_fast_encoders_decline_other_models() -> None:
    from semantic_cache import fast_encode

    class Fake:
        def encode(self, texts: list[str], **_: Any) -> Any:
            raise AssertionError("not called")

    assert fast_encode.build(Fake()) is None  # the embedder keeps model.encode
