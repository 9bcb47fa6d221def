"""The public ASGI app: OpenAI routes, health, readiness and metrics.

``build_app(settings)`` returns a Starlette app whose lifespan starts and stops
one ``Runtime``. The proxy routes are raw ASGI endpoints (no BaseHTTPMiddleware
anywhere near a stream); the few middleware layers are assembled in
``_middleware`` so their order is visible in one place.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, AsyncIterator

import httpx
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .errors import BadRequest, GatewayError, NotFound, error_payload
from .middleware import middleware_stack
from .proxy import ProxyEndpoint
from .runtime import Runtime
from .settings import Settings


def _error_response(err: GatewayError, request: Request | None = None) -> Response:
    return Response(error_payload(err), status_code=err.status, media_type="application/json",
                    headers=err.headers)


async def _http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        return _error_response(NotFound(f"unknown route {request.url.path}", code="unknown_route"))
    if exc.status_code == 405:
        err = BadRequest(f"method {request.method} not allowed on {request.url.path}", code="method_not_allowed")
        err.status = 405
        return _error_response(err)
    return _error_response(BadRequest(str(exc.detail)))


def _routes(rt: Runtime) -> list[Route]:
    async def models(request: Request) -> Response:
        created = int(time.time())
        data = [{"id": m, "object": "model", "created": created, "owned_by": "kvgate"}
                for m in rt.pool.models(healthy_only=True)]
        return JSONResponse({"object": "list", "data": data})

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(request: Request) -> Response:
        ready, body = rt.readiness()
        return JSONResponse(body, status_code=200 if ready else 503)

    async def metrics(request: Request) -> Response:
        return Response(rt.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return [
        Route("/v1/chat/completions", ProxyEndpoint("chat", rt), methods=["POST"]),
        Route("/v1/completions", ProxyEndpoint("completions", rt), methods=["POST"]),
        Route("/v1/embeddings", ProxyEndpoint("embeddings", rt), methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]


def build_app(settings: Settings, *, runtime: Runtime | None = None,
              client: httpx.AsyncClient | None = None, config_path: str | None = None) -> Starlette:
    rt = runtime or Runtime(settings, client=client, config_path=config_path)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, Any]]:
        await rt.start()
        try:
            yield {"runtime": rt}
        finally:
            await rt.stop()

    app = Starlette(routes=_routes(rt), lifespan=lifespan, middleware=middleware_stack(),
                    exception_handlers={HTTPException: _http_exception})
    app.state.runtime = rt
    return app
