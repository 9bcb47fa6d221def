"""A lean HTTP/1.1 transport for httpx, for the plain-HTTP hop to the replicas.

Why not httpx's default transport: per proxied request, httpcore + h11 + anyio
cost several times what the rest of the gateway does (measured with
``bench/overhead.py``), mostly in layers of generic machinery and one socket
write per request part. This transport keeps the seam the rest of kvgate codes
against (an ``httpx.AsyncClient``; tests can still plug in any transport) and
does only what the replica hop needs: keep-alive connections per origin, the
request written in one ``write``, the response parsed by httptools (C), the
body streamed chunk by chunk with back-pressure, and a connection that is not
cleanly finished closed rather than reused (so vLLM sees a client that went
away and aborts the request), and a connection lost before any byte of an
answer followed by a new one, whose fate says whether the replica is still
there (``ReplicaGone``). HTTPS origins fall back to httpx's own transport.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any, AsyncIterator

import httptools
import httpx

# Sent on every upstream request. identity: bytes are relayed as they come.
UPSTREAM_HEADERS = {"accept-encoding": "identity", "user-agent": "kvgate"}
_HIGH_WATER = 1 << 20  # pause reading from the replica above this much unconsumed body
_LOW_WATER = 1 << 16


class ReplicaGone(httpx.ReadError):
    """A replica lost a connection with a request on it, before any byte of its answer (or before a
    stream's first event: ``_Body.awaiting_first_event``), and a new connection to it failed at
    once: nothing listens there any more (it crashed, was killed or stopped). What it was doing for
    the request went with it (``upstream.take_retry`` says why that matters). A ``ReadError``: the
    request was written, and may have arrived before it went."""


class _Conn(asyncio.Protocol):
    """One keep-alive connection; parses one response at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.headers: list[tuple[bytes, bytes]] = []
        self.status = 0
        self.head_ready: asyncio.Future[None] | None = None
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.wakeup: asyncio.Future[None] | None = None
        self.complete = False
        self.keep_alive = True
        self.lost: BaseException | None = None
        self.closed = False
        self.received_any = False
        self.paused = False

    # -- asyncio.Protocol --------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.received_any = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(httpx.RemoteProtocolError("replica tried to upgrade the connection"))
        except httptools.HttpParserError as e:
            self._fail(httpx.RemoteProtocolError(f"replica sent invalid HTTP: {e}"))

    def connection_lost(self, exc: BaseException | None) -> None:
        self.closed = True
        if not self.complete:
            self._fail(httpx.RemoteProtocolError("replica closed the connection") if exc is None
                       else httpx.ReadError(str(exc) or "connection lost"))

    # -- httptools callbacks ----------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        if self.head_ready is not None and not self.head_ready.done():
            self.head_ready.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > _HIGH_WATER and self.transport is not None and not self.paused:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self._wake()

    # -- helpers -------------------------------------------------------------
    def _fail(self, exc: BaseException) -> None:
        if self.lost is None:
            self.lost = exc
        if self.head_ready is not None and not self.head_ready.done():
            self.head_ready.set_exception(exc)
        self._wake()
        self.close()

    def _wake(self) -> None:
        if self.wakeup is not None and not self.wakeup.done():
            self.wakeup.set_result(None)

    def reset(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.headers = []
        self.status = 0
        self.chunks.clear()
        self.buffered = 0
        self.complete = False
        self.received_any = False
        self.head_ready = asyncio.get_running_loop().create_future()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    async def next_chunk(self, timeout: float | None) -> bytes | None:
        """The next body chunk, None at the end. A timer is armed only when we must
        wait: per-chunk ``asyncio.timeout`` was a measurable share of streaming cost."""
        while True:
            if self.chunks:
                chunk = self.chunks.popleft()
                self.buffered -= len(chunk)
                if self.paused and self.buffered < _LOW_WATER and self.transport is not None:
                    self.paused = False
                    self.transport.resume_reading()
                return chunk
            if self.complete:
                return None
            if self.lost is not None:
                raise self.lost
            loop = asyncio.get_running_loop()
            wakeup = self.wakeup = loop.create_future()
            timer = loop.call_later(timeout, _expire, wakeup) if timeout is not None else None
            try:
                await wakeup
            finally:
                if timer is not None:
                    timer.cancel()


def _expire(wakeup: asyncio.Future[None]) -> None:
    if not wakeup.done():
        wakeup.set_exception(httpx.ReadTimeout("replica sent nothing in time"))


class _Body(httpx.AsyncByteStream):
    def __init__(self, pool: "LeanTransport", key: tuple[str, int], conn: _Conn, timeouts: dict[str, Any]) -> None:
        self.pool, self.key, self.conn = pool, key, conn
        self.read_timeout: float | None = timeouts.get("read")
        self.connect_timeout: float | None = timeouts.get("connect")
        self.released = False
        # Set while a stream's first event is awaited (``first_event.read_first_event``): a drop is
        # then probed even after some of the body (the Responses API's lifecycle events, held back).
        self.awaiting_first_event = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        # read_timeout is read on every chunk: the relay shortens it once the first token is in.
        conn = self.conn
        received = False
        while True:
            try:
                chunk = await conn.next_chunk(self.read_timeout)
            except httpx.TimeoutException:
                raise
            except httpx.HTTPError as e:
                if not received or self.awaiting_first_event:
                    # Lost after the headers and before any byte of the body or the first event (vLLM
                    # sends a stream's headers before its first token): whether the replica is still
                    # there, as before the headers.
                    await self.pool.after_drop(self.key, e, self.connect_timeout)
                raise
            if chunk is None:
                return
            received = True
            yield chunk

    async def aclose(self) -> None:
        if self.released:
            return
        self.released = True
        conn = self.conn
        if conn.complete and conn.keep_alive and not conn.closed and conn.lost is None:
            self.pool.put_back(self.key, conn)
        else:
            # Not cleanly finished: the replica must see the connection go, so it aborts.
            conn.abort()


class LeanTransport(httpx.AsyncBaseTransport):
    def __init__(self, max_idle_per_origin: int = 256) -> None:
        self.idle: dict[tuple[str, int], list[_Conn]] = {}
        self.max_idle = max_idle_per_origin
        self.fallback = httpx.AsyncHTTPTransport()

    def put_back(self, key: tuple[str, int], conn: _Conn) -> None:
        idle = self.idle.setdefault(key, [])
        if len(idle) < self.max_idle:
            idle.append(conn)
        else:
            conn.close()

    def _take_idle(self, key: tuple[str, int]) -> _Conn | None:
        idle = self.idle.get(key)
        while idle:
            conn = idle.pop()
            if not conn.closed and conn.transport is not None and not conn.transport.is_closing():
                return conn
        return None

    async def _connect(self, host: str, port: int, timeout: float | None) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):
                _, conn = await loop.create_connection(_Conn, host, port)
        except TimeoutError:
            raise httpx.ConnectTimeout(f"connect to {host}:{port} timed out") from None
        except OSError as e:
            raise httpx.ConnectError(f"connect to {host}:{port} failed: {e.strerror or e}") from None
        return conn

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if url.scheme != "http":
            return await self.fallback.handle_async_request(request)
        timeouts: dict[str, Any] = request.extensions.get("timeout", {})
        host, port = url.host, url.port or 80
        key = (host, port)
        payload = _serialize(request, await request.aread())
        conn = self._take_idle(key)
        reused = conn is not None
        for _ in range(2):
            if conn is None:
                conn = await self._connect(host, port, timeouts.get("connect"))
            conn.reset()
            assert conn.transport is not None and conn.head_ready is not None
            conn.transport.write(payload)
            try:
                async with asyncio.timeout(timeouts.get("read")):
                    await conn.head_ready
            except TimeoutError:
                conn.abort()
                raise httpx.ReadTimeout("replica sent no response headers in time") from None
            except httpx.HTTPError as e:
                conn.abort()
                if conn.received_any:
                    raise
                if reused:
                    # A kept-alive connection the replica closed while idle: sent again, once, on the new one.
                    conn = await self._reconnect(key, e, timeouts.get("connect"))
                    reused = False
                    continue
                await self.after_drop(key, e, timeouts.get("connect"))
                raise
            except BaseException:
                conn.abort()
                raise
            return httpx.Response(conn.status, headers=conn.headers, stream=_Body(self, key, conn, timeouts),
                                  extensions={"http_version": b"HTTP/1.1"}, request=request)
        raise httpx.RemoteProtocolError("replica closed the connection")  # pragma: no cover

    async def _reconnect(self, key: tuple[str, int], dropped: httpx.HTTPError, timeout: float | None) -> _Conn:
        """A new connection to a replica that dropped one with a request on it, before any byte of its
        answer (or of its body, after its headers: ``_Body``). Refused (or impossible: ``ConnectError``):
        the replica is gone, and ``ReplicaGone`` says so. A timeout proves nothing (an overloaded replica
        is slow to accept too): the drop is raised. Either way the drop, not the connect's error: the
        request was written and may have arrived, and a caller that must not send it twice
        (``upstream.UpstreamCall.once``) must know it."""
        try:
            return await self._connect(*key, timeout)
        except httpx.ConnectError:
            raise ReplicaGone(f"{dropped}; a new connection failed: the replica is gone") from None
        except httpx.HTTPError:
            raise dropped from None

    async def after_drop(self, key: tuple[str, int], dropped: httpx.HTTPError, timeout: float | None) -> None:
        """Raises ``ReplicaGone`` if the replica that dropped a connection is gone (``_reconnect``); else
        returns, the new connection kept for the next request, and the caller raises the drop."""
        self.put_back(key, await self._reconnect(key, dropped, timeout))

    async def aclose(self) -> None:
        for conns in self.idle.values():
            for conn in conns:
                conn.close()
        self.idle.clear()
        await self.fallback.aclose()


def _serialize(request: httpx.Request, body: bytes) -> bytes:
    url = request.url
    target = url.raw_path
    lines = [request.method.encode() + b" " + target + b" HTTP/1.1"]
    has_host = False
    for name, value in request.headers.raw:
        lower = name.lower()
        if lower == b"host":
            has_host = True
        elif lower in (b"content-length", b"transfer-encoding", b"connection"):
            continue
        lines.append(name + b": " + value)
    if not has_host:
        lines.append(b"host: " + url.netloc)
    lines.append(b"content-length: " + str(len(body)).encode())
    return b"\r\n".join(lines) + b"\r\n\r\n" + body
