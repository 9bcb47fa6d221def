"""vLLM's Responses API shapes (``ResponsesResponse`` and its stream events), as pure functions.

Field for field what vLLM 0.33's ``/v1/responses`` returns for a plain text
answer (``tests/test_sim_responses_vllm.py`` validates them against vLLM's own
pydantic models when the ``vllm`` package is importable): one ``message`` output
item with one ``output_text`` part, usage as ``input_tokens`` /
``input_tokens_details.cached_tokens`` / ``output_tokens``. Stream events are
named SSE events (``event: <type>``) whose data carries the same ``type`` and a
``sequence_number`` counting from 0; there is no ``[DONE]``.
"""

from __future__ import annotations

from typing import Any

import orjson

__all__ = ["Shape", "event", "response_usage"]


def response_usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    # One turn (no tool loop): the per-turn lists vLLM adds hold one entry each. The
    # tokens written to the cache are the prompt's uncached ones.
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": prompt - cached,
                                 "input_tokens_per_turn": [prompt], "cached_tokens_per_turn": [cached]},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0,
                                  "output_tokens_per_turn": [completion], "tool_output_tokens_per_turn": [0]},
        "total_tokens": prompt + completion,
    }


def event(kind: str, seq: int, **fields: Any) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, "sequence_number": seq,
                                                                     **fields}) + b"\n\n"


class Shape:
    """One response's fixed parts (ids, echoed request fields), and its states as JSON."""

    def __init__(self, rid: str, msg_id: str, created: int, model: str, body: dict[str, Any],
                 max_output_tokens: int) -> None:
        self.rid, self.msg_id, self.created, self.model = rid, msg_id, created, model
        self.echo = {
            "instructions": body.get("instructions"),
            "metadata": body.get("metadata"),
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "temperature": body.get("temperature", 1.0),
            "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools") or [],
            "top_p": body.get("top_p", 1.0),
            "background": bool(body.get("background", False)),
            "max_output_tokens": max_output_tokens,
            "max_tool_calls": body.get("max_tool_calls"),
            "previous_response_id": body.get("previous_response_id"),
            "prompt": None,
            "reasoning": body.get("reasoning"),
            "service_tier": body.get("service_tier", "auto"),
            "text": body.get("text"),
            "top_logprobs": body.get("top_logprobs"),
            "truncation": body.get("truncation", "disabled"),
            "user": body.get("user"),
        }

    def message(self, text: str | None, status: str = "completed") -> dict[str, Any]:
        content = [] if text is None else [self.part(text)]
        return {"id": self.msg_id, "content": content, "role": "assistant", "status": status, "type": "message"}

    @staticmethod
    def part(text: str) -> dict[str, Any]:
        return {"annotations": [], "text": text, "type": "output_text", "logprobs": None}

    def response(self, status: str, text: str | None = None, usage: dict[str, Any] | None = None,
                 incomplete: str | None = None) -> dict[str, Any]:
        # No "error" key: vLLM's ResponsesResponse has none (a failure is an "error" event).
        return {
            "id": self.rid, "created_at": self.created,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "model": self.model, "object": "response",
            "output": [] if text is None else [self.message(text)],
            **self.echo, "status": status, "usage": usage,
        }
