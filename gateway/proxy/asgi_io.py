"""Small ASGI helpers for the hot path: read a bounded body, send responses, watch for disconnects."""

from __future__ import annotations

import asyncio
import itertools
import re
import secrets
from typing import Any, Awaitable, Callable, Iterable, TypeVar

import orjson

from gateway.errors import OPENAI_SHAPE, BadRequest, ErrorShape, GatewayError, PayloadTooLarge

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
T = TypeVar("T")

_SAFE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")


# Ids need to be unique, not unguessable: a random per-process prefix and a counter
# cost a fraction of an os.urandom() system call per request.
_ID_PREFIX = "req_" + secrets.token_hex(6)
_ID_COUNTER = itertools.count(1)


def request_id(client_value: str | None) -> str:
    """Keep a client's x-request-id only if it is a short safe token (no log injection)."""
    if client_value and _SAFE_ID.match(client_value):
        return client_value
    return f"{_ID_PREFIX}{next(_ID_COUNTER):010x}"


class ClientDisconnected(Exception):
    """The client went away while we were still reading its request."""


async def read_body(receive: Receive, *, limit: int, content_length: str | None, deadline_s: float) -> bytes:
    """The whole body, counted as it streams in; 413 as soon as it is over the limit."""
    if content_length is not None:
        try:
            declared = int(content_length)
        except ValueError:
            raise BadRequest("invalid Content-Length header", code="invalid_header") from None
        if declared > limit:
            raise PayloadTooLarge(f"request body is larger than the {limit}-byte limit")
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(deadline_s):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise ClientDisconnected()
                chunk = message.get("body", b"")
                if chunk:
                    size += len(chunk)
                    if size > limit:
                        raise PayloadTooLarge(f"request body is larger than the {limit}-byte limit")
                    chunks.append(chunk)
                if not message.get("more_body", False):
                    break
    except TimeoutError:
        raise BadRequest("request body was not received in time", code="body_timeout") from None
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class Exchange:
    """The client side of one request: response status, headers, and whether it has started.

    ``shape`` spells kvgate's errors for this route (OpenAI's unless told otherwise)."""

    __slots__ = ("send", "headers", "started", "status", "bytes_sent", "shape")

    def __init__(self, send: Send, headers: list[tuple[bytes, bytes]], shape: ErrorShape = OPENAI_SHAPE) -> None:
        self.send = send
        self.headers = headers  # sent with every response, errors included
        self.shape = shape
        self.started = False
        self.status = 0
        self.bytes_sent = 0

    def add_header(self, name: str, value: str) -> None:
        self.headers.append((name.encode("latin-1"), value.encode("latin-1")))

    async def start(self, status: int, headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
        self.started = True
        self.status = status
        await self.send({"type": "http.response.start", "status": status, "headers": [*self.headers, *headers]})

    async def body(self, data: bytes, more: bool = True) -> None:
        self.bytes_sent += len(data)
        await self.send({"type": "http.response.body", "body": data, "more_body": more})

    async def json(self, status: int, payload: bytes | Any, headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
        data = payload if isinstance(payload, bytes) else orjson.dumps(payload)
        await self.start(status, [(b"content-type", b"application/json"),
                                  (b"content-length", str(len(data)).encode()), *headers])
        await self.body(data, more=False)

    async def error(self, err: GatewayError) -> None:
        extra = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in err.headers.items()]
        await self.json(err.status, self.shape.payload(err), extra)


async def until_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def run_unless_disconnected(receive: Receive, work: Awaitable[T]) -> tuple[bool, T | None]:
    """Run ``work``; if the client disconnects first, cancel it (closing the upstream).

    Returns (disconnected, result). Cancelling the work task runs its ``finally``
    blocks, which close the upstream response, so vLLM sees the disconnect and
    aborts the request within one event-loop turn.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(until_disconnect(receive))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task.done():
        watcher.cancel()
        return False, task.result()
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):
        pass
    return True, None
