"""Anthropic streams through kvgate: incremental, cancelled with the client, failures as an ``error`` event."""

from __future__ import annotations

import time
from typing import Any, Iterator

import anthropic
import httpx
import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from gateway.app import build_app
from gateway.settings import load_settings
from tests.support.servers import ServerThread
from tests.support.stack import MODEL, Stack, start_stack
from vllm_sim.timing import TimingModel

MESSAGES = [{"role": "user", "content": "Tell me a long story about routers."}]
# ~20 ms per decode step: slow enough to leave mid-stream.
SLOW = TimingModel(decode_base_s=0.02, decode_s_per_seq=0.0, prefill_base_s=0.0, time_scale=1.0)


@pytest.fixture
def slow_stack() -> Iterator[Stack]:
    s = start_stack(1, sim={"timing": SLOW})
    yield s
    s.close()


def _body(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": 50, "stream": True, **kw}


def _events(raw: str) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for block in raw.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        out.append((lines["event"], orjson.loads(lines["data"])))
    return out


def _aborts(stack: Stack) -> int:
    return int(stack.sim_stats("r1")["aborted"])


def test_stream_is_incremental_and_in_anthropic_order(slow_stack: Stack) -> None:
    client = anthropic.Anthropic(base_url=slow_stack.url, api_key="x", max_retries=0)
    # The SDK imports its stream types on first use; holding the GIL meanwhile, it would
    # stall the simulator's engine thread, which then catches up in a burst.
    with client.messages.stream(model=MODEL, max_tokens=1, messages=MESSAGES) as warm:  # type: ignore[arg-type]
        warm.get_final_message()
    arrivals = []
    t0 = time.perf_counter()
    with client.messages.stream(model=MODEL, max_tokens=20, messages=MESSAGES) as stream:  # type: ignore[arg-type]
        for _ in stream.text_stream:
            arrivals.append(time.perf_counter() - t0)
    assert len(arrivals) == 20 and arrivals[-1] - arrivals[0] > 0.25  # 20 tokens at ~20 ms
    raw = httpx.post(slow_stack.url + "/v1/messages", json=_body(max_tokens=3), timeout=10)
    kinds = [k for k, _ in _events(raw.text)]
    assert kinds == ["message_start", "content_block_start", *["content_block_delta"] * 3, "content_block_stop",
                     "message_delta", "message_stop"]
    assert raw.headers["content-type"].startswith("text/event-stream")


def test_disconnect_mid_stream_cancels_upstream_within_a_second(slow_stack: Stack) -> None:
    with httpx.Client(timeout=10) as c:
        with c.stream("POST", slow_stack.url + "/v1/messages", json=_body(max_tokens=500)) as r:
            for _ in r.iter_raw():
                break  # the first event arrived: now vanish
    t = time.monotonic()
    assert slow_stack.wait_for(lambda: _aborts(slow_stack) == 1, timeout=1.0)
    assert time.monotonic() - t < 1.0


def test_disconnect_before_the_first_token_cancels_upstream(slow_stack: Stack) -> None:
    slow_stack.faults("r1", stall_before_first_token_s=5.0)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(slow_stack.url + "/v1/messages", json=_body(), timeout=0.3)
    assert slow_stack.wait_for(lambda: _aborts(slow_stack) == 1, timeout=1.0)


def test_disconnect_while_waiting_for_a_whole_message_cancels_upstream(slow_stack: Stack) -> None:
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(slow_stack.url + "/v1/messages", json=_body(stream=False, max_tokens=500), timeout=0.3)
    assert slow_stack.wait_for(lambda: _aborts(slow_stack) == 1, timeout=1.0)


def test_a_silent_or_stalling_replica_times_out_in_anthropic_shape() -> None:
    stack = start_stack(1, sim={"timing": SLOW}, timeouts={"first_byte_s": 0.3, "stall_s": 0.3})
    try:
        client = anthropic.Anthropic(base_url=stack.url, api_key="x", max_retries=0)
        stack.faults("r1", stall_before_first_token_s=3.0)
        with pytest.raises(anthropic.InternalServerError) as e:
            client.messages.create(model=MODEL, max_tokens=5, messages=MESSAGES, stream=True)  # type: ignore[arg-type]
        assert e.value.status_code == 504 and e.value.body["error"]["type"] == "api_error"  # type: ignore[index]
        stack.faults("r1", stall_mid_stream_s=3.0, stall_after_tokens=2)
        events = _events(httpx.post(stack.url + "/v1/messages", json=_body(), timeout=10).text)
        assert [k for k, _ in events][-1] == "error" and "stalled" in events[-1][1]["error"]["message"]
        assert sum(k == "content_block_delta" for k, _ in events) == 2
    finally:
        stack.close()


def test_replica_dying_mid_stream_gives_partial_text_then_an_error_event() -> None:
    stack = start_stack(1)
    try:
        stack.faults("r1", die_after_tokens=5)
        client = anthropic.Anthropic(base_url=stack.url, api_key="x", max_retries=0)
        received: list[str] = []
        with pytest.raises(anthropic.APIStatusError) as e:
            with client.messages.stream(model=MODEL, max_tokens=50, messages=MESSAGES) as stream:  # type: ignore[arg-type]
                for text in stream.text_stream:
                    received.append(text)
        assert len(received) == 5, "the tokens sent before the failure reach the client"
        assert e.value.body["error"]["type"] == "api_error"  # type: ignore[index]
        raw = httpx.post(stack.url + "/v1/messages", json=_body(), timeout=10).text
        events = _events(raw)
        assert events[-1][0] == "error" and events[-1][1]["type"] == "error"
        assert "mid-stream" in events[-1][1]["error"]["message"]
        assert not any(k in ("message_stop", "message_delta") for k, _ in events), "no invented end"
        # Malformed upstream bytes: the relay stops there, with the same error event.
        stack.faults("r1", garbage=True)
        events = _events(httpx.post(stack.url + "/v1/messages", json=_body(), timeout=10).text)
        assert [k for k, _ in events] == ["message_start", "content_block_start", "content_block_delta", "error"]
    finally:
        stack.close()


def test_replica_failing_before_the_first_byte_is_an_anthropic_error_response() -> None:
    stack = start_stack(1)
    try:
        stack.faults("r1", error_rate=1.0, error_status=500)
        client = anthropic.Anthropic(base_url=stack.url, api_key="x", max_retries=0)
        with pytest.raises(anthropic.InternalServerError) as e:
            client.messages.create(model=MODEL, max_tokens=5, messages=MESSAGES, stream=True)  # type: ignore[arg-type]
        assert e.value.status_code == 502 and e.value.body["error"]["type"] == "api_error"  # type: ignore[index]
        stack.faults("r1", rate_limit_rate=1.0)
        with pytest.raises(anthropic.RateLimitError):
            client.messages.create(model=MODEL, max_tokens=5, messages=MESSAGES)  # type: ignore[arg-type]
        stack.faults("r1", html_200=True)
        with pytest.raises(anthropic.InternalServerError) as e:
            client.messages.create(model=MODEL, max_tokens=5, messages=MESSAGES)  # type: ignore[arg-type]
        assert e.value.body["type"] == "error"  # type: ignore[index]
    finally:
        stack.close()


# -- a replica that reports its own error mid-stream ---------------------------------------
def _event(kind: str, **payload: Any) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **payload}) + b"\n\n"


UPSTREAM_ERROR = _event("error", error={"type": "overloaded_error", "message": "engine overloaded"})


def _failing_replica() -> Starlette:
    async def messages(request: Request) -> Response:
        async def events() -> Any:
            yield _event("message_start", message={"id": "m", "type": "message", "role": "assistant", "content": [],
                                                   "model": MODEL, "usage": {"input_tokens": 4, "output_tokens": 0}})
            yield _event("ping")
            yield _event("content_block_start", index=0, content_block={"type": "text", "text": ""})
            yield _event("content_block_delta", index=0, delta={"type": "text_delta", "text": "Once"})
            yield UPSTREAM_ERROR
        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/messages", messages, methods=["POST"]),
                             Route("/health", lambda r: Response(), methods=["GET"])])


def test_the_replicas_own_error_event_passes_through_once_and_ping_is_relayed() -> None:
    replica = ServerThread(_failing_replica()).start()
    settings = load_settings(environ={}, overrides={
        "replicas": [{"name": "bad", "url": replica.url, "models": [MODEL]}],
        "pool": {"health_interval_s": 60, "metrics_interval_s": 60}})
    gateway = ServerThread(build_app(settings)).start()
    try:
        raw = httpx.post(gateway.url + "/v1/messages", json=_body(), timeout=10).content
        assert raw.endswith(UPSTREAM_ERROR) and raw.count(b"event: error") == 1
        assert b"event: ping" in raw and b"message_stop" not in raw
        client = anthropic.Anthropic(base_url=gateway.url, api_key="x", max_retries=0)
        with pytest.raises(anthropic.APIStatusError) as e:
            with client.messages.stream(model=MODEL, max_tokens=5, messages=MESSAGES) as stream:  # type: ignore[arg-type]
                assert list(stream.text_stream) == ["Once"]
        assert e.value.body["error"] == {"type": "overloaded_error", "message": "engine overloaded"}  # type: ignore[index]
    finally:
        gateway.stop()
        replica.stop()
