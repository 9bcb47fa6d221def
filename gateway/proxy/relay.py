"""Relay an open upstream response to the client: streamed event by event, or whole.

Streaming: the client's response starts only when the first upstream event
arrives (so a replica that never produces a first token becomes a clean 504,
not a broken stream, and one that fails before it is retried: the wait is in
the retry loop, ``first_event``); after that every complete event is forwarded
the moment it arrives. A failure after the first byte keeps what was sent and ends with
one error event — never an invented ``finish_reason`` or ``[DONE]``.

``on_complete`` runs once the answer is whole and before the client gets its
final bytes (``[DONE]``, or the whole non-streamed body): the semantic cache
writes the answer there, so a repeat sent the moment they arrive can be served.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

import httpx
import orjson

from .asgi_io import Exchange
from gateway.errors import UpstreamError, UpstreamTimeout
from .first_event import Head, NoFirstEvent, next_chunk, read_first_event
from .sse import StreamObserver, Usage

SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    # Tell nginx-style buffering proxies in front of us to pass tokens through.
    (b"x-accel-buffering", b"no"),
]


@dataclass(slots=True)
class Outcome:
    """What the gateway learned from one served request."""

    usage: Usage | None = None
    text: str = ""
    finish_reason: str | None = None
    complete: bool = False  # a whole, successful answer: the only kind ever cached
    has_tool_calls: bool = False
    ttft_s: float | None = None
    failure: str | None = None
    raw: bytes | None = None  # non-streaming body, for the cache


OnComplete = Callable[[Outcome], Awaitable[None]]
# Reads a whole (non-streamed) answer's JSON object into the outcome: usage, text, finish.
WholeObserver = Callable[[dict[str, Any], Outcome], None]


def _observed(outcome: Outcome, observer: StreamObserver) -> Outcome:
    outcome.usage = observer.usage
    outcome.text = observer.text
    outcome.finish_reason = observer.finish_reason
    outcome.complete = observer.complete
    outcome.has_tool_calls = observer.has_tool_calls
    outcome.failure = observer.failure
    return outcome


def _stall_deadline(response: httpx.Response, stall_s: float) -> float | None:
    """After the first token the deadline between chunks is ``stall_s``. kvgate's own
    transport applies it natively (cheaper than a timer per chunk); any other
    transport gets an asyncio timeout per chunk."""
    stream = response.stream
    if hasattr(stream, "read_timeout"):
        stream.read_timeout = stall_s
        return None
    return stall_s


async def _drain(it: AsyncIterator[bytes], limit: int = 64 * 1024) -> None:
    """Read the few bytes after [DONE] (the chunked terminator) so the connection can be
    reused; without it every streamed request would pay for a new upstream connection."""
    seen = 0
    try:
        async with asyncio.timeout(0.5):
            async for chunk in it:
                seen += len(chunk)
                if seen > limit:
                    return
    except (TimeoutError, httpx.HTTPError):
        return


async def open_stream(response: httpx.Response, observer: StreamObserver, first_byte_s: float) -> Head:
    """The first event of a stream whose retry loop did not wait for it (``UpstreamCall.first``
    unset). Nothing was sent yet, so failures are plain HTTP errors."""
    try:
        return await read_first_event(response, observer, first_byte_s)
    except TimeoutError:
        raise UpstreamTimeout("replica produced no first token in time") from None
    except NoFirstEvent as e:
        raise UpstreamError(str(e)) from None
    except httpx.HTTPError:
        raise UpstreamError("replica failed before the first token") from None


async def relay_stream(
    response: httpx.Response, head: Head, exchange: Exchange, *, stall_s: float, started_at: float,
    on_complete: OnComplete | None = None, on_first: Callable[[], None] | None = None,
) -> Outcome:
    """``head``: the stream's first event, in hand (``first_event``); the client's response starts here."""
    outcome = Outcome()
    observer, it, pending = head.observer, head.chunks, head.pending
    outcome.ttft_s = head.at - started_at
    if on_first is not None:
        on_first()
    await exchange.start(200, SSE_HEADERS)
    if observer.done and on_complete is not None:  # the whole answer came in one chunk
        await on_complete(_observed(outcome, observer))
    await exchange.body(pending)
    per_chunk = _stall_deadline(response, stall_s)
    try:
        while observer.failure is None and not observer.done:
            chunk = await next_chunk(it, per_chunk)
            if chunk is None:
                observer.finish()
                break
            out = observer.feed(chunk)
            if observer.done and on_complete is not None:  # [DONE] is in ``out``
                await on_complete(_observed(outcome, observer))
            if out:
                await exchange.body(out)
    except TimeoutError:
        observer.failure = "replica stalled mid-stream"
    except httpx.HTTPError:
        observer.failure = "replica connection failed mid-stream"
    if observer.failure is not None and observer.upstream_error is None:
        await exchange.body(observer.error_event(UpstreamError(observer.failure)))
    await exchange.body(b"", more=False)
    if observer.done and observer.failure is None:
        await _drain(it)
    return _observed(outcome, observer)


async def relay_whole(
    response: httpx.Response, exchange: Exchange, *, endpoint: str, timeout_s: float,
    max_bytes: int = 64 * 1024 * 1024, on_complete: OnComplete | None = None, observe: WholeObserver | None = None,
) -> Outcome:
    """``observe`` reads the answer (another API's wire); by default the chat family's ``choices``."""
    body, obj = await read_whole(response, timeout_s=timeout_s, max_bytes=max_bytes)
    outcome = Outcome(usage=Usage.from_obj(obj.get("usage")), raw=body)
    if observe is None:
        observe_choices(obj, endpoint, outcome)
    else:
        observe(obj, outcome)
    if on_complete is not None:
        await on_complete(outcome)
    await exchange.json(200, body)
    return outcome


async def read_raw(response: httpx.Response, *, timeout_s: float, max_bytes: int = 64 * 1024 * 1024) -> bytes:
    """A whole non-streamed answer's bytes, bounded in time and size."""
    raw = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in response.aiter_raw():
                raw += chunk
                if len(raw) > max_bytes:
                    raise UpstreamError("replica answer is too large")
    except TimeoutError:
        raise UpstreamTimeout("replica did not answer in time") from None
    except httpx.HTTPError:
        raise UpstreamError("replica connection failed") from None
    return bytes(raw)


async def read_whole(response: httpx.Response, *, timeout_s: float,
                     max_bytes: int = 64 * 1024 * 1024) -> tuple[bytes, dict[str, Any]]:
    """A whole non-streamed answer: its bytes and its JSON object (anything else is a 502)."""
    body = await read_raw(response, timeout_s=timeout_s, max_bytes=max_bytes)
    try:
        obj: Any = orjson.loads(body)
    except orjson.JSONDecodeError:
        obj = None
    if not isinstance(obj, dict):
        raise UpstreamError("replica sent an invalid answer")
    return body, obj


def observe_choices(obj: dict[str, Any], endpoint: str, outcome: Outcome) -> None:
    """A chat, completions or embeddings answer: the first choice's text and finish reason."""
    choices = obj.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return
    choice = choices[0]
    if endpoint == "chat":
        message = choice.get("message")
        if isinstance(message, dict):
            content = message.get("content")
            outcome.text = content if isinstance(content, str) else ""
            outcome.has_tool_calls = bool(message.get("tool_calls"))
    else:
        text = choice.get("text")
        outcome.text = text if isinstance(text, str) else ""
    reason = choice.get("finish_reason")
    outcome.finish_reason = reason if isinstance(reason, str) else None
    outcome.complete = outcome.finish_reason is not None and len(choices) == 1
