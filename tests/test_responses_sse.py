"""The Responses stream observer: however the bytes are split, the client gets the same events,
with only the replica's ids replaced, and the gateway the same usage, text and ending."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gateway.errors import UpstreamError
from gateway.apis.responses.sse import IdRewriter, ResponsesObserver
from vllm_sim.responses_wire import Shape, event, response_usage

RAW, PREV = "resp_" + "a" * 32, "resp_" + "b" * 32
SHAPE = Shape(RAW, "msg_1", 1, "sim-model", {"previous_response_id": PREV}, 16)
AT = {"item_id": "msg_1", "output_index": 0, "content_index": 0}
WORDS = ["the", " cache", " block", " warm"]
FINAL = SHAPE.response("completed", "".join(WORDS), response_usage(40, 4, 32))
STREAM = b"".join([
    event("response.created", 0, response=SHAPE.response("in_progress")),
    event("response.in_progress", 1, response=SHAPE.response("in_progress")),
    event("response.output_item.added", 2, output_index=0, item=SHAPE.message(None, "in_progress")),
    *[event("response.output_text.delta", 3 + i, **AT, delta=w, logprobs=[]) for i, w in enumerate(WORDS)],
    event("response.completed", 7, response=FINAL),
])


def _client_view(data: bytes) -> bytes:
    return data.replace(f'"{RAW}"'.encode(), b'"resp_kg1.client.aaaa"').replace(f'"{PREV}"'.encode(),
                                                                               b'"resp_kg1.prev"')


def _observer() -> ResponsesObserver:
    rewriter = IdRewriter(lambda raw: "resp_kg1.client." + raw[-4:], {PREV: "resp_kg1.prev"})
    return ResponsesObserver("responses", strip_usage_chunk=False, rewriter=rewriter)


def _feed(observer: ResponsesObserver, data: bytes, cuts: list[int]) -> bytes:
    out, last = b"", 0
    for cut in sorted(set(cuts)) + [len(data)]:
        out += observer.feed(data[last:cut])
        last = cut
    return out


@given(st.lists(st.integers(0, len(STREAM)), max_size=20))
def test_any_chunking_gives_the_same_events_and_facts(cuts: list[int]) -> None:
    obs = _observer()
    out = _feed(obs, STREAM, cuts)
    assert out == _client_view(STREAM)
    assert RAW.encode() not in out and PREV.encode() not in out
    assert obs.done and obs.complete and obs.failure is None and obs.finish_reason == "stop"
    assert obs.text == "".join(WORDS) and obs.sequence == 7 and obs.first_delta_at is not None
    assert obs.usage is not None and (obs.usage.prompt_tokens, obs.usage.cached_tokens,
                                      obs.usage.completion_tokens) == (40, 32, 4)


@given(st.integers(1, len(STREAM) - 1))
def test_a_cut_stream_is_a_failure_with_an_error_event_after_the_last(cut: int) -> None:
    obs = _observer()
    obs.feed(STREAM[:cut])
    obs.finish()
    if obs.done:
        return  # the cut fell after the terminal event's end
    assert obs.failure is not None and not obs.complete and obs.upstream_error is None
    tail = obs.error_event(UpstreamError(obs.failure))
    assert tail.startswith(b"event: error\ndata: {") and b'"type":"error"' in tail
    assert f'"sequence_number":{obs.sequence + 1}'.encode() in tail


def test_the_replicas_error_events_end_the_stream_as_they_are() -> None:
    failed = SHAPE.response("failed")
    for ev in (event("error", 3, code="server_error", message="boom", param=None),
               event("response.failed", 3, response={**failed, "error": {"code": "server_error", "message": "x"}})):
        obs = _observer()
        out = obs.feed(STREAM[:STREAM.index(b"event: response.output_item.added")] + ev)
        assert out.endswith(_client_view(ev))
        assert obs.failure is not None and obs.upstream_error is not None, "the relay adds no second error"


def test_malformed_event_fails_the_stream() -> None:
    obs = _observer()
    obs.feed(b"event: response.created\ndata: {nope\n\n")
    assert obs.failure == "upstream sent a malformed SSE event"


def test_lifecycle_events_are_held_until_the_first_event_after_them() -> None:
    # The stream's first event is the first after response.created and response.in_progress (sent
    # before prefill): until then nothing is forwarded, and then the held events go with it, in order.
    lifecycle = STREAM[:STREAM.index(b"event: response.output_item.added")]
    obs = _observer()
    assert obs.feed(lifecycle) == b"" and obs.failure is None
    rest = STREAM[len(lifecycle):]
    first = rest[:rest.index(b"\n\n") + 2]
    assert obs.feed(first) == _client_view(lifecycle + first)
    bad = _observer()
    assert bad.feed(lifecycle + b"event: response.output_item.added\ndata: {nope\n\n") == b""
    assert bad.failure == "upstream sent a malformed SSE event", "a stream bad before it fails whole"
