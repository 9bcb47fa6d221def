"""OpenAI/vLLM response shapes, as pure functions from values to JSON-able dicts or SSE bytes.

Kept apart from I/O so the exact wire format (what the OpenAI SDK and the
gateway parse) is reviewable in one place. Streaming chunks follow OpenAI:
with ``stream_options.include_usage`` every chunk carries ``"usage": null``
and one extra chunk with ``"choices": []`` carries the totals; without it no
chunk has a ``usage`` key.
"""

from __future__ import annotations

from typing import Any

import orjson

__all__ = [
    "ApiError",
    "DONE",
    "chat_chunk",
    "chat_response",
    "completion_chunk",
    "completion_response",
    "error_body",
    "sse",
    "usage",
    "usage_chunk",
]

DONE = b"data: [DONE]\n\n"


class ApiError(Exception):
    """A request the simulator refuses, carrying the status and OpenAI error fields vLLM would send."""

    def __init__(self, status: int, message: str, type_: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.status)


def error_body(message: str, type_: str, param: str | None, code: int | str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    # Always with details: the simulator runs as if --enable-prompt-tokens-details were set.
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def chat_response(
    rid: str, created: int, model: str, texts: list[str], reasons: list[str | None], use: dict[str, Any]
) -> dict[str, Any]:
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": text, "tool_calls": []},
            "logprobs": None,
            "finish_reason": reason,
            "stop_reason": None,
        }
        for i, (text, reason) in enumerate(zip(texts, reasons))
    ]
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": use}


def completion_response(
    rid: str, created: int, model: str, texts: list[str], reasons: list[str | None], use: dict[str, Any]
) -> dict[str, Any]:
    choices = [
        {"index": i, "text": text, "logprobs": None, "finish_reason": reason, "stop_reason": None}
        for i, (text, reason) in enumerate(zip(texts, reasons))
    ]
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": use}


def chat_chunk(
    rid: str, created: int, model: str, index: int, delta: dict[str, Any],
    finish_reason: str | None, with_usage: bool,
) -> bytes:
    chunk: dict[str, Any] = {
        "id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
        "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
    }
    if with_usage:
        chunk["usage"] = None
    return sse(chunk)


def completion_chunk(
    rid: str, created: int, model: str, index: int, text: str, finish_reason: str | None, with_usage: bool
) -> bytes:
    chunk: dict[str, Any] = {
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}],
    }
    if with_usage:
        chunk["usage"] = None
    return sse(chunk)


def usage_chunk(rid: str, created: int, model: str, obj: str, use: dict[str, Any]) -> bytes:
    return sse({"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": use})
