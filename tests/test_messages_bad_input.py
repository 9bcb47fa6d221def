"""Bad input on /v1/messages and /v1/messages/count_tokens: a 4xx in Anthropic's shape, never a 500."""

from __future__ import annotations

from typing import Any, Iterator

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.stack import MODEL, Stack, start_stack

OK = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    s = start_stack(1, limits={"max_body_bytes": 64 * 1024})
    yield s
    s.close()


@pytest.fixture(scope="module")
def http(stack: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.url, timeout=10) as c:
        yield c


def _anthropic_error(r: httpx.Response, kind: str = "invalid_request_error") -> str:
    body = r.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == kind, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert r.headers["request-id"]
    return body["error"]["message"]  # type: ignore[no-any-return]


def _with(**changes: Any) -> dict[str, Any]:
    body = {**OK, **changes}
    return {k: v for k, v in body.items() if v is not _DROP}


_DROP = object()
BAD_BODIES: list[tuple[str, dict[str, Any]]] = [
    ("model", _with(model=_DROP)), ("model", _with(model="")), ("model", _with(model=7)),
    ("max_tokens", _with(max_tokens=_DROP)), ("max_tokens", _with(max_tokens=0)),
    ("max_tokens", _with(max_tokens="10")), ("max_tokens", _with(max_tokens=True)),
    ("messages", _with(messages=_DROP)), ("messages", _with(messages=[])), ("messages", _with(messages="hi")),
    ("messages.0", _with(messages=[1])), ("role", _with(messages=[{"role": "robot", "content": "hi"}])),
    ("content", _with(messages=[{"role": "user"}])), ("content", _with(messages=[{"role": "user", "content": 5}])),
    ("content.0", _with(messages=[{"role": "user", "content": [{"text": "no type"}]}])),
    ("text", _with(messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}])),
    ("system", _with(system=5)), ("system.0", _with(system=[{"type": 5}])),
    ("tools", _with(tools={})), ("tools.0", _with(tools=[{"description": "no name"}])),
    ("input_schema", _with(tools=[{"name": "f", "input_schema": "object"}])),
    ("tool_choice", _with(tool_choice="auto")), ("stream", _with(stream="yes")),
    ("temperature", _with(temperature=3)), ("temperature", _with(temperature="hot")),
    ("top_p", _with(top_p=2)), ("stop_sequences", _with(stop_sequences="END")), ("metadata", _with(metadata=[])),
]


@pytest.mark.parametrize(("param", "body"), BAD_BODIES, ids=[f"{i}-{p}" for i, (p, _) in enumerate(BAD_BODIES)])
def test_kvgate_refuses_a_malformed_body_itself(stack: Stack, http: httpx.Client, param: str,
                                                body: dict[str, Any]) -> None:
    before = int(stack.sim_stats("r1")["requests"])
    r = http.post("/v1/messages", json=body)
    assert r.status_code == 400
    assert param.split(".")[0] in _anthropic_error(r) or param in _anthropic_error(r)
    assert int(stack.sim_stats("r1")["requests"]) == before, "a malformed body is never forwarded"


@pytest.mark.parametrize("raw", [b"", b"{", b"[]", b'"hi"', b"{" * 100 + b"}" * 100, b"\xff\xfe"])
def test_a_body_that_is_not_a_json_object_is_a_400(http: httpx.Client, raw: bytes) -> None:
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        r = http.post(path, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, (path, raw, r.text)
        _anthropic_error(r)


def test_wrong_content_type_version_header_size_route_and_method(http: httpx.Client) -> None:
    r = http.post("/v1/messages", content=b"model=x", headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 400 and "Content-Type" in _anthropic_error(r)
    r = http.post("/v1/messages", json=OK, headers={"anthropic-version": "2023 06 01; drop"})
    assert r.status_code == 400 and "anthropic-version" in _anthropic_error(r)
    r = http.post("/v1/messages", json=_with(system="x" * 70_000))
    assert r.status_code == 413 and _anthropic_error(r, "request_too_large")
    r = http.post("/v1/messages/batches", json=OK)
    assert r.status_code == 404 and _anthropic_error(r, "not_found_error")
    r = http.get("/v1/messages")
    assert r.status_code == 405 and _anthropic_error(r)
    # The OpenAI routes keep OpenAI's shape.
    r = http.post("/v1/chat/completions", json={"model": MODEL})
    assert r.status_code == 400 and set(r.json()) == {"error"}


def test_what_only_the_replica_can_judge_comes_back_in_anthropic_shape(http: httpx.Client) -> None:
    # The simulator's context is 8192 tokens: kvgate cannot know that, the replica refuses.
    r = http.post("/v1/messages", json=_with(max_tokens=100_000))
    assert r.status_code == 400 and "max_tokens" in _anthropic_error(r)
    # A block type vLLM's models do not know: the replica's pydantic error (OpenAI-shaped there).
    r = http.post("/v1/messages", json=_with(messages=[{"role": "user", "content": [{"type": "video"}]}]))
    assert r.status_code == 400 and _anthropic_error(r)
    r = http.post("/v1/messages/count_tokens", json={"model": MODEL, "messages": [{"role": "user"}]})
    assert r.status_code == 400 and "content" in _anthropic_error(r)
    r = http.post("/v1/messages/count_tokens", json={"model": "nope", "messages": OK["messages"]})
    assert r.status_code == 404 and _anthropic_error(r, "not_found_error")


_scalar = (st.none() | st.booleans() | st.integers(-3, 10**7) | st.floats(allow_nan=False, allow_infinity=False)
           | st.text(max_size=8))
_json = st.recursive(_scalar, lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=12)
_field = st.sampled_from(["model", "max_tokens", "messages", "system", "tools", "tool_choice", "stream", "temperature",
                          "top_k", "stop_sequences", "metadata", "thinking", "cache_salt"])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(changes=st.dictionaries(_field, _json, min_size=1, max_size=3), count=st.booleans())
def test_no_body_is_ever_a_500(http: httpx.Client, changes: dict[str, Any], count: bool) -> None:
    r = http.post("/v1/messages/count_tokens" if count else "/v1/messages", json={**OK, **changes})
    assert r.status_code < 500, r.text
    if r.status_code != 200:
        _anthropic_error(r, {400: "invalid_request_error", 404: "not_found_error"}[r.status_code])
