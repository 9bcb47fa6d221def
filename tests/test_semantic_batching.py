"""Batching (``semantic_cache.batching``): concurrent calls share batches, and each
caller still gets its own result.

The rules, with a blocking fake batch function: a lone call runs at once; calls
that arrive while a batch runs go together in the next; a caller that gave up is
dropped; a failure stays in its batch. Then the real all-MiniLM-L6-v2: a property
test that concurrent, batched embeddings are the vectors each text gets alone.
"""

from __future__ import annotations

import asyncio
from typing import Any, Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from semantic_cache.batching import Batcher
from semantic_cache.embedder import LocalEmbedder
from semantic_cache.normalize import embedding_text, query_text


class GatedRun:
    """A batch function that records each batch and holds it until released."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.gate = asyncio.Event()
        self.started = asyncio.Event()

    async def __call__(self, items: list[str]) -> list[Any]:
        self.batches.append(items)
        self.started.set()
        await self.gate.wait()
        return [ValueError(f"bad {x}") if x.startswith("bad") else x.upper() for x in items]


@pytest.mark.anyio
async def test_a_lone_call_runs_at_once_and_what_queues_meanwhile_goes_next() -> None:
    run = GatedRun()
    batcher: Batcher[str, str] = Batcher(run, max_batch=3)
    first = asyncio.create_task(batcher.submit("a"))
    await asyncio.wait_for(run.started.wait(), 5)
    assert run.batches == [["a"]]  # nothing waited to fill a batch
    rest = [asyncio.create_task(batcher.submit(x)) for x in "bcde"]
    await asyncio.sleep(0)
    assert run.batches == [["a"]] and batcher.queued == 4  # queued behind the running call
    run.gate.set()
    assert await first == "A"
    assert await asyncio.gather(*rest) == ["B", "C", "D", "E"]
    assert run.batches == [["a"], ["b", "c", "d"], ["e"]]  # at most max_batch per call
    assert (batcher.batches, batcher.items) == (3, 5)


@pytest.mark.anyio
async def test_a_caller_that_gave_up_is_dropped_from_the_next_batch() -> None:
    run = GatedRun()
    batcher: Batcher[str, str] = Batcher(run, max_batch=8)
    first = asyncio.create_task(batcher.submit("a"))
    await asyncio.wait_for(run.started.wait(), 5)
    gone = asyncio.create_task(batcher.submit("gone"))
    kept = asyncio.create_task(batcher.submit("kept"))
    await asyncio.sleep(0)
    gone.cancel()
    run.gate.set()
    assert (await first, await kept) == ("A", "KEPT")
    assert gone.cancelled() and run.batches == [["a"], ["kept"]]


@pytest.mark.anyio
async def test_an_item_error_fails_its_caller_and_a_batch_error_fails_only_its_batch() -> None:
    run = GatedRun()
    run.gate.set()
    batcher: Batcher[str, str] = Batcher(run, max_batch=8)
    ok, bad = await asyncio.gather(batcher.submit("ok"), batcher.submit("bad one"), return_exceptions=True)
    assert ok == "OK" and isinstance(bad, ValueError)
    assert run.batches == [["ok", "bad one"]]  # one call, two outcomes

    fail = True

    async def flaky(items: list[str]) -> list[str]:
        if fail:
            raise ConnectionError("down")
        return items

    flaky_batcher: Batcher[str, str] = Batcher(flaky, max_batch=8)
    results = await asyncio.gather(*[flaky_batcher.submit(x) for x in "xyz"], return_exceptions=True)
    assert all(isinstance(r, ConnectionError) for r in results)  # every caller of the batch told
    fail = False
    assert await flaky_batcher.submit("w") == "w"  # and the next batch runs


@pytest.mark.anyio
async def test_aclose_cancels_the_running_batch_and_the_queue() -> None:
    run = GatedRun()
    batcher: Batcher[str, str] = Batcher(run, max_batch=1)
    calls = [asyncio.create_task(batcher.submit(x)) for x in "ab"]
    await asyncio.wait_for(run.started.wait(), 5)
    await batcher.aclose()
    done = await asyncio.gather(*calls, return_exceptions=True)
    assert all(isinstance(d, asyncio.CancelledError) for d in done)


# ---- the real model ----


@pytest.fixture(scope="module")
def model_loop(minilm: Any) -> Iterator[tuple[asyncio.AbstractEventLoop, LocalEmbedder]]:
    """One loop and one started embedder for every example (starting is seconds, an example ms)."""
    loop = asyncio.new_event_loop()
    emb = LocalEmbedder(loader=lambda: minilm, batch_max=BATCH_MAX)
    loop.run_until_complete(emb.start())
    try:
        yield loop, emb
    finally:
        loop.run_until_complete(emb.aclose())
        loop.close()


BATCH_MAX = 4  # small, so that examples of a few texts already span several model calls
QUESTIONS = ["How do I reset my router password?", "why is the sky blue", "hi", "What's 2+2?",
             "a much longer question, with commas and numbers like 1998, that needs padding in a batch"]
# What the cache embeds: a normalised query, never empty (an empty message bypasses the cache).
texts = st.one_of(st.sampled_from(QUESTIONS), st.text(min_size=1, max_size=60)).map(
    lambda t: embedding_text(query_text(t)) or "?")


@settings(max_examples=20)
@given(st.lists(texts, min_size=2, max_size=9))
def test_concurrent_callers_each_get_the_vector_their_text_gets_alone(
        model_loop: tuple[asyncio.AbstractEventLoop, LocalEmbedder], batch: list[str]) -> None:
    loop, emb = model_loop

    async def check() -> None:
        calls0 = emb.batcher.batches
        together = await asyncio.gather(*[emb.embed([t]) for t in batch])
        batched_calls = emb.batcher.batches - calls0
        # Really batched: every caller queued before the first call ran, so one model call
        # per batch_max callers (fewer calls than callers).
        assert batched_calls == -(-len(batch) // BATCH_MAX) < len(batch)
        for text, got in zip(batch, together):
            calls0 = emb.batcher.batches
            alone = await emb.embed([text])  # nothing else queued: a model call of its own
            assert emb.batcher.batches - calls0 == 1
            assert got.shape == alone.shape == (1, 384)
            # Padding to the batch's longest text is masked out: the same vector, to float noise.
            np.testing.assert_allclose(got, alone, atol=1e-5)

    loop.run_until_complete(check())


def test_identical_texts_in_one_batch_share_one_encoding(
        model_loop: tuple[asyncio.AbstractEventLoop, LocalEmbedder]) -> None:
    loop, emb = model_loop

    async def check() -> None:
        texts0, calls0 = emb.batcher.texts, emb.batcher.batches
        same = BATCH_MAX - 1  # with "hi": one full batch
        out = await asyncio.gather(*[emb.embed(["why is the sky blue"]) for _ in range(same)], emb.embed(["hi"]))
        assert (emb.batcher.batches - calls0, emb.batcher.texts - texts0) == (1, 2)
        assert all(np.array_equal(o, out[0]) for o in out[:same]) and not np.array_equal(out[0], out[same])

    loop.run_until_complete(check())
