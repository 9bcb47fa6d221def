"""A canned vLLM-shaped upstream that does no work, for measuring kvgate's own overhead.

Raw ASGI (no framework) so the upstream costs as little as possible: a chat
completion, or the same answer as 8 SSE chunks plus usage and [DONE]; on
``/v1/responses`` the same 8 tokens as a Responses answer or event stream.
Run: python -m bench.fast_upstream --port 9100
"""

from __future__ import annotations

import argparse
from typing import Any

import orjson

_COMPLETION = orjson.dumps({
    "id": "chatcmpl-fast", "object": "chat.completion", "created": 1, "model": "sim-model",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "fast answer " * 8},
                 "logprobs": None, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 12, "completion_tokens": 16, "total_tokens": 28,
              "prompt_tokens_details": {"cached_tokens": 0}},
})


def _chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
    return b"data: " + orjson.dumps({
        "id": "chatcmpl-fast", "object": "chat.completion.chunk", "created": 1, "model": "sim-model",
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }) + b"\n\n"


_STREAM = [_chunk({"role": "assistant", "content": ""})] + [_chunk({"content": "fast "}) for _ in range(7)] + [
    _chunk({"content": "end"}, "stop"),
    b"data: " + orjson.dumps({"id": "chatcmpl-fast", "object": "chat.completion.chunk", "created": 1,
                              "model": "sim-model", "choices": [],
                              "usage": {"prompt_tokens": 12, "completion_tokens": 8, "total_tokens": 20}}) + b"\n\n",
    b"data: [DONE]\n\n",
]


def _event(kind: str, seq: int, **fields: Any) -> bytes:
    return (b"event: " + kind.encode() + b"\ndata: "
            + orjson.dumps({"type": kind, "sequence_number": seq, **fields}) + b"\n\n")


def _response(status: str, text: str | None) -> dict[str, Any]:
    usage = {"input_tokens": 12, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 8,
             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 20}
    output = [] if text is None else [{"id": "msg_fast", "type": "message", "role": "assistant", "status": status,
                                       "content": [{"type": "output_text", "text": text, "annotations": []}]}]
    return {"id": "resp_fast", "object": "response", "created_at": 1, "model": "sim-model", "status": status,
            "output": output, "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
            "usage": usage if text is not None else None}


# The Responses API's shapes (vllm_sim.responses_wire has the full ones): the same 8 tokens
# as the chat stream, framed by the events vLLM sends around them.
_AT = {"item_id": "msg_fast", "output_index": 0, "content_index": 0}
_RESPONSE = orjson.dumps(_response("completed", "fast answer " * 8))
_RESPONSE_STREAM = [
    _event("response.created", 0, response=_response("in_progress", None))
    + _event("response.in_progress", 1, response=_response("in_progress", None)),
    _event("response.output_item.added", 2, output_index=0, item={"id": "msg_fast", "type": "message",
                                                                   "role": "assistant", "status": "in_progress",
                                                                   "content": []})
    + _event("response.content_part.added", 3, **_AT, part={"type": "output_text", "text": "", "annotations": []}),
    *[_event("response.output_text.delta", 4 + i, **_AT, delta="fast " if i < 7 else "end", logprobs=[])
      for i in range(8)],
    _event("response.output_text.done", 12, **_AT, text="fast " * 7 + "end", logprobs=[])
    + _event("response.completed", 13, response=_response("completed", "fast " * 7 + "end")),
]
_MODELS = orjson.dumps({"object": "list", "data": [{"id": "sim-model", "object": "model"}]})


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            msg = await receive()
            await send({"type": msg["type"] + ".complete"})
            if msg["type"] == "lifespan.shutdown":
                return
    body = b""
    more = True
    while more:
        msg = await receive()
        body += msg.get("body", b"")
        more = msg.get("more_body", False)
    path = scope["path"]
    if path in ("/health", "/metrics"):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})
        return
    if path == "/v1/models":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": _MODELS})
        return
    responses = path == "/v1/responses"
    if b'"stream":true' in body.replace(b" ", b""):
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for event in _RESPONSE_STREAM if responses else _STREAM:
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": _RESPONSE if responses else _COMPLETION})


def main() -> None:
    import uvicorn

    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=9100)
    args = p.parse_args()
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
