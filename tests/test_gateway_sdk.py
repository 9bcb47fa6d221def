"""The real OpenAI SDK, sync and async, against kvgate on a real port."""

from __future__ import annotations

from typing import Iterator

import openai
import pytest

from tests.support.stack import MODEL, Stack, start_stack

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    s = start_stack(2, tenants=[{"name": "acme", "api_keys": ["sk-acme-1"]}])
    yield s
    s.close()


@pytest.fixture
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="sk-acme-1", max_retries=0)


def test_models_list(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]


def test_chat_non_streaming(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=8)
    resp = raw.parse()
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage is not None and resp.usage.completion_tokens == 8
    assert raw.headers["x-kvgate-replica"] in ("r1", "r2")
    assert raw.headers["x-request-id"]


def test_chat_streaming_without_include_usage_hides_usage(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices for c in chunks), "the usage-only chunk kvgate injected must be stripped"
    assert all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text


def test_chat_streaming_with_include_usage(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    assert sum(1 for c in chunks if c.usage is not None) == 1


def test_completions_both_ways(client: openai.OpenAI) -> None:
    resp = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5)
    assert resp.choices[0].text and resp.usage and resp.usage.completion_tokens == 5
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices)
    assert all(c.usage is None for c in chunks)


def test_embeddings_pass_through(client: openai.OpenAI) -> None:
    resp = client.embeddings.create(model=MODEL, input=["a", "b"])
    assert len(resp.data) == 2 and len(resp.data[0].embedding) > 0


def test_bad_request_error_has_param_and_request_id(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=-1)
    assert e.value.body["param"] == "max_tokens"  # type: ignore[index]
    assert e.value.request_id


def test_authentication_error(stack: Stack) -> None:
    bad = openai.OpenAI(base_url=stack.base_url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert "sk-wrong" not in str(e.value)
    assert e.value.request_id


def test_not_found_error(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    assert e.value.body["param"] == "model"  # type: ignore[index]


def test_rate_limit_and_internal_errors(stack: Stack, client: openai.OpenAI) -> None:
    for name in stack.sims:
        stack.faults(name, rate_limit_rate=1.0)
    try:
        with pytest.raises(openai.RateLimitError) as e:
            client.chat.completions.create(model=MODEL, messages=MESSAGES)
        assert e.value.response.headers.get("retry-after")
    finally:
        for name in stack.sims:
            stack.faults(name, rate_limit_rate=0.0)
    for name in stack.sims:
        stack.faults(name, error_rate=1.0, error_status=500)
    try:
        with pytest.raises(openai.InternalServerError) as e2:
            client.chat.completions.create(model=MODEL, messages=MESSAGES)
        assert e2.value.request_id
    finally:
        for name in stack.sims:
            stack.faults(name, error_rate=0.0)


@pytest.mark.anyio
async def test_async_client_streams(stack: Stack) -> None:
    client = openai.AsyncOpenAI(base_url=stack.base_url, api_key="sk-acme-1", max_retries=0)
    resp = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
    assert resp.choices[0].message.content
    stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, stream=True,
                                                  stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert chunks[-1].usage is not None
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(model=MODEL, messages=[])
    await client.close()
