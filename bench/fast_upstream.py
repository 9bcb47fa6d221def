"""A canned vLLM-shaped upstream that does no work, for measuring kvgate's own overhead.

Raw ASGI (no framework) so the upstream costs as little as possible: a chat
completion, or the same answer as 8 SSE chunks plus usage and [DONE].
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
    if b'"stream":true' in body.replace(b" ", b""):
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for event in _STREAM:
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": _COMPLETION})


def main() -> None:
    import uvicorn

    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=9100)
    args = p.parse_args()
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
