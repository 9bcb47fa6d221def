"""uvicorn's HTTP protocol with a deadline on request headers (slowloris defence).

uvicorn bounds idle keep-alive connections but not a client that trickles its
request head one byte at a time: a thousand such connections would hold a
thousand sockets forever. Here every request head must be complete within
``header_timeout_s`` of its first byte (or of the connection opening); a late
one is dropped. The body deadline is enforced in ``asgi_io.read_body``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class _DeadlineProtocol(HttpToolsProtocol):
    header_timeout_s: float = 10.0
    _header_timer: asyncio.TimerHandle | None = None

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._expire)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _expire(self) -> None:
        self._header_timer = None
        if self.transport is not None and not self.transport.is_closing():
            self.transport.abort()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)


def protocol_with_header_deadline(header_timeout_s: float) -> Any:
    return type("KvgateHttpProtocol", (_DeadlineProtocol,), {"header_timeout_s": header_timeout_s})
