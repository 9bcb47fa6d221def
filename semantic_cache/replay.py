"""Replay a cached answer in OpenAI's wire format. Pure: no clock, no I/O.

``completion_body`` gives the non-streaming object; ``sse_events`` the
streaming one, split into word-sized chunks so a client's streaming UI behaves
as it does for a live answer. Usage reports the whole prompt as cached
(``prompt_tokens_details.cached_tokens == prompt_tokens``): nothing was
computed for it, which is what that field tells a client.

Stream shape (what the SDKs expect): the first chunk's delta is
``{"role": "assistant", "content": ""}`` (chat only); ``finish_reason`` rides
on the last content chunk; with ``include_usage`` every chunk carries
``"usage": null`` and one extra chunk with ``choices: []`` carries the usage;
then ``data: [DONE]``.
"""

from __future__ import annotations

import json
import re
from typing import Any

from .models import CachedAnswer

# How many chunks a long answer is replayed in, at most: more only costs CPU.
MAX_CHUNKS = 128
_WORDS = re.compile(r"\s*\S+\s*|\s+")


def usage(answer: CachedAnswer) -> dict[str, Any]:
    return {
        "prompt_tokens": answer.prompt_tokens,
        "completion_tokens": answer.completion_tokens,
        "total_tokens": answer.prompt_tokens + answer.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": answer.prompt_tokens},
    }


def completion_body(answer: CachedAnswer, *, request_id: str, model: str, endpoint: str) -> dict[str, Any]:
    """A ``chat.completion`` (endpoint "chat") or ``text_completion`` object."""
    if endpoint == "chat":
        message: dict[str, Any] = {"role": "assistant", "content": answer.content or None}
        if answer.tool_calls:
            message["tool_calls"] = answer.tool_calls
        choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": None,
                                  "finish_reason": answer.finish_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": answer.content, "logprobs": None, "finish_reason": answer.finish_reason}
        obj = "text_completion"
    return {"id": request_id, "object": obj, "created": answer.created, "model": model,
            "choices": [choice], "usage": usage(answer)}


def split_text(text: str, max_chunks: int = MAX_CHUNKS) -> list[str]:
    """Word-ish pieces whose concatenation is exactly ``text``."""
    words = _WORDS.findall(text)
    if len(words) <= max_chunks:
        return words
    per = -(-len(words) // max_chunks)
    return ["".join(words[i:i + per]) for i in range(0, len(words), per)]


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def _tool_call_deltas(tool_calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"index": i, "id": tc.get("id"), "type": tc.get("type", "function"),
             "function": tc.get("function", {})} for i, tc in enumerate(tool_calls)]


def sse_events(answer: CachedAnswer, *, request_id: str, model: str, endpoint: str,
               include_usage: bool) -> list[bytes]:
    """The full event stream for ``answer``, ending with ``data: [DONE]``."""
    chat = endpoint == "chat"
    base: dict[str, Any] = {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
                            "created": answer.created, "model": model}
    if include_usage:
        base["usage"] = None

    def chunk(payload: dict[str, Any], finish: str | None) -> bytes:
        if chat:
            choice = {"index": 0, "delta": payload, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": payload.get("content", ""), "logprobs": None, "finish_reason": finish}
        return _event({**base, "choices": [choice]})

    deltas: list[dict[str, Any]] = [{"content": piece} for piece in split_text(answer.content)]
    if chat and answer.tool_calls:
        deltas.append({"tool_calls": _tool_call_deltas(answer.tool_calls)})
    if not deltas:
        deltas = [{"content": ""}]
    events = [chunk({"role": "assistant", "content": ""}, None)] if chat else []
    events += [chunk(d, answer.finish_reason if i == len(deltas) - 1 else None) for i, d in enumerate(deltas)]
    if include_usage:
        events.append(_event({**base, "choices": [], "usage": usage(answer)}))
    events.append(b"data: [DONE]\n\n")
    return events
