"""Observe an upstream SSE stream event by event while it passes through.

The relay forwards every complete event as soon as its terminating blank line
arrives, untouched, except one: the usage-only chunk kvgate asked for on the
client's behalf (``stream_options.include_usage``) when the client did not ask
for it itself. Along the way it keeps what the gateway needs afterwards: usage
(prompt, completion and cached tokens), the text of choice 0 and its
``finish_reason`` (for the semantic cache), whether ``[DONE]`` arrived, and
whether the stream went bad. A malformed event, an ``error`` payload or an
oversized event ends the relay; nothing from a bad stream is ever cached.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import orjson

from gateway.errors import GatewayError, sse_error_event

_SEPARATORS = (b"\n\n", b"\r\n\r\n")


@dataclass(slots=True)
class Usage:
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None

    @classmethod
    def from_obj(cls, usage: Any) -> "Usage | None":
        if not isinstance(usage, dict):
            return None
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return cls(
            prompt_tokens=_int_or_none(usage.get("prompt_tokens")),
            completion_tokens=_int_or_none(usage.get("completion_tokens")),
            cached_tokens=_int_or_none(cached),
        )


def _int_or_none(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


@dataclass(slots=True)
class StreamObserver:
    """Feeds on upstream bytes, returns the bytes to forward to the client."""

    # The data line that ends a stream (OpenAI's protocols); None: the protocol has none.
    DONE_MARKER: ClassVar[bytes | None] = b"[DONE]"

    endpoint: str  # "chat" | "completions"
    strip_usage_chunk: bool
    max_event_bytes: int = 4 * 1024 * 1024
    usage: Usage | None = None
    done: bool = False
    failure: str | None = None  # why the stream went bad, if it did
    upstream_error: dict[str, Any] | None = None
    finish_reason: str | None = None
    has_tool_calls: bool = False
    events: int = 0
    # Set by admission (``stages.hand_on_early``): the tokens the answer may still carry
    # (its max_tokens), and what to call when one is left.
    tokens_left: int | None = None
    on_last_step: Callable[[], None] | None = None
    _buf: bytearray = field(default_factory=bytearray)
    _text: list[str] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self._text)

    @property
    def complete(self) -> bool:
        """A clean, finished stream: [DONE] seen, a finish_reason, no failure."""
        return self.done and self.failure is None and self.finish_reason is not None

    def feed(self, chunk: bytes) -> bytes:
        """Returns the complete events to forward now (possibly b"")."""
        if self.failure is not None or self.done:
            return b""
        buf = self._buf
        buf += chunk
        out = bytearray()
        start = 0
        while True:
            end, sep_len = _find_separator(buf, start)
            if end < 0:
                break
            event = bytes(buf[start:end + sep_len])
            start = end + sep_len
            if self._keep(event[:-sep_len]):
                out += event
            if self.failure is not None or self.done:
                break
        del buf[:start]
        if len(buf) > self.max_event_bytes and self.failure is None:
            self.failure = "upstream sent an oversized SSE event"
            buf.clear()
        return bytes(out)

    def error_event(self, err: GatewayError) -> bytes:
        """The event that ends a stream kvgate cuts short, in the protocol's own shape."""
        return sse_error_event(err)

    def finish(self) -> None:
        """Upstream closed. Anything left unterminated means the stream was cut."""
        if self.failure is None and not self.done:
            self.failure = "upstream closed the stream before it finished"

    def _keep(self, event: bytes) -> bool:
        """Whether to forward ``event``: what carries no data passes, the done marker ends
        the stream, each JSON object goes to ``_on_event``; anything else is malformed."""
        data = _event_data(event)
        if data is None:  # comments / keep-alives / non-data fields pass through
            return True
        if data == self.DONE_MARKER:
            self.done = True
            return True
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            obj = None
        if not isinstance(obj, dict):
            self.failure = "upstream sent a malformed SSE event"
            return False
        self.events += 1
        return self._on_event(obj)

    def _on_event(self, obj: dict[str, Any]) -> bool:
        """One event of the protocol (a chat or completions chunk here); whether to forward it."""
        if "error" in obj:
            self.upstream_error = obj["error"] if isinstance(obj["error"], dict) else {"message": str(obj["error"])}
            self.failure = "upstream reported an error mid-stream"
            return True  # the client sees the replica's own error event
        return self._observe(obj)

    def _observe(self, obj: dict[str, Any]) -> bool:
        usage = Usage.from_obj(obj.get("usage"))
        if usage is not None:
            self.usage = usage
        choices = obj.get("choices")
        if not choices:
            # The usage-only chunk (choices: []) exists because we injected include_usage.
            return not (self.strip_usage_chunk and usage is not None and choices == [])
        if isinstance(choices, list):
            for choice in choices:
                if isinstance(choice, dict) and choice.get("index", 0) == 0:
                    self._observe_choice(choice)
        return True

    def _observe_choice(self, choice: dict[str, Any]) -> None:
        token = False
        if self.endpoint == "chat":
            delta = choice.get("delta")
            if isinstance(delta, dict):
                content = delta.get("content")
                if isinstance(content, str):
                    self._text.append(content)
                    token = bool(content)
                if delta.get("tool_calls"):
                    self.has_tool_calls = token = True
                token = token or bool(delta.get("reasoning_content") or delta.get("reasoning"))
        else:
            text = choice.get("text")
            if isinstance(text, str):
                self._text.append(text)
                token = bool(text)
        if token and self.tokens_left is not None:
            self._count_token()
        reason = choice.get("finish_reason")
        if isinstance(reason, str):
            self.finish_reason = reason

    def _count_token(self) -> None:
        # A chunk that carries text carries at least one token (several with speculative decoding
        # or a stream interval), so counting chunks can only find the last step late, never early.
        left = self.tokens_left = (self.tokens_left or 0) - 1
        if left == 1 and self.on_last_step is not None:
            on_last_step, self.on_last_step = self.on_last_step, None
            on_last_step()


def _find_separator(buf: bytearray, start: int) -> tuple[int, int]:
    best, best_len = -1, 0
    for sep in _SEPARATORS:
        i = buf.find(sep, start)
        if i >= 0 and (best < 0 or i < best):
            best, best_len = i, len(sep)
    return best, best_len


def _event_data(event: bytes) -> bytes | None:
    """The concatenated data: lines of one event, or None if it has none."""
    parts = []
    for line in event.splitlines():
        if line.startswith(b"data:"):
            value = line[5:]
            parts.append(value[1:] if value.startswith(b" ") else value)
    if not parts:
        return None
    return b"\n".join(parts)
