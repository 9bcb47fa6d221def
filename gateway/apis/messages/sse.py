"""Observe an Anthropic Messages answer, streamed or whole, while it passes through untouched.

The stream is Anthropic's: ``event: <type>`` plus ``data: {"type": <type>, ...}``
per event, ``message_start`` .. ``content_block_start/_delta/_stop`` ..
``message_delta`` (stop reason, final usage) .. ``message_stop``, with ``ping``
and ``error`` possible anywhere. There is no ``[DONE]``: ``message_stop`` ends
a clean stream. Framing, the event-size bound and the failure rules are the
chat observer's (``gateway.proxy.sse.StreamObserver``); only reading an event differs.

Usage arrives as vLLM 0.33 builds it (``anthropic/serving.py``
``_build_anthropic_usage``): ``input_tokens`` is the *uncached* part of the
prompt, ``cache_read_input_tokens`` the prefix-cache hit and
``cache_creation_input_tokens`` the tokens newly written to the cache, the two
cache fields absent when the replica runs without
``--enable-prompt-tokens-details``. The gateway's ``Usage`` counts the whole
prompt and its cached part, as chat's ``prompt_tokens`` and ``cached_tokens``
do, so metrics and routing feedback read the same on both routes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar


from gateway.errors import GatewayError
from .shape import ANTHROPIC_SHAPE
from gateway.proxy.sse import StreamObserver, Usage, _int_or_none

__all__ = ["MessagesObserver", "WholeMessage", "anthropic_usage", "whole_message"]


def anthropic_usage(usage: Any) -> Usage | None:
    """Anthropic usage as kvgate's ``Usage``: the whole prompt, its cached part, the output."""
    if not isinstance(usage, dict):
        return None
    uncached = _int_or_none(usage.get("input_tokens"))
    read = _int_or_none(usage.get("cache_read_input_tokens"))
    created = _int_or_none(usage.get("cache_creation_input_tokens"))
    prompt = None if uncached is None else uncached + (read or 0) + (created or 0)
    return Usage(prompt, _int_or_none(usage.get("output_tokens")), read)


class MessagesObserver(StreamObserver):
    """``StreamObserver`` for Anthropic events: ``message_stop`` is the end, ``error`` a failure."""

    DONE_MARKER: ClassVar[bytes | None] = None  # Anthropic streams end on message_stop

    def __init__(self) -> None:
        super().__init__("messages", strip_usage_chunk=False)
        # message_start carries the prompt, message_delta the totals (and vLLM's cache
        # figures); a field a later event leaves out keeps its earlier value.
        self._usage_fields: dict[str, Any] = {}

    def error_event(self, err: GatewayError) -> bytes:
        return ANTHROPIC_SHAPE.event(err)  # what the anthropic SDK raises from its stream iterator

    def _take_usage(self, usage: Any) -> None:
        if isinstance(usage, dict):
            self._usage_fields.update((k, v) for k, v in usage.items() if v is not None)
            self.usage = anthropic_usage(self._usage_fields)

    def _on_event(self, obj: dict[str, Any]) -> bool:
        if not isinstance(obj.get("type"), str):
            self.failure = "upstream sent a malformed SSE event"
            return False
        kind = obj["type"]
        if kind == "error":
            err = obj.get("error")
            self.upstream_error = err if isinstance(err, dict) else {"message": str(err)}
            self.failure = "upstream reported an error mid-stream"
            return True  # the client sees the replica's own error event
        if kind == "content_block_delta":
            delta = obj.get("delta")
            if isinstance(delta, dict) and delta.get("type") == "text_delta" and isinstance(delta.get("text"), str):
                self._text.append(delta["text"])
        elif kind == "content_block_start":
            block = obj.get("content_block")
            if isinstance(block, dict) and block.get("type") == "tool_use":
                self.has_tool_calls = True
        elif kind == "message_start":
            message = obj.get("message")
            if isinstance(message, dict):
                self._take_usage(message.get("usage"))
        elif kind == "message_delta":
            self._take_usage(obj.get("usage"))
            delta = obj.get("delta")
            reason = delta.get("stop_reason") if isinstance(delta, dict) else None
            if isinstance(reason, str):
                self.finish_reason = reason
        elif kind == "message_stop":
            self.done = True
        return True


@dataclass(frozen=True, slots=True)
class WholeMessage:
    usage: Usage | None
    text: str
    finish_reason: str | None
    has_tool_calls: bool


def whole_message(obj: dict[str, Any]) -> WholeMessage:
    """What the gateway keeps from a non-streamed ``message`` object."""
    content = obj.get("content")
    blocks = [b for b in content if isinstance(b, dict)] if isinstance(content, list) else []
    text = "".join(b["text"] for b in blocks if b.get("type") == "text" and isinstance(b.get("text"), str))
    reason = obj.get("stop_reason")
    return WholeMessage(anthropic_usage(obj.get("usage")), text, reason if isinstance(reason, str) else None,
                        any(b.get("type") == "tool_use" for b in blocks))
