"""The public ASGI app: OpenAI routes, health, readiness and metrics.

``build_app(settings)`` returns a Starlette app whose lifespan starts and stops
one ``Runtime``. The proxy routes are raw ASGI endpoints (no BaseHTTPMiddleware
anywhere near a stream); the few middleware layers are assembled in
``_middleware`` so their order is visible in one place.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import time
from typing import Any, AsyncIterator

import httpx
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .errors import BadRequest, GatewayError, NotFound, ShapeByPath
from gateway.admin.operations import readiness
from gateway.apis.messages.endpoint import MessagesEndpoint
from gateway.proxy.asgi_io import Receive, Scope, Send
from .middleware import middleware_stack
from gateway.proxy.endpoint import ProxyEndpoint
from gateway.apis.responses.endpoint import ResponsesEndpoint
from gateway.apis.responses.routes import response_routes
from gateway.apis.utility.routes import utility_endpoints
from .runtime import Runtime
from .settings import Settings
from gateway.server.worker_info import WorkerInfo

try:
    _VERSION = importlib.metadata.version("kvgate")
except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
    _VERSION = "unknown"


# The endpoint classes of the proxy routes: OpenAI's chat family, then each API's subclass.
ENDPOINT_KINDS: tuple[type[ProxyEndpoint], ...] = (ProxyEndpoint, ResponsesEndpoint, MessagesEndpoint)


class _Errors:
    """Errors answered outside a proxy endpoint, in the shape of the API whose path it is:
    under /v1/messages even a wrong route or method answers in Anthropic's shape."""

    def __init__(self, shapes: ShapeByPath) -> None:
        self.shapes = shapes

    def response(self, err: GatewayError, request: Request) -> Response:
        shape = self.shapes(request.url.path)
        headers = err.headers
        if shape.request_id_header is not None and "kvgate.request_id" in request.scope:
            headers = {**headers, shape.request_id_header: request.scope["kvgate.request_id"]}
        return Response(shape.payload(err), status_code=err.status, media_type="application/json", headers=headers)

    async def http_exception(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if exc.status_code == 404:
            return self.response(NotFound(f"unknown route {request.url.path}", code="unknown_route"), request)
        if exc.status_code == 405:
            return await self.method_not_allowed(request)
        return self.response(BadRequest(str(exc.detail)), request)

    async def method_not_allowed(self, request: Request) -> Response:
        err = BadRequest(f"method {request.method} not allowed on {request.url.path}", code="method_not_allowed")
        err.status = 405
        return self.response(err, request)


def _routes(rt: Runtime) -> list[Route]:
    async def models(request: Request) -> Response:
        created = int(time.time())
        data = [{"id": m, "object": "model", "created": created, "owned_by": "kvgate"}
                for m in rt.pool.models(healthy_only=True)]
        return JSONResponse({"object": "list", "data": data})

    async def version(request: Request) -> Response:
        return JSONResponse({"version": _VERSION})  # kvgate's own: replicas may run different vLLMs

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(request: Request) -> Response:
        ready, body = readiness(rt)
        return JSONResponse(body, status_code=200 if ready else 503)

    async def metrics(request: Request) -> Response:
        return Response(await rt.metrics.render_async(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return [
        Route("/v1/models", models, methods=["GET"]),
        Route("/version", version, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]


class KvgateApp:
    """The outermost ASGI callable.

    The OpenAI POST routes go straight to their endpoint: the hot path skips
    Starlette's router and exception middleware (measured at about a fifth of
    kvgate's per-request CPU with ``bench/overhead.py``); every other route, a
    wrong method on a proxy route, and lifespan go to the Starlette app.
    """

    def __init__(self, app: Starlette, endpoints: dict[str, ProxyEndpoint], worker: WorkerInfo | None = None,
                 shapes: ShapeByPath | None = None) -> None:
        self.app = app
        self.state = app.state
        self.endpoints = endpoints
        self.http = middleware_stack(self._dispatch, worker=None if worker is None else worker.id,
                                     shapes=shapes or ShapeByPath())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self.http(scope, receive, send)
        else:
            await self.app(scope, receive, send)  # type: ignore[arg-type]

    async def _dispatch(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = self.endpoints.get(scope["path"]) if scope["method"] == "POST" else None
        if endpoint is not None:
            await endpoint(scope, receive, send)
        else:
            await self.app(scope, receive, send)  # type: ignore[arg-type]


def build_app(settings: Settings, *, runtime: Runtime | None = None, config_path: str | None = None,
              transport: httpx.AsyncBaseTransport | None = None, worker: WorkerInfo | None = None) -> KvgateApp:
    rt = runtime or Runtime(settings, transport=transport, config_path=config_path, worker=worker)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, Any]]:
        await rt.start()
        try:
            yield {"runtime": rt}
        finally:
            await rt.stop()

    endpoints: dict[str, ProxyEndpoint] = {kind.paths[name]: kind(name, rt)
                                           for kind in ENDPOINT_KINDS for name in kind.paths}
    endpoints.update(utility_endpoints(rt))
    shapes = ShapeByPath({kind.claims: kind.shape for kind in ENDPOINT_KINDS if kind.claims is not None})
    errors = _Errors(shapes)
    proxy_routes = [Route(path, errors.method_not_allowed, methods=["GET", "PUT", "PATCH", "DELETE"])
                    for path in endpoints]
    app = Starlette(routes=[*_routes(rt), *proxy_routes, *response_routes(rt)], lifespan=lifespan,
                    exception_handlers={HTTPException: errors.http_exception})
    app.state.runtime = rt
    return KvgateApp(app, endpoints, worker, shapes)
