"""The admin REST API, on its own listener (127.0.0.1 by default), behind its own token.

Replicas (list with live load and prefix hit rate; add, drain, remove), tenants
(CRUD, key rotation), caches (statistics, purge), routing, hygiene reports,
trends (the status page's last 15 minutes), savings against round robin and
configuration reload;
``/openapi.json`` describes all of it, and ``/`` serves the status page.

Every request but ``GET /`` (the page's static HTML, which holds no data) must
carry the admin token, unknown paths and the OpenAPI document included: the
check wraps the whole app, so a route added later cannot forget it, and nobody
without the token learns which routes exist. A tenant's API key is recognised
and refused with 403; any other wrong token is 401. Reads are GET; every
mutation is POST, PUT, PATCH or DELETE.
"""

from __future__ import annotations

import hmac
from pathlib import Path
from typing import Any, Awaitable, Callable, Literal

from pydantic import Field, ValidationError, field_validator
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from . import operations
from .bodies import Body as _Body
from .openapi import openapi_document
from .tenants import tenant_routes
from gateway.proxy.asgi_io import Receive, Scope, Send
from gateway.errors import BadRequest, Forbidden, GatewayError, NotFound, Unauthorized, error_payload
from gateway.proxy.pool import snapshot
from .explain import ExplainIn, explain
from gateway.runtime import Runtime
from gateway.settings import ReplicaSettings

STATIC = Path(__file__).parent / "static"
Handler = Callable[[Request], Awaitable[Response]]


class ReplicaIn(_Body):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    url: str
    weight: float = Field(1.0, gt=0, le=1000)
    models: list[str] = Field(default_factory=list, max_length=64)
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    max_in_flight: int | None = Field(None, ge=1, le=1_000_000)
    role: Literal["prefill", "decode", "both"] = "both"

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        return ReplicaSettings(name="x", url=v).url


class PurgeIn(_Body):
    tenant: str | None = Field(None, max_length=64)
    model: str | None = Field(None, max_length=256)
    older_than_s: float | None = Field(None, ge=0, le=10 * 365 * 86400)


class RoutingIn(_Body):
    policy: str | None = Field(None, pattern=r"^(prefix_affinity|ttft|least_load|round_robin|consistent_hash|cost)$")
    epsilon: float | None = Field(None, ge=0, le=10)
    disaggregation: Literal["selective", "always"] | None = None


def _err(err: GatewayError) -> Response:
    return Response(error_payload(err), status_code=err.status, media_type="application/json",
                    headers=err.headers)


async def _json(request: Request, model: type[_Body]) -> Any:
    raw = await request.body()
    if len(raw) > 1024 * 1024:
        raise BadRequest("body too large")
    try:
        return model.model_validate_json(raw or b"{}")
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise BadRequest(f"invalid body: {first['msg']}", param=param) from None


def _guard(handler: Handler) -> Handler:
    """Turns a handler's GatewayError into its OpenAI-shaped response (authorisation is ``_Authorized``)."""
    async def guarded(request: Request) -> Response:
        try:
            return await handler(request)
        except GatewayError as err:
            return _err(err)
    return guarded


def _presented(headers: Headers) -> tuple[str, list[str]]:
    """The bearer token, and every credential the request carries (tenant keys come in three headers)."""
    auth = headers.get("authorization", "")
    bearer = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
    others = [v.strip() for v in (headers.get("x-api-key", ""), headers.get("api-key", "")) if v.strip()]
    return bearer, [bearer, *others] if bearer else others


def _authorize(rt: Runtime, headers: Headers) -> None:
    token = rt.settings.admin.token
    if token is None:
        raise Forbidden("the admin API is disabled: set admin.token", code="admin_disabled")
    bearer, presented = _presented(headers)
    if bearer and hmac.compare_digest(bearer.encode(), token.get_secret_value().encode()):
        return
    if any(operations.is_tenant_key(rt, key) for key in presented):
        raise Forbidden("tenant keys cannot use the admin API")
    raise Unauthorized("missing or invalid admin token", code="invalid_admin_token")


class _Authorized:
    """The admin listener's outermost layer: the admin token, before any routing."""

    def __init__(self, rt: Runtime, app: Starlette) -> None:
        self.rt = rt
        self.app = app
        self.state = app.state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not (scope["path"] == "/" and scope["method"] in ("GET", "HEAD")):
            try:
                _authorize(self.rt, Headers(scope=scope))
            except GatewayError as err:
                await _err(err)(scope, receive, send)  # type: ignore[arg-type]
                return
        await self.app(scope, receive, send)  # type: ignore[arg-type]


def _routes(rt: Runtime) -> list[Route]:
    async def replicas(request: Request) -> Response:
        return JSONResponse({"replicas": snapshot(rt.pool)})

    async def add_replica(request: Request) -> Response:
        body = await _json(request, ReplicaIn)
        if body.name in rt.pool.replicas:
            err = BadRequest(f"replica {body.name!r} already exists", param="name", code="conflict")
            err.status = 409
            raise err
        await operations.add_replica(rt, body.name, body.url, weight=body.weight, models=body.models,
                                     scheduling_policy=body.scheduling_policy, max_in_flight=body.max_in_flight,
                                     role=body.role)
        return JSONResponse(_replica_row(rt, body.name), status_code=201)

    def _named(request: Request) -> str:
        name = request.path_params["name"]
        if name not in rt.pool.replicas:
            raise NotFound(f"no replica named {name!r}", code="replica_not_found")
        return str(name)

    async def get_replica(request: Request) -> Response:
        return JSONResponse(_replica_row(rt, _named(request)))

    async def drain(request: Request) -> Response:
        rt.pool.drain(_named(request), True)
        return JSONResponse(_replica_row(rt, request.path_params["name"]))

    async def undrain(request: Request) -> Response:
        rt.pool.drain(_named(request), False)
        return JSONResponse(_replica_row(rt, request.path_params["name"]))

    async def remove(request: Request) -> Response:
        rt.pool.remove(_named(request))
        rt.sync_kv_events()  # a replica that left is forgotten by the event index too
        return Response(status_code=204)

    async def routing(request: Request) -> Response:
        return JSONResponse(operations.routing_stats(rt))

    async def set_routing(request: Request) -> Response:
        body = await _json(request, RoutingIn)
        operations.set_routing(rt, policy=body.policy, epsilon=body.epsilon, disaggregation=body.disaggregation)
        return JSONResponse(operations.routing_stats(rt))

    async def explain_route(request: Request) -> Response:
        return JSONResponse(await explain(rt, await _json(request, ExplainIn)))

    async def cache(request: Request) -> Response:
        return JSONResponse(operations.cache_stats(rt))

    async def purge(request: Request) -> Response:
        body = await _json(request, PurgeIn)
        removed = await operations.purge_cache(rt, tenant=body.tenant, model=body.model, older_than_s=body.older_than_s)
        return JSONResponse({"removed": removed})

    async def hygiene(request: Request) -> Response:
        return JSONResponse(operations.hygiene_report(rt))

    async def reload(request: Request) -> Response:
        return JSONResponse(await operations.reload_config(rt))

    async def status(request: Request) -> Response:
        return JSONResponse(operations.status(rt))

    async def trends(request: Request) -> Response:
        return JSONResponse(rt.trends.to_dict())

    async def savings(request: Request) -> Response:
        if rt.savings is None:
            raise NotFound("savings accounting is off (admin.savings_shadow_entries: 0)", code="savings_off")
        return JSONResponse(rt.savings.to_dict())

    g = _guard
    return [
        Route("/admin/replicas", g(replicas), methods=["GET"]),
        Route("/admin/replicas", g(add_replica), methods=["POST"]),
        Route("/admin/replicas/{name}", g(get_replica), methods=["GET"]),
        Route("/admin/replicas/{name}", g(remove), methods=["DELETE"]),
        Route("/admin/replicas/{name}/drain", g(drain), methods=["POST"]),
        Route("/admin/replicas/{name}/undrain", g(undrain), methods=["POST"]),
        Route("/admin/routing", g(routing), methods=["GET"]),
        Route("/admin/routing", g(set_routing), methods=["PATCH"]),
        Route("/admin/routing/explain", g(explain_route), methods=["POST"]),
        Route("/admin/cache", g(cache), methods=["GET"]),
        Route("/admin/cache/purge", g(purge), methods=["POST"]),
        Route("/admin/hygiene", g(hygiene), methods=["GET"]),
        Route("/admin/config/reload", g(reload), methods=["POST"]),
        Route("/admin/status", g(status), methods=["GET"]),
        Route("/admin/trends", g(trends), methods=["GET"]),
        Route("/admin/savings", g(savings), methods=["GET"]),
        *_tenant_routes(rt, g),
    ]


def _replica_row(rt: Runtime, name: str) -> dict[str, Any]:
    return next(r for r in snapshot(rt.pool) if r["name"] == name)


def _tenant_routes(rt: Runtime, g: Callable[[Handler], Handler]) -> list[Route]:
    return tenant_routes(rt, g, _json)


async def _not_found(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 405:
        err = BadRequest(f"method {request.method} not allowed here", code="method_not_allowed")
        err.status = 405
        return _err(err)
    return _err(NotFound(f"unknown admin route {request.url.path}", code="unknown_route"))


def build_admin_app(rt: Runtime) -> _Authorized:
    async def openapi(request: Request) -> Response:
        return JSONResponse(openapi_document())

    async def page(request: Request) -> Response:
        return HTMLResponse((STATIC / "status.html").read_text())

    routes = [Route("/openapi.json", openapi, methods=["GET"]), Route("/", page, methods=["GET"]),
              *_routes(rt)]
    return _Authorized(rt, Starlette(routes=routes, exception_handlers={HTTPException: _not_found}))
