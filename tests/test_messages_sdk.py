"""/v1/messages through a real kvgate and vllm_sim, driven by the official ``anthropic`` SDK."""

from __future__ import annotations

import uuid
from typing import Any, Iterator

import anthropic
import httpx
import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from tests.support.servers import ServerThread
from tests.support.stack import MODEL, Stack, start_stack

SYSTEM = "You are the support agent of a company that sells routers. " * 30
TENANTS = [{"name": "a", "api_keys": ["sk-a"]}, {"name": "b", "api_keys": ["sk-b"]},
           {"name": "narrow", "api_keys": ["sk-narrow"], "models": ["other-model"]},
           {"name": "slow", "api_keys": ["sk-slow"], "requests_per_minute": 1}]


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    cache = {"enabled": True, "embedder": "hash", "key_prefix": f"kvgate:test:{uuid.uuid4().hex[:8]}:"}
    s = start_stack(1, tenants=TENANTS, semantic_cache=cache)
    yield s
    s.close()


def _client(stack: Stack, key: str = "sk-a") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=stack.url, api_key=key, max_retries=0)


def _ask(client: anthropic.Anthropic, system: str = SYSTEM, question: str = "Where is my order?",
         **kw: Any) -> Any:
    return client.messages.create(model=MODEL, max_tokens=kw.pop("max_tokens", 8), system=system,
                                  messages=[{"role": "user", "content": question}], **kw)


def test_create_then_the_same_prefix_is_read_from_the_replica_cache(stack: Stack) -> None:
    a = _client(stack)
    system = f"Account {uuid.uuid4().hex}. " + SYSTEM
    first = _ask(a, system)
    again = _ask(a, system, question="And my invoice?")
    assert first.type == "message" and first.role == "assistant" and first.content[0].type == "text"
    assert first.content[0].text and first.stop_reason == "max_tokens" and first.usage.output_tokens == 8
    assert first.usage.cache_read_input_tokens == 0 and first.usage.cache_creation_input_tokens > 0
    assert again.usage.cache_read_input_tokens > 200
    count = a.messages.count_tokens(model=MODEL, system=system,
                                    messages=[{"role": "user", "content": "And my invoice?"}])
    u = again.usage
    assert count.input_tokens == u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens
    assert first._request_id  # the SDK found kvgate's request id


def test_stream_relays_text_deltas_and_final_usage(stack: Stack) -> None:
    a = _client(stack)
    system = f"Account {uuid.uuid4().hex}. " + SYSTEM
    _ask(a, system)
    with a.messages.stream(model=MODEL, max_tokens=12, system=system,
                           messages=[{"role": "user", "content": "Tell me more."}]) as stream:
        deltas = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(deltas) == 12 and "".join(deltas) == final.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 12
    assert final.usage.cache_read_input_tokens > 200


def test_usage_feeds_the_same_metrics_as_chat(stack: Stack) -> None:
    start = stack.runtime.tenant_stats.row("b")
    before, asked = start.cached_tokens, start.requests
    b = _client(stack, "sk-b")
    system = f"Account {uuid.uuid4().hex}. " + SYSTEM
    _ask(b, system)
    second = _ask(b, system)
    # Counted once the answer is relayed, just after the client has read its last byte.
    assert stack.wait_for(lambda: stack.runtime.tenant_stats.row("b").requests >= asked + 2)
    row = stack.runtime.tenant_stats.row("b")
    assert row.cached_tokens - before == second.usage.cache_read_input_tokens > 0
    metrics = httpx.get(stack.url + "/metrics", timeout=5).text
    assert 'kvgate_requests_total{endpoint="messages",replica="r1",status="200",tenant="b"}' in metrics
    assert 'kvgate_tokens_total{kind="cached",replica="r1",tenant="b"}' in metrics


def test_a_tenant_key_in_x_api_key_authenticates_and_salts_its_cache(stack: Stack) -> None:
    a, b = _client(stack, "sk-a"), _client(stack, "sk-b")
    system = f"Secret account {uuid.uuid4().hex}. " + SYSTEM
    _ask(a, system)
    probe = _ask(b, system)  # same prompt, another tenant: its own salt, no cached block
    again = _ask(a, system)
    assert probe.usage.cache_read_input_tokens == 0
    assert again.usage.cache_read_input_tokens > 200
    # The SDK sent x-api-key only: no Authorization header was involved.
    raw = httpx.post(stack.url + "/v1/messages", headers={"x-api-key": "sk-a"}, timeout=10, json={
        "model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
    assert raw.status_code == 200 and raw.headers["request-id"] == raw.headers["x-request-id"]


@pytest.mark.parametrize(("key", "error", "status", "kind"), [
    ("sk-wrong", anthropic.AuthenticationError, 401, "authentication_error"),
    ("sk-narrow", anthropic.NotFoundError, 404, "not_found_error"),
])
def test_refusals_surface_as_the_sdk_exception_classes(stack: Stack, key: str, error: type, status: int,
                                                       kind: str) -> None:
    with pytest.raises(error) as e:
        _ask(_client(stack, key))
    assert e.value.status_code == status  # type: ignore[attr-defined]
    body = e.value.body  # type: ignore[attr-defined]
    assert body == {"type": "error", "error": {"type": kind, "message": body["error"]["message"]}}


def test_rate_limited_is_a_rate_limit_error_with_retry_after(stack: Stack) -> None:
    slow = _client(stack, "sk-slow")
    _ask(slow)
    with pytest.raises(anthropic.RateLimitError) as e:
        _ask(slow)
    assert e.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]
    assert int(e.value.response.headers["retry-after"]) >= 1


def test_bad_input_is_a_bad_request_error(stack: Stack) -> None:
    with pytest.raises(anthropic.BadRequestError) as e:
        _client(stack).messages.create(model=MODEL, max_tokens=8, messages=[{"role": "robot", "content": "hi"}])
    assert e.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert "role" in e.value.message


def test_the_semantic_cache_bypasses_messages_and_says_so(stack: Stack) -> None:
    a = _client(stack)
    first = a.messages.with_raw_response.create(model=MODEL, max_tokens=4,
                                                messages=[{"role": "user", "content": "What is a router?"}])
    second = a.messages.with_raw_response.create(model=MODEL, max_tokens=4,
                                                 messages=[{"role": "user", "content": "What is a router?"}])
    assert first.headers["x-kvgate-cache"] == second.headers["x-kvgate-cache"] == "bypass"
    assert second.headers["x-kvgate-replica"] == "r1"  # answered by the replica, not replayed
    metrics = httpx.get(stack.url + "/metrics", timeout=5).text
    assert 'kvgate_semantic_cache_bypasses_total{reason="unsupported_endpoint"}' in metrics


def test_hygiene_warns_about_a_timestamp_in_the_system_prompt(stack: Stack) -> None:
    raw = _client(stack).messages.with_raw_response.create(
        model=MODEL, max_tokens=1, system=[{"type": "text", "text": "Now: 2026-11-30T08:14:49Z. You are helpful."}],
        messages=[{"role": "user", "content": "hi"}])
    assert "timestamp" in raw.headers["x-kvgate-prefix-warning"]
    fine = _client(stack).messages.with_raw_response.create(
        model=MODEL, max_tokens=1, system="You are helpful.",
        messages=[{"role": "user", "content": "It is 2026-11-30T08:14:49Z now; what day is it?"}])
    assert "x-kvgate-prefix-warning" not in fine.headers


# -- what reaches the replica -------------------------------------------------------------
class _Capture:
    """A replica that records what it is sent and answers one fixed Anthropic message."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []

    def app(self) -> Starlette:
        async def messages(request: Request) -> Response:
            self.bodies.append(orjson.loads(await request.body()))
            self.headers.append(dict(request.headers))
            return Response(orjson.dumps({
                "id": "msg_1", "type": "message", "role": "assistant", "model": MODEL,
                "content": [{"type": "text", "text": "ok"}], "stop_reason": "end_turn",
                "usage": {"input_tokens": 3, "output_tokens": 1, "cache_read_input_tokens": 16,
                          "cache_creation_input_tokens": 0}}), media_type="application/json")

        async def models(request: Request) -> Response:
            return Response(orjson.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}),
                            media_type="application/json")

        return Starlette(routes=[Route("/v1/messages", messages, methods=["POST"]),
                                 Route("/v1/models", models, methods=["GET"]),
                                 Route("/health", lambda r: Response(), methods=["GET"])])


def test_cache_control_and_the_version_header_are_forwarded_and_credentials_are_not() -> None:
    from gateway.app import build_app
    from gateway.settings import load_settings

    capture = _Capture()
    replica = ServerThread(capture.app()).start()
    settings = load_settings(environ={}, overrides={
        "replicas": [{"name": "cap", "url": replica.url, "models": [MODEL]}],
        "pool": {"health_interval_s": 60, "metrics_interval_s": 60},
        "tenants": [{"name": "a", "api_keys": ["sk-a"]}]})
    gateway = ServerThread(build_app(settings)).start()
    try:
        tools = [{"name": "lookup", "description": "find an order", "input_schema": {"type": "object"},
                  "cache_control": {"type": "ephemeral"}}]
        system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
        messages = [{"role": "user",
                     "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}]
        client = anthropic.Anthropic(base_url=gateway.url, api_key="sk-a", max_retries=0)
        out = client.messages.create(model=MODEL, max_tokens=4, system=system, tools=tools,  # type: ignore[arg-type]
                                     messages=messages, extra_headers={"anthropic-version": "2023-06-01",
                                                                       "anthropic-beta": "prompt-caching-2024-07-31"})
        assert out.content[0].text == "ok" and out.usage.cache_read_input_tokens == 16
        body, headers = capture.bodies[0], capture.headers[0]
        assert body["system"] == system and body["tools"] == tools and body["messages"] == messages
        assert isinstance(body["cache_salt"], str) and body["cache_salt"]  # vLLM 0.33 salts /v1/messages
        assert headers["anthropic-version"] == "2023-06-01"
        assert headers["anthropic-beta"] == "prompt-caching-2024-07-31"
        assert "x-api-key" not in headers and "authorization" not in headers
        assert "stream_options" not in body
        # This replica does not serve count_tokens (older vLLM): its 404 comes back in Anthropic's shape.
        with pytest.raises(anthropic.NotFoundError) as e:
            client.messages.count_tokens(model=MODEL, messages=messages)  # type: ignore[arg-type]
        assert e.value.body["type"] == "error"  # type: ignore[index]
    finally:
        gateway.stop()
        replica.stop()


def test_prefix_affinity_keeps_a_conversation_on_the_replica_that_holds_it() -> None:
    s = start_stack(3, routing={"policy": "prefix_affinity"})
    try:
        client = anthropic.Anthropic(base_url=s.url, api_key="x", max_retries=0)
        homes: dict[int, set[str]] = {}
        for agent in range(6):
            system = [{"type": "text", "text": f"Agent {agent}: you fix bugs in repository {agent}. " + SYSTEM,
                       "cache_control": {"type": "ephemeral"}}]
            history: list[dict[str, Any]] = []
            for turn in range(3):
                history.append({"role": "user", "content": f"Step {turn}: what next?"})
                raw = client.messages.with_raw_response.create(model=MODEL, max_tokens=4, system=system,  # type: ignore[arg-type]
                                                               messages=history)
                reply = raw.parse()
                homes.setdefault(agent, set()).add(raw.headers["x-kvgate-replica"])
                if turn:
                    assert reply.usage.cache_read_input_tokens > 200, "a later turn finds its prefix cached"
                history.append({"role": "assistant", "content": reply.content[0].text})  # type: ignore[union-attr]
        assert all(len(h) == 1 for h in homes.values()), homes
    finally:
        s.close()
