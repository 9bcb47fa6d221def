"""Thin ASGI helpers for the generation endpoints: read a body, send responses, notice a client leave.

The generation endpoints talk raw ASGI instead of Starlette responses because
they need what those hide: sending each SSE event the moment a token exists,
cancelling generation the moment ``http.disconnect`` arrives (uvicorn's
``send`` silently does nothing once the client is gone, so a writer alone
would never notice), and returning mid-body on purpose so uvicorn drops the
connection (the ``die_after_tokens`` fault).
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, Iterable, MutableMapping

import orjson

__all__ = ["ClientDisconnected", "Sender", "read_body", "run_until_disconnect"]

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Headers = Iterable[tuple[bytes, bytes]]

MAX_BODY_BYTES = 64 * 1024 * 1024


class ClientDisconnected(Exception):
    """The client went away before the request body was complete."""


class BodyTooLarge(Exception):
    pass


async def read_body(receive: Receive, limit: int = MAX_BODY_BYTES) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnected
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


class Sender:
    """Wraps ASGI ``send``; remembers whether the response started and completed."""

    __slots__ = ("_send", "started", "complete")

    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = False
        self.complete = False

    async def start(self, status: int, content_type: bytes, headers: Headers = ()) -> None:
        self.started = True
        await self._send(
            {"type": "http.response.start", "status": status,
             "headers": [(b"content-type", content_type), *headers]}
        )

    async def body(self, data: bytes, more: bool = True) -> None:
        if not more:
            self.complete = True
        await self._send({"type": "http.response.body", "body": data, "more_body": more})

    async def full(self, status: int, data: bytes, content_type: bytes, headers: Headers = ()) -> None:
        await self.start(status, content_type, [(b"content-length", str(len(data)).encode()), *headers])
        await self.body(data, more=False)

    async def json(self, status: int, payload: Any, headers: Headers = ()) -> None:
        await self.full(status, orjson.dumps(payload), b"application/json", headers)


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def run_until_disconnect(work: Awaitable[None], receive: Receive, sender: Sender) -> bool:
    """Run ``work`` unless the client disconnects first; True if it ran to the end.

    A disconnect cancels ``work`` at once, which is what makes the engine abort the
    request and free its blocks. Once the response is complete, uvicorn reports a
    "disconnect" for every receive; that one is not the client leaving, so ``work``
    is left to finish.
    """
    main = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_for_disconnect(receive))
    try:
        await asyncio.wait((main, watch), return_when=asyncio.FIRST_COMPLETED)
        if not main.done() and not sender.complete:
            main.cancel()
        await asyncio.wait((main,))
        if main.cancelled():
            return False
        main.result()
        return True
    finally:
        watch.cancel()
        if not main.done():
            main.cancel()
