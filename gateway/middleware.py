"""Pure ASGI middleware, and the one function that stacks them in order."""

from __future__ import annotations

from typing import Any

from gateway.proxy.asgi_io import Receive, Scope, Send, request_id
from .errors import GatewayError, ShapeByPath

MAX_HEADER_BYTES = 60 * 1024
MAX_HEADERS = 100


class HeaderLimits:
    """431 for requests whose headers exceed Envoy's defaults (60 KiB / 100 headers), in the
    shape of the API whose path it is (``shapes``)."""

    def __init__(self, app: Any, max_bytes: int = MAX_HEADER_BYTES, max_count: int = MAX_HEADERS,
                 shapes: ShapeByPath | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_count = max_count
        self.shapes = shapes or ShapeByPath()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = scope["headers"]
            if len(headers) > self.max_count or sum(map(len, map(b"".join, headers))) > self.max_bytes:
                err = GatewayError("request headers are too large", code="headers_too_large")
                err.status, err.type = 431, "invalid_request_error"
                body = self.shapes(scope.get("path", "")).payload(err)
                await send({"type": "http.response.start", "status": 431,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode()),
                                        (b"connection", b"close")]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


class RequestId:
    """Every response carries x-request-id: the client's if it is a short safe token, else ours
    (and ``extra``: the worker's number when there are several).

    The id is put in the scope so the proxy and its logs use the same one.
    """

    def __init__(self, app: Any, extra: tuple[tuple[bytes, bytes], ...] = ()) -> None:
        self.app = app
        self.extra = extra

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        client_value = None
        for k, v in scope["headers"]:
            if k == b"x-request-id":
                client_value = v.decode("latin-1")
        rid = request_id(client_value)
        scope["kvgate.request_id"] = rid
        header = (b"x-request-id", rid.encode())

        async def send_with_id(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), header, *self.extra]
            await send(message)

        await self.app(scope, receive, send_with_id)


def middleware_stack(app: Any, worker: int | None = None, shapes: ShapeByPath | None = None) -> Any:
    """The middleware around every HTTP request, outermost first. Kept tiny: anything
    per-request beyond these lives in the proxy endpoint. A worker of several names itself
    in x-kvgate-worker on every response, so a slow or failing one can be told apart."""
    extra = () if worker is None else ((b"x-kvgate-worker", str(worker).encode()),)
    return RequestId(HeaderLimits(app, shapes=shapes), extra)
