"""Replayed answers parse with the real OpenAI SDK (a MockTransport at the outside edge)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from semantic_cache import CachedAnswer, completion_body, sse_events
from semantic_cache.replay import split_text

ANSWER = CachedAnswer(content="Paris is the capital of France.\n\nIt has 2.1 million people.",
                      finish_reason="stop", model="m1", prompt_tokens=12, completion_tokens=15,
                      created=1_700_000_000)


def sdk(body: bytes, content_type: str) -> openai.OpenAI:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body, headers={"content-type": content_type})

    return openai.OpenAI(api_key="test", base_url="http://kvgate.test/v1", max_retries=0,
                         http_client=httpx.Client(transport=httpx.MockTransport(handler)))


def stream_bytes(answer: CachedAnswer, endpoint: str, include_usage: bool) -> bytes:
    return b"".join(sse_events(answer, request_id="chatcmpl-1", model="m1", endpoint=endpoint,
                               include_usage=include_usage))


def test_split_text_is_lossless() -> None:
    for text in ["", " lead", "a b  c\n\nd ", "x" * 10, " ".join(["w"] * 1000)]:
        pieces = split_text(text)
        assert "".join(pieces) == text and len(pieces) <= 128


def test_chat_body_parses_with_sdk() -> None:
    body = completion_body(ANSWER, request_id="chatcmpl-1", model="m1", endpoint="chat")
    client = sdk(json.dumps(body).encode(), "application/json")
    resp = client.chat.completions.create(model="m1", messages=[{"role": "user", "content": "hi"}])
    assert resp.choices[0].message.content == ANSWER.content
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage is not None and resp.usage.total_tokens == 27
    assert resp.usage.prompt_tokens_details is not None
    assert resp.usage.prompt_tokens_details.cached_tokens == 12


def test_completion_body_parses_with_sdk() -> None:
    body = completion_body(ANSWER, request_id="cmpl-1", model="m1", endpoint="completions")
    resp = sdk(json.dumps(body).encode(), "application/json").completions.create(model="m1", prompt="x")
    assert resp.object == "text_completion" and resp.choices[0].text == ANSWER.content


@pytest.mark.parametrize("include_usage", [True, False])
def test_chat_stream_parses_with_sdk(include_usage: bool) -> None:
    raw = stream_bytes(ANSWER, "chat", include_usage)
    client = sdk(raw, "text/event-stream")
    kwargs = {"stream_options": {"include_usage": True}} if include_usage else {}
    chunks = list(client.chat.completions.create(model="m1", messages=[{"role": "user", "content": "hi"}],
                                                 stream=True, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    content_chunks = [c for c in chunks if c.choices]
    assert len(content_chunks) > 3  # streamed in pieces, not one blob
    assert "".join(c.choices[0].delta.content or "" for c in content_chunks) == ANSWER.content
    finishes = [c.choices[0].finish_reason for c in content_chunks]
    assert finishes[-1] == "stop" and all(f is None for f in finishes[:-1])
    usage_chunks = [c for c in chunks if c.usage is not None]
    if include_usage:
        assert len(usage_chunks) == 1 and chunks[-1].choices == [] and chunks[-1].usage is not None
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 12
        assert all(b'"usage":null' in e for e in raw.split(b"\n\n") if b'"choices":[{' in e)
    else:
        assert not usage_chunks and b'"usage"' not in raw
    assert raw.endswith(b"data: [DONE]\n\n")


def test_completions_stream_parses_with_sdk() -> None:
    raw = stream_bytes(ANSWER, "completions", True)
    chunks = list(sdk(raw, "text/event-stream").completions.create(
        model="m1", prompt="x", stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ANSWER.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 15


def test_tool_call_answer_replays() -> None:
    answer = CachedAnswer(content="", finish_reason="tool_calls", model="m1", tool_calls=[
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}])
    chunks = list(sdk(stream_bytes(answer, "chat", False), "text/event-stream").chat.completions.create(
        model="m1", messages=[{"role": "user", "content": "hi"}], stream=True))
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert calls[0].function.name == "get_weather" and chunks[-1].choices[0].finish_reason == "tool_calls"
    body = completion_body(answer, request_id="x", model="m1", endpoint="chat")
    assert body["choices"][0]["message"]["tool_calls"][0]["id"] == "call_1"
