"""The Responses API on the wire: its SSE events observed in passing, its ids rewritten.

vLLM streams named events (``response.created``, ``response.output_text.delta``,
..., ``response.completed``; ``response.failed`` and ``error`` when it fails),
each a JSON object with a ``type`` and a ``sequence_number``, and no ``[DONE]``.
``ResponsesObserver`` is the chat ``StreamObserver`` with Responses semantics:
usage comes from the terminal event's ``response.usage`` (``input_tokens``,
``input_tokens_details.cached_tokens``), the stream is done at
``response.completed`` / ``response.incomplete``, and a stream kvgate must cut
short ends with the protocol's own ``error`` event, never an invented
``response.completed``.

vLLM sends ``response.created`` and ``response.in_progress`` as soon as it takes
the request, before prefill: the point where a replica has shown it can answer is
the first event after them. So the observer holds those lifecycle events back
(``feed`` returns nothing) and releases them together with the first other event,
in one piece: that event is the stream's first event (``gateway.proxy.first_event``),
and a replica that fails while only they are held is retried like one that failed
before any event, its held events dropped with it. The client's time to first
token is unchanged: nothing it could have used (no output) is held past the
moment the first output arrives.

Every forwarded event passes through ``IdRewriter``: the replica's response ids
(the new one, learned from ``response.created``, and the previous one) become the
authenticated ids kvgate hands out. A byte replace of the quoted id, not a
re-serialisation: ids are random tokens, and the events stay byte-identical
otherwise.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import orjson

from gateway.errors import GatewayError
from gateway.proxy.sse import StreamObserver, Usage, _int_or_none

__all__ = ["IdRewriter", "ResponsesObserver", "responses_usage"]


def responses_usage(usage: Any) -> Usage | None:
    if not isinstance(usage, dict):
        return None
    details = usage.get("input_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return Usage(prompt_tokens=_int_or_none(usage.get("input_tokens")),
                 completion_tokens=_int_or_none(usage.get("output_tokens")), cached_tokens=_int_or_none(cached))


class IdRewriter:
    """Replaces the replica's response ids with kvgate's, in whole bodies and in events."""

    __slots__ = ("_issue", "_pairs")

    def __init__(self, issue: Callable[[str], str], known: dict[str, str] | None = None) -> None:
        self._issue = issue  # the replica's id -> the id the client gets
        self._pairs: list[tuple[bytes, bytes]] = [(_quoted(k), _quoted(v)) for k, v in (known or {}).items()]

    def learn(self, upstream_id: Any) -> None:
        if isinstance(upstream_id, str) and upstream_id:
            old = _quoted(upstream_id)
            if all(old != o for o, _ in self._pairs):
                self._pairs.append((old, _quoted(self._issue(upstream_id))))

    def apply(self, data: bytes) -> bytes:
        for old, new in self._pairs:
            if old in data:
                data = data.replace(old, new)
        return data


def _quoted(value: str) -> bytes:
    return orjson.dumps(value)


_TERMINAL = {"response.completed": "stop", "response.incomplete": "length"}
# What vLLM sends before prefill: held back until the first event after them (``ResponsesObserver.feed``).
_LIFECYCLE = frozenset({"response.created", "response.in_progress"})


@dataclass(slots=True)
class ResponsesObserver(StreamObserver):
    rewriter: IdRewriter | None = None
    sequence: int = -1  # the last sequence_number seen
    status: str | None = None
    # vLLM sends response.created before prefill: the first token is the first delta.
    first_delta_at: float | None = None
    # Whether every event so far is a lifecycle one (``_LIFECYCLE``), and what was held meanwhile
    # (None once released).
    lifecycle_only: bool = True
    _held: bytearray | None = field(default_factory=bytearray)

    def feed(self, chunk: bytes) -> bytes:
        out = StreamObserver.feed(self, chunk)
        if self._held is not None:
            if self.lifecycle_only:
                # A stream gone bad here (malformed, oversized) fails whole: nothing of it is forwarded.
                if self.failure is None:
                    self._held += out
                return b""
            out, self._held = bytes(self._held) + out, None
        return self.rewriter.apply(out) if out and self.rewriter is not None else out

    def error_event(self, err: GatewayError) -> bytes:
        payload = {"type": "error", "code": err.code, "message": err.message, "param": err.param,
                   "sequence_number": self.sequence + 1}
        return b"event: error\ndata: " + orjson.dumps(payload) + b"\n\n"

    def _on_event(self, obj: dict[str, Any]) -> bool:
        seq = obj.get("sequence_number")
        if isinstance(seq, int) and not isinstance(seq, bool):
            self.sequence = seq
        kind = obj.get("type")
        if kind not in _LIFECYCLE:
            self.lifecycle_only = False  # a replica's own error event too: the client sees it
        if kind == "response.output_text.delta":
            if self.first_delta_at is None:
                self.first_delta_at = time.perf_counter()
            if isinstance(obj.get("delta"), str):
                self._text.append(obj["delta"])
        elif kind == "response.created":
            self._response(obj)
        elif kind in _TERMINAL:
            self._response(obj)
            self.finish_reason = _TERMINAL[kind]
            self.done = True
        elif kind == "response.failed":
            response = self._response(obj)
            error = response.get("error")
            self.upstream_error = error if isinstance(error, dict) else {"message": "response failed"}
            self.failure = "upstream reported response.failed"
        elif kind == "error" or (kind is None and "error" in obj):
            self.upstream_error = obj
            self.failure = "upstream reported an error mid-stream"
        elif kind == "response.output_item.added":
            item = obj.get("item")
            if isinstance(item, dict) and item.get("type") == "function_call":
                self.has_tool_calls = True
        return True

    def _response(self, obj: dict[str, Any]) -> dict[str, Any]:
        response = obj.get("response")
        if not isinstance(response, dict):
            return {}
        if self.rewriter is not None:
            self.rewriter.learn(response.get("id"))
        status = response.get("status")
        self.status = status if isinstance(status, str) else self.status
        usage = responses_usage(response.get("usage"))
        if usage is not None:
            self.usage = usage
        return response
