"""Pure parts of the Messages route: its routing view, the stream observer, usage and the error shape."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.errors import BadRequest, GatewayError, NoReplica, RateLimited, UpstreamError
from gateway.apis.messages.shape import ANTHROPIC_SHAPE, error_type
from gateway.apis.messages.sse import MessagesObserver, anthropic_usage, whole_message
from policies.decision import hygiene_body
from routing.base import RouteRequest
from routing.hashing import render
from routing.keys import PrefixKeyer, analyse
from routing.messages_view import chat_view
from routing.settings import RoutingSettings

EPHEMERAL = {"type": "ephemeral"}
SYSTEM = [{"type": "text", "text": "You are a coding agent. " * 20, "cache_control": EPHEMERAL}]
TOOLS = [{"name": "read_file", "description": "read", "input_schema": {"type": "object"}},
         {"name": "edit_file", "description": "edit", "input_schema": {"type": "object"}, "cache_control": EPHEMERAL}]


def _body(*turns: Any, system: Any = SYSTEM, tools: Any = TOOLS) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 8, "system": system, "tools": tools, "messages": list(turns)}


def _strip(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if k != "cache_control"}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value


USER1 = {"role": "user", "content": [{"type": "text", "text": "Fix the bug in main.py", "cache_control": EPHEMERAL}]}
CALL = {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "read_file", "input": {"p": "x"}}]}
RESULT = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "print(1)"}]}


# -- routing ------------------------------------------------------------------------------
def test_breakpoints_on_system_tools_and_blocks_are_explicit_cuts_and_never_bytes() -> None:
    rendered = render("messages", _body(USER1))
    plain = render("messages", _strip(_body(USER1)))
    assert rendered.data == plain.data and plain.breakpoints == ()
    tools, system, user = rendered.spans
    assert (tools.role, system.role, user.role) == ("tools", "system", "user")
    # After the second tool, after the system block, after the user's text block: the client's own layers.
    assert rendered.breakpoints == (tools.end, system.end, user.end)
    info = analyse(RouteRequest("messages", "m", "ns", _body(USER1)), RoutingSettings())
    assert info.explicit == [tools.end, system.end, user.end]


def test_claude_codes_billing_header_never_reaches_the_key() -> None:
    def with_header(h: str) -> dict[str, Any]:
        return _body(USER1, system=[{"type": "text", "text": f"x-anthropic-billing-header: cch={h};"}, *SYSTEM])
    assert render("messages", with_header("a1")).data == render("messages", with_header("b2")).data
    assert render("messages", with_header("a1")).data == render("messages", _body(USER1)).data


def test_a_conversations_turns_share_one_routing_key() -> None:
    keyer = PrefixKeyer(RoutingSettings())
    turn1 = keyer.key_for(RouteRequest("messages", "m", "ns", _body(USER1)), replicas=4)
    turn3 = keyer.key_for(RouteRequest("messages", "m", "ns", _body(USER1, CALL, RESULT)), replicas=4)
    other = keyer.key_for(RouteRequest("messages", "m", "ns", _body({"role": "user", "content": "Another task"})),
                          replicas=4)
    # One agent's tools and system prompt (not wide yet) key all its conversations.
    assert turn1.key == turn3.key == other.key
    assert keyer.key_for(RouteRequest("messages", "m", "other-tenant", _body(USER1)), replicas=4).key != turn1.key
    another_agent = _body(USER1, tools=[{"name": "comment", "input_schema": {"type": "object"}}])
    assert keyer.key_for(RouteRequest("messages", "m", "ns", another_agent), replicas=4).key != turn1.key


_text = st.text(min_size=1, max_size=30)
_block = st.one_of(
    st.builds(lambda t, cc: {"type": "text", "text": t, **({"cache_control": EPHEMERAL} if cc else {})},
              _text, st.booleans()),
    st.builds(lambda i, n: {"type": "tool_use", "id": i, "name": n, "input": {"q": n}}, _text, _text),
    st.builds(lambda i, c: {"type": "tool_result", "tool_use_id": i, "content": c}, _text, _text))
_message = st.builds(lambda role, content: {"role": role, "content": content}, st.sampled_from(["user", "assistant"]),
                     st.one_of(_text, st.lists(_block, min_size=1, max_size=3)))
_system = st.one_of(st.none(), _text, st.lists(_block, min_size=1, max_size=2))


@given(system=_system, history=st.lists(_message, min_size=1, max_size=4), more=st.lists(_message, max_size=3))
def test_a_growing_conversation_keeps_its_rendered_prefix(system: Any, history: list[Any], more: list[Any]) -> None:
    before = render("messages", _body(*history, system=system))
    after = render("messages", _body(*history, *more, system=system))
    assert after.data.startswith(before.data)
    assert render("messages", _body(*history, system=system)) == before  # pure
    assert render("messages", _strip(_body(*history, system=system))).data == before.data


def test_chat_view_shares_the_clients_objects_and_never_mutates() -> None:
    body = _body(USER1)
    snapshot = repr(body)
    view = chat_view(body)
    assert view["messages"][1] is USER1 and view["tools"] is TOOLS and repr(body) == snapshot
    assert chat_view({"messages": [USER1]}) == {"messages": [USER1]}


def test_hygiene_reads_the_system_prompt_as_the_first_message() -> None:
    view = hygiene_body("messages", _body(USER1, system="Now: 2026-11-30T08:14:49Z"))
    assert view["messages"][0] == {"role": "system", "content": "Now: 2026-11-30T08:14:49Z"}
    chat = {"messages": [USER1]}
    assert hygiene_body("chat", chat) is chat


# -- the stream observer -----------------------------------------------------------------
def _ev(kind: str, **payload: Any) -> bytes:
    import orjson
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **payload}) + b"\n\n"


STREAM = b"".join([
    _ev("message_start", message={"id": "m", "type": "message", "role": "assistant", "content": [], "model": "m",
                                  "usage": {"input_tokens": 120, "output_tokens": 0}}),
    _ev("ping"),
    _ev("content_block_start", index=0, content_block={"type": "text", "text": ""}),
    _ev("content_block_delta", index=0, delta={"type": "text_delta", "text": "Hello"}),
    b": a comment\n\n",
    _ev("content_block_delta", index=0, delta={"type": "text_delta", "text": " world"}),
    _ev("content_block_stop", index=0),
    _ev("message_delta", delta={"stop_reason": "end_turn", "stop_sequence": None},
        usage={"input_tokens": 8, "output_tokens": 2, "cache_read_input_tokens": 96,
               "cache_creation_input_tokens": 16}),
    _ev("message_stop"),
])


@given(cuts=st.lists(st.integers(0, len(STREAM)), max_size=12))
def test_the_observer_forwards_every_byte_whatever_the_chunking(cuts: list[int]) -> None:
    observer = MessagesObserver()
    points = sorted(set(cuts) | {0, len(STREAM)})
    out = b"".join(observer.feed(STREAM[a:b]) for a, b in zip(points, points[1:]))
    observer.finish()
    assert out == STREAM
    assert observer.complete and observer.text == "Hello world" and observer.finish_reason == "end_turn"
    u = observer.usage
    assert u is not None and (u.prompt_tokens, u.cached_tokens, u.completion_tokens) == (120, 96, 2)


def test_an_error_event_or_garbage_is_a_failure_and_a_cut_stream_is_incomplete() -> None:
    error = _ev("error", error={"type": "overloaded_error", "message": "busy"})
    observer = MessagesObserver()
    assert observer.feed(STREAM[:200] + STREAM[200:STREAM.index(b"event: content_block_stop")] + error).endswith(error)
    assert observer.failure and observer.upstream_error == {"type": "overloaded_error", "message": "busy"}
    assert not observer.complete
    garbled = MessagesObserver()
    assert garbled.feed(b'event: content_block_delta\ndata: {"type": \n\n') == b""
    assert garbled.failure == "upstream sent a malformed SSE event"
    cut = MessagesObserver()
    cut.feed(STREAM[: STREAM.index(b"event: message_stop")])
    cut.finish()
    assert cut.failure and not cut.complete


def test_usage_counts_the_whole_prompt_like_chat() -> None:
    u = anthropic_usage({"input_tokens": 8, "output_tokens": 2, "cache_read_input_tokens": 96,
                         "cache_creation_input_tokens": 16})
    assert u is not None and (u.prompt_tokens, u.cached_tokens, u.completion_tokens) == (120, 96, 2)
    # Without --enable-prompt-tokens-details vLLM sends no cache fields: the prompt is input_tokens.
    u = anthropic_usage({"input_tokens": 120, "output_tokens": 2})
    assert u is not None and (u.prompt_tokens, u.cached_tokens) == (120, None)
    assert anthropic_usage(None) is None
    whole = whole_message({"content": [{"type": "text", "text": "a"}, {"type": "tool_use", "id": "t", "name": "f",
                                                                       "input": {}}],
                           "stop_reason": "tool_use", "usage": {"input_tokens": 1, "output_tokens": 1}})
    assert whole.text == "a" and whole.has_tool_calls and whole.finish_reason == "tool_use"


# -- the error shape ---------------------------------------------------------------------
@pytest.mark.parametrize(("err", "kind"), [
    (BadRequest("bad"), "invalid_request_error"), (RateLimited("slow", retry_after_s=1), "rate_limit_error"),
    (UpstreamError("down"), "api_error"), (NoReplica("none"), "overloaded_error"),
])
def test_errors_take_anthropics_type_for_their_status(err: GatewayError, kind: str) -> None:
    import orjson
    assert orjson.loads(ANTHROPIC_SHAPE.payload(err)) == {"type": "error", "error": {"type": kind,
                                                                                     "message": err.message}}
    event = ANTHROPIC_SHAPE.event(err)
    assert event.startswith(b"event: error\ndata: {") and event.endswith(b"}\n\n")


def test_status_table_and_the_param_in_the_message() -> None:
    assert [error_type(s) for s in (400, 401, 403, 404, 413, 422, 429, 500, 502, 503, 504, 529)] == [
        "invalid_request_error", "authentication_error", "permission_error", "not_found_error", "request_too_large",
        "invalid_request_error", "rate_limit_error", "api_error", "api_error", "overloaded_error", "api_error",
        "overloaded_error"]
    body = ANTHROPIC_SHAPE.body(BadRequest("must be an integer", param="max_tokens"))
    assert body["error"]["message"] == "max_tokens: must be an integer"
    assert ANTHROPIC_SHAPE.body(BadRequest("'max_tokens' is required", param="max_tokens"))["error"]["message"] == \
        "'max_tokens' is required"


# -- tenant policy -----------------------------------------------------------------------
def test_tenant_policy_on_messages_salts_normalises_tools_and_reads_system_for_hygiene() -> None:
    from policies.settings import TenantSettings
    from policies.decision import evaluate
    from policies.tenants import tenant_from_settings

    t = tenant_from_settings(TenantSettings(name="acme", normalize_tools=True, sort_tools=True), "secret")
    tools = [{"name": "b", "input_schema": {"type": "object", "properties": {"y": {}, "x": {}}}},
             {"name": "a", "input_schema": {"type": "object"}}]
    body = {**_body(USER1, system="Today is 2026-11-30T08:14:49Z.", tools=tools), "cache_salt": "mine"}
    d = evaluate(t, body, endpoint="messages")
    assert d.body["cache_salt"] == t.cache_salt != "mine"
    assert [tool["name"] for tool in d.body["tools"]] == ["a", "b"]
    assert list(d.body["tools"][1]["input_schema"]["properties"]) == ["x", "y"]
    assert [w.kind for w in d.warnings] == ["timestamp"] and d.warnings[0].role == "system"
    counted = evaluate(t, {k: v for k, v in body.items() if k != "max_tokens"}, endpoint="count_tokens")
    assert "cache_salt" not in counted.body and counted.warnings == ()
