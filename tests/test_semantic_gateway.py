"""The semantic cache through kvgate: hits, SSE replay in the real SDK, isolation, faults, sharing."""

from __future__ import annotations

import time
import uuid
from typing import Any, Iterator

import httpx
import openai
import pytest

from gateway.app import build_app
from gateway.settings import load_settings
from tests.support.redis_server import PrivateRedis
from tests.support.servers import ServerThread
from tests.support.stack import MODEL, Stack, start_stack

SYSTEM = {"role": "system", "content": "You answer questions about our router product."}


def _cache(embedder: str = "hash", **kw: Any) -> dict[str, Any]:
    return {"enabled": True, "embedder": embedder, "key_prefix": f"kvgate:test:{uuid.uuid4().hex[:8]}:", **kw}


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    s = start_stack(1, semantic_cache=_cache(), tenants=[{"name": "a", "api_keys": ["sk-a"]},
                                                          {"name": "b", "api_keys": ["sk-b"]}])
    yield s
    s.close()


def _ask(client: openai.OpenAI, question: str, system: dict[str, str] = SYSTEM, **kw: Any) -> Any:
    return client.chat.completions.with_raw_response.create(
        model=kw.pop("model", MODEL), messages=[system, *kw.pop("history", []), {"role": "user", "content": question}],
        **kw)


def _engine_requests(stack: Stack) -> int:
    return int(stack.sim_stats("r1")["engine_requests"])


def test_repeat_is_a_hit_and_never_reaches_the_replica(stack: Stack) -> None:
    a = openai.OpenAI(base_url=stack.base_url, api_key="sk-a", max_retries=0)
    q = f"How do I reset the router {uuid.uuid4().hex[:6]}?"
    first = _ask(a, q)
    assert first.headers["x-kvgate-cache"] == "miss"
    answer = first.parse().choices[0].message.content
    assert stack.wait_for(lambda: _ask(a, q).headers["x-kvgate-cache"] == "hit", timeout=2)
    before = _engine_requests(stack)
    again = _ask(a, q)
    assert again.headers["x-kvgate-cache"] == "hit" and again.headers["x-kvgate-replica"] == "cache"
    assert again.parse().choices[0].message.content == answer
    assert float(again.headers["x-kvgate-cache-similarity"]) == pytest.approx(1.0)
    assert _engine_requests(stack) == before


def test_streamed_replay_parses_in_the_sdk(stack: Stack) -> None:
    a = openai.OpenAI(base_url=stack.base_url, api_key="sk-a", max_retries=0)
    q = f"Which ports does model {uuid.uuid4().hex[:6]} have?"
    text = _ask(a, q).parse().choices[0].message.content
    assert stack.wait_for(lambda: _ask(a, q).headers["x-kvgate-cache"] == "hit", timeout=2)
    for include_usage in (False, True):
        before = _engine_requests(stack)
        raw = a.chat.completions.with_raw_response.create(
            model=MODEL, stream=True, messages=[SYSTEM, {"role": "user", "content": q}],
            stream_options={"include_usage": include_usage})
        # The simulator would stream the same text: only the header and the replica's count
        # show that the cache, not r1, answered.
        assert raw.headers["x-kvgate-cache"] == "hit" and raw.headers["x-kvgate-replica"] == "cache"
        chunks = list(raw.parse())
        assert len([c for c in chunks if c.choices]) > 2, "replayed as several chunks"
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
        assert (chunks[-1].usage is not None) == include_usage
        assert _engine_requests(stack) == before


def test_never_served_across_tenant_model_system_or_history(stack: Stack) -> None:
    a = openai.OpenAI(base_url=stack.base_url, api_key="sk-a", max_retries=0)
    b = openai.OpenAI(base_url=stack.base_url, api_key="sk-b", max_retries=0)
    q = f"What is the warranty period {uuid.uuid4().hex[:6]}?"
    _ask(a, q)
    assert stack.wait_for(lambda: _ask(a, q).headers["x-kvgate-cache"] == "hit", timeout=2)
    assert _ask(b, q).headers["x-kvgate-cache"] == "miss"
    other_system = {"role": "system", "content": "You answer questions about our toaster product."}
    assert _ask(a, q, system=other_system).headers["x-kvgate-cache"] == "miss"
    history = [{"role": "user", "content": "I bought it in 2019."}, {"role": "assistant", "content": "Noted."}]
    assert _ask(a, q, history=history).headers["x-kvgate-cache"] == "miss"
    assert _ask(a, q, temperature=1.5).headers["x-kvgate-cache"] == "miss"
    assert _ask(a, q, extra_headers={"cache-control": "no-store"}).headers["x-kvgate-cache"] == "bypass"


def test_a_partial_answer_is_never_stored(stack: Stack) -> None:
    a = openai.OpenAI(base_url=stack.base_url, api_key="sk-a", max_retries=0)
    q = f"Explain mesh networking {uuid.uuid4().hex[:6]}"
    stack.faults("r1", die_after_tokens=3)
    try:
        with pytest.raises(openai.APIError):
            list(a.chat.completions.create(model=MODEL, stream=True, max_tokens=30,
                                           messages=[SYSTEM, {"role": "user", "content": q}]))
    finally:
        stack.faults("r1")
    time.sleep(0.3)
    assert _ask(a, q, max_tokens=30).headers["x-kvgate-cache"] == "miss"


def test_redis_killed_mid_run_keeps_serving(private_redis: PrivateRedis) -> None:
    stack = start_stack(1, redis_url=private_redis.url, semantic_cache=_cache())
    try:
        client = openai.OpenAI(base_url=stack.base_url, api_key="x", max_retries=0)
        assert _ask(client, "first question?").parse().choices[0].message.content
        private_redis.stop()
        for i in range(5):
            t = time.monotonic()
            resp = _ask(client, f"question {i} after redis died?")
            assert resp.parse().choices[0].message.content
            assert time.monotonic() - t < 2.0
        ready = httpx.get(stack.url + "/readyz", timeout=5).json()
        assert any("semantic cache" in d or "rate_limits" in d for d in ready["degraded"])
    finally:
        stack.close()


def test_two_instances_share_an_entry(redis_service: str) -> None:
    cache = _cache()
    stack = start_stack(1, redis_url=redis_service, semantic_cache=cache)
    second = ServerThread(build_app(load_settings(environ={}, overrides={
        "redis_url": redis_service, "semantic_cache": cache,
        "replicas": [{"name": "r1", "url": stack.sim_url("r1")}]}))).start()
    try:
        one = openai.OpenAI(base_url=stack.base_url, api_key="x", max_retries=0)
        two = openai.OpenAI(base_url=second.url + "/v1", api_key="x", max_retries=0)
        q = f"Does the router support IPv6 {uuid.uuid4().hex[:6]}?"
        answer = _ask(one, q).parse().choices[0].message.content
        t = time.monotonic()
        assert stack.wait_for(lambda: _ask(two, q).headers["x-kvgate-cache"] == "hit", timeout=1.5)
        assert time.monotonic() - t < 1.5
        assert _ask(two, q).parse().choices[0].message.content == answer
    finally:
        second.stop()
        stack.close()


def test_paraphrase_hits_with_the_real_embedder() -> None:
    stack = start_stack(1, semantic_cache=_cache("local"))
    try:
        client = openai.OpenAI(base_url=stack.base_url, api_key="x", max_retries=0)
        _ask(client, "How can I reset my router to factory settings?")
        assert stack.wait_for(lambda: _ask(client, "How do I factory reset my router?").headers[
            "x-kvgate-cache"] == "hit", timeout=30, interval=0.2)
        trap = _ask(client, "How can I not reset my router to factory settings?")
        assert trap.headers["x-kvgate-cache"] == "miss"
    finally:
        stack.close()
