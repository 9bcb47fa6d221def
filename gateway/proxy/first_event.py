"""A stream's first event, awaited inside the retry loop, before the client sees anything.

vLLM sends a stream's response headers before its first token. A replica can therefore
die, drop the connection or send garbage after its ``200`` and before any event. Until
the first event is in hand, nothing has reached the client: the client's response starts
at that event (``relay.relay_stream``). So that failure is retried like one before the
headers. The wait is part of the retry loop (``upstream.open_upstream``, and through it the
P/D decode leg), and the relay starts from the event found there (``Head``).

What counts as the first event is the observer's to say: ``feed`` returns nothing until there is
something to forward. The Responses API's observer holds back the lifecycle events vLLM sends
before prefill (``response.created``, ``response.in_progress``), so its first event is the first
after them, and they go out with it (``gateway.apis.responses.sse``).

Nothing beyond the first event is read ahead. The relay gets the event at the moment it
arrived and forwards it at once, so the client's time to first token is what it was. The
event is parsed once, by the observer that then reads the rest of the stream. Each attempt
gets a fresh observer (``FirstEvent.observer``): one that fed on a failed replica's bytes
is dropped with them.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

import httpx

from .sse import StreamObserver

__all__ = ["FirstEvent", "Head", "NoFirstEvent", "media_type", "next_chunk", "read_first_event"]


@dataclass(frozen=True, slots=True)
class FirstEvent:
    """What a streamed call waits for before an attempt counts as open (``UpstreamCall.first``)."""

    observer: Callable[[str], StreamObserver]  # a fresh observer for an attempt on the replica named
    timeout_s: float  # the wait for each chunk until the first event (``timeouts.first_byte_s``)
    # Content types of a 200 that is not a stream, relayed as it comes (a transcription's: whether it
    # streams is the replica's to say). Any other 200 is read as an event stream.
    whole: frozenset[str] = frozenset()

    def awaited(self, response: httpx.Response) -> bool:
        """Whether ``response`` is one whose first event is awaited: a 200 that is not ``whole``."""
        if response.status_code != 200:
            return False
        if not self.whole:
            return True
        return media_type(response) not in self.whole


@dataclass(slots=True)
class Head:
    """An open stream's first event, in hand and not yet sent to the client."""

    observer: StreamObserver  # the one that read it, and reads the rest
    chunks: AsyncIterator[bytes]  # the rest of the body, from where the first event ended
    pending: bytes  # what the client gets first: the first event (with any held before it, and any
    # complete ones in its chunk)
    at: float  # ``time.perf_counter()`` when it arrived


def media_type(response: httpx.Response) -> str:
    """The response's content type without its parameters, lower case."""
    return response.headers.get("content-type", "").split(";", 1)[0].strip().lower()


class NoFirstEvent(Exception):
    """The replica ended the stream, or sent something that is not an event stream, before its
    first event (a 200 ``text/html`` from an ingress answering for it, a malformed event)."""


async def next_chunk(it: AsyncIterator[bytes], timeout_s: float | None) -> bytes | None:
    """The next upstream chunk, None at the end. ``timeout_s`` None: the transport enforces the
    deadline. A timeout is ``TimeoutError`` whichever enforced it."""
    try:
        if timeout_s is None:
            return await it.__anext__()
        async with asyncio.timeout(timeout_s):
            return await it.__anext__()
    except StopAsyncIteration:
        return None
    except httpx.ReadTimeout:
        raise TimeoutError from None


async def read_first_event(response: httpx.Response, observer: StreamObserver, timeout_s: float) -> Head:
    """Read ``response`` until ``observer`` has an event to forward. Raises ``TimeoutError`` (none
    in time), ``httpx.HTTPError`` (the connection failed; ``transport.ReplicaGone`` if the replica is
    gone) or ``NoFirstEvent``. The caller closes the response on any of them."""
    chunks = response.aiter_raw().__aiter__()
    pending = b""
    # kvgate's transport: a drop before the first event, after bytes the observer held back, tells
    # whether the replica is gone too (``transport.ReplicaGone``).
    stream: Any = response.stream
    probed = hasattr(stream, "awaiting_first_event")
    if probed:
        stream.awaiting_first_event = True
    try:
        while not pending:
            chunk = await next_chunk(chunks, timeout_s)
            if chunk is None:
                observer.finish()
                raise NoFirstEvent("replica closed the stream before the first token")
            pending = observer.feed(chunk)
            if observer.failure and not pending:
                raise NoFirstEvent("replica sent an invalid stream")
    finally:
        if probed:
            stream.awaiting_first_event = False
    return Head(observer, chunks, pending, time.perf_counter())
