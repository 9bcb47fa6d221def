"""When a stored answer becomes servable, and what readiness says while it cannot be.

Through a real kvgate on loopback with the openai SDK and the real MiniLM model:
an identical request sent the moment the first answer completes is an exact hit
(the exact-tier write happens before the final bytes); a paraphrase in a context
seen for the first time is a semantic hit once its embedding is indexed, and no
request's text is embedded twice. ``/readyz`` names a model that is still
loading or failed to load; ``/admin/cache`` says when the semantic tier became
ready. The slow start is real: the packaged loader, behind a gate.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from typing import Any, Callable, Iterator

import httpx
import openai
import pytest

from tests.support.minilm import shared_minilm
from tests.support.redis_server import PrivateRedis
from tests.support.stack import MODEL, Stack, start_stack

TOKEN = "admin-secret"


def _cache(**kw: Any) -> dict[str, Any]:
    return {"enabled": True, "embedder": "local", "key_prefix": f"kvgate:test:{uuid.uuid4().hex[:8]}:", **kw}


def _ready(stack: Stack) -> None:
    assert stack.runtime.cache is not None
    assert _on_loop(stack, stack.runtime.cache.wait_ready(60), timeout=90)


def _on_loop(stack: Stack, coro: Any, timeout: float = 30) -> Any:
    """Run a coroutine on the gateway's own event loop (where the cache lives) and wait."""
    assert stack.gateway.loop is not None
    return asyncio.run_coroutine_threadsafe(coro, stack.gateway.loop).result(timeout)


@pytest.fixture(scope="module", params=["memory", "redis"])
def stack(request: pytest.FixtureRequest) -> Iterator[Stack]:
    extra = {"redis_url": request.getfixturevalue("redis_service")} if request.param == "redis" else {}
    s = start_stack(1, semantic_cache=_cache(), **extra)
    _ready(s)
    yield s
    s.close()


@pytest.fixture(scope="module", params=["memory", "redis"])
def slow_bounds(request: pytest.FixtureRequest) -> Iterator[Stack]:
    extra = {"redis_url": request.getfixturevalue("redis_service")} if request.param == "redis" else {}
    s = start_stack(1, semantic_cache=_cache(embed_timeout_s=30, store_wait_ms=30_000), **extra)
    _ready(s)
    yield s
    s.close()


PAIRS = [("How do I update the router firmware?", "How can I update the router firmware?"),
         ("How do I reset my router password?", "how can I reset my router password"),
         ("How do I change the Wi-Fi password on the router?", "How can I change the Wi-Fi password on the router?")]


def _messages(system: str, question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def _send(client: openai.OpenAI, system: str, question: str, stream: bool) -> tuple[Any, str]:
    """(the response headers, the answer's text), the stream read to its end as the SDK does."""
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=_messages(system, question),
                                                            stream=stream)
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
    else:
        text = raw.parse().choices[0].message.content or ""
    return raw.headers, text


def _ask(client: openai.OpenAI, system: str, question: str, stream: bool = False) -> tuple[str, str]:
    headers, text = _send(client, system, question, stream)
    return headers["x-kvgate-cache"], text


def _semantic_hit(client: openai.OpenAI, system: str, question: str) -> bool:
    headers, _ = _send(client, system, question, False)
    return bool(headers["x-kvgate-cache"] == "hit" and float(headers["x-kvgate-cache-similarity"]) < 1)


@pytest.mark.parametrize("stream", [False, True])
def test_an_identical_request_sent_right_after_the_answer_is_a_hit(stack: Stack, stream: bool) -> None:
    client = openai.OpenAI(base_url=stack.base_url, api_key="x", max_retries=0)
    for i in range(5):
        # A context seen for the first time, then one already cached: both must hit at once.
        system = f"You answer questions about router {uuid.uuid4().hex[:8]}."
        for question in (f"How do I reset router number {i}?", f"Which ports does router {i} have?"):
            status, answer = _ask(client, system, question, stream)
            assert status == "miss" and answer
            assert _ask(client, system, question, stream) == ("hit", answer)


def test_a_paraphrase_sent_right_after_a_new_contexts_first_answer_is_served(slow_bounds: Stack) -> None:
    """No wait at all: the first answer's vector may still be on its way; the paraphrase's
    lookup waits for it (bounds raised so that a loaded machine cannot turn it into a miss)."""
    client = openai.OpenAI(base_url=slow_bounds.base_url, api_key="x", max_retries=0)
    for i, (question, paraphrase) in enumerate(PAIRS):
        system = f"You answer questions about router {uuid.uuid4().hex[:8]} model {i}."
        for stream in (False, True):
            assert _ask(client, system, question, stream)[0] == "miss"
            assert _semantic_hit(client, system, paraphrase)
            system += " Again."  # the next round in a new context too


def test_a_paraphrase_in_a_new_context_is_served_once_its_embedding_is_ready(stack: Stack) -> None:
    client = openai.OpenAI(base_url=stack.base_url, api_key="x", max_retries=0)
    cache = stack.runtime.cache
    assert cache is not None

    def embedded() -> int:
        return int(cache.stats()["embedded_texts"])

    system = f"You answer questions about our router {uuid.uuid4().hex[:8]}."
    before = embedded()
    assert _ask(client, system, "How do I update the router firmware?")[0] == "miss"
    _on_loop(stack, cache.settled())  # the answer's vector is written and indexed
    assert embedded() - before == 1, "the lookup's embedding is the one stored"
    assert _semantic_hit(client, system, "How can I update the router firmware?")
    # A miss in a context already cached: the lookup embeds the query, the store reuses it.
    before = embedded()
    assert _ask(client, system, "How do I change the Wi-Fi password on the router?")[0] == "miss"
    _on_loop(stack, cache.settled())
    assert embedded() - before == 1
    assert _semantic_hit(client, system, "How can I change the Wi-Fi password on the router?")


def _gated(gate: threading.Event, load: Callable[[], Any]) -> Callable[[], Any]:
    def loader() -> Any:
        assert gate.wait(60), "the test never released the model"
        return load()
    return loader


def _degraded(stack: Stack) -> list[str]:
    resp = httpx.get(stack.url + "/readyz", timeout=5)
    assert resp.status_code == 200  # serving works (exact tier, upstream): only degraded
    return [d for d in resp.json()["degraded"] if d.startswith("semantic cache")]


def _admin_cache(stack: Stack) -> dict[str, Any]:
    assert stack.admin is not None
    return httpx.get(stack.admin.url + "/admin/cache", headers={"authorization": f"Bearer {TOKEN}"},
                     timeout=5).json()  # type: ignore[no-any-return]


def test_readyz_says_the_model_is_loading_until_the_semantic_tier_can_serve() -> None:
    gate = threading.Event()
    stack = start_stack(1, semantic_cache=_cache(), admin_token=TOKEN, embedding_loader=_gated(gate, shared_minilm))
    try:
        assert _degraded(stack) == ["semantic cache: embedding model loading"]
        stats = _admin_cache(stack)
        assert stats["embedder_ready"] is False and stats["ready_at"] is None
        client = openai.OpenAI(base_url=stack.base_url, api_key="x", max_retries=0)
        system = f"You answer questions about router {uuid.uuid4().hex[:8]}."
        assert _ask(client, system, "How do I reset my router?")[0] == "miss"  # served meanwhile
        released = time.time()
        gate.set()
        assert stack.wait_for(lambda: _degraded(stack) == [], timeout=90, interval=0.1)
        stats = _admin_cache(stack)
        assert stats["embedder_ready"] is True and stats["embedder_error"] is None
        assert stats["ready_at"] >= released and stats["ready_after_s"] > 0
    finally:
        gate.set()
        stack.close()


def test_readyz_names_the_model_load_error() -> None:
    def broken() -> Any:
        raise RuntimeError("model files missing")

    stack = start_stack(1, semantic_cache=_cache(), admin_token=TOKEN, embedding_loader=broken)
    try:
        assert stack.wait_for(lambda: _degraded(stack) != ["semantic cache: embedding model loading"], timeout=30)
        (line,) = _degraded(stack)
        assert line.startswith("semantic cache: embedding model failed to load, exact tier only: ")
        assert "model files missing" in line
        stats = _admin_cache(stack)
        assert stats["ready_at"] is None and "model files missing" in stats["embedder_error"]
    finally:
        stack.close()


@pytest.mark.parametrize("stream", [False, True])
def test_a_hung_redis_holds_the_answer_back_at_most_store_wait_ms(private_redis: PrivateRedis,
                                                                  stream: bool) -> None:
    """The final bytes wait for the exact-tier write only up to store_wait_ms: with Redis
    paused, a request costs its lookup's timeout (1 s) and not a second one for the store."""
    stack = start_stack(1, redis_url=private_redis.url, redis_timeout_s=1.0,
                        semantic_cache=_cache(embedder="hash", store_wait_ms=50, breaker_failures=10))
    try:
        client = openai.OpenAI(base_url=stack.base_url, api_key="x", max_retries=0)
        assert _ask(client, "You answer briefly.", "Is Redis up?", stream)[0] == "miss"
        with private_redis.paused():
            started = time.monotonic()
            status, answer = _ask(client, "You answer briefly.", "Is Redis paused?", stream)
            elapsed = time.monotonic() - started
        assert status == "miss" and answer
        assert 1.0 <= elapsed < 1.8, elapsed  # lookup timeout + upstream, not + a store timeout
    finally:
        stack.close()
