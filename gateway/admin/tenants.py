"""Admin routes for tenants and their keys; the registry (``policies.tenants``) does the work.

Responses never contain key material, except the one response that issues a
key: the plaintext is shown once and kept nowhere.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable, Literal

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from policies import AdminError

from .bodies import Body as _Body
from gateway.errors import GatewayError
from gateway.runtime import Runtime

Handler = Callable[[Request], Awaitable[Response]]


def _admin_error(err: AdminError) -> GatewayError:
    out = GatewayError(err.message if hasattr(err, "message") else str(err), code=err.code)
    out.status = err.status
    out.type = "invalid_request_error" if err.status < 500 else "service_unavailable"
    return out


def tenant_routes(rt: Runtime, g: Callable[[Handler], Handler], read_json: Any) -> list[Route]:
    class TenantIn(_Body):
        name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
        namespace: str | None = Field(None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
        models: list[str] | None = Field(None, max_length=256)
        semantic_cache: bool = True
        requests_per_minute: int | None = Field(None, ge=1, le=10_000_000)
        tokens_per_minute: int | None = Field(None, ge=1, le=10_000_000_000)
        normalize_tools: bool = False
        sort_tools: bool = False
        prompt_hygiene: bool = True
        priority: Literal["interactive", "standard", "batch"] = "standard"
        weight: float = Field(1.0, gt=0, le=1000)
        queue_timeout_s: float = Field(30.0, gt=0, le=3600)
        issue_key: bool = True

    class TenantPatch(_Body):
        namespace: str | None = Field(None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
        models: list[str] | None = Field(None, max_length=256)
        semantic_cache: bool | None = None
        requests_per_minute: int | None = Field(None, ge=1, le=10_000_000)
        tokens_per_minute: int | None = Field(None, ge=1, le=10_000_000_000)
        normalize_tools: bool | None = None
        sort_tools: bool | None = None
        prompt_hygiene: bool | None = None
        priority: Literal["interactive", "standard", "batch"] | None = None
        weight: float | None = Field(None, gt=0, le=1000)
        queue_timeout_s: float | None = Field(None, gt=0, le=3600)

    class KeyIn(_Body):
        rotate: bool = False
        key_id: str | None = Field(None, max_length=64)

    reg = lambda: rt.engine.registry  # noqa: E731

    def wrap(handler: Handler) -> Handler:
        async def inner(request: Request) -> Response:
            try:
                return await handler(request)
            except AdminError as err:
                raise _admin_error(err) from None
        return g(inner)

    async def list_tenants(request: Request) -> Response:
        return JSONResponse({"tenants": [t.to_dict() for t in reg().list_tenants()]})

    async def create(request: Request) -> Response:
        body = await read_json(request, TenantIn)
        spec = body.model_dump(exclude={"issue_key"}, exclude_none=True)
        info = await reg().create_tenant(spec)
        out: dict[str, Any] = info.to_dict()
        if body.issue_key:
            issued = await reg().add_key(body.name)
            out = reg().get_tenant(body.name).to_dict()
            out["api_key"] = issued.api_key
        return JSONResponse(out, status_code=201)

    async def get(request: Request) -> Response:
        return JSONResponse(reg().get_tenant(request.path_params["name"]).to_dict())

    async def patch(request: Request) -> Response:
        body = await read_json(request, TenantPatch)
        info = await reg().update_tenant(request.path_params["name"], body.model_dump(exclude_unset=True))
        return JSONResponse(info.to_dict())

    async def delete(request: Request) -> Response:
        await reg().delete_tenant(request.path_params["name"])
        return Response(status_code=204)

    async def add_key(request: Request) -> Response:
        body = await read_json(request, KeyIn)
        name = request.path_params["name"]
        issued = await (reg().rotate_key(name, body.key_id) if body.rotate else reg().add_key(name))
        return JSONResponse({"tenant": issued.tenant, "key_id": issued.key_id, "created_at": issued.created_at,
                             "api_key": issued.api_key}, status_code=201)

    async def revoke(request: Request) -> Response:
        await reg().revoke_key(request.path_params["name"], request.path_params["kid"])
        return Response(status_code=204)

    return [
        Route("/admin/tenants", wrap(list_tenants), methods=["GET"]),
        Route("/admin/tenants", wrap(create), methods=["POST"]),
        Route("/admin/tenants/{name}", wrap(get), methods=["GET"]),
        Route("/admin/tenants/{name}", wrap(patch), methods=["PATCH"]),
        Route("/admin/tenants/{name}", wrap(delete), methods=["DELETE"]),
        Route("/admin/tenants/{name}/keys", wrap(add_key), methods=["POST"]),
        Route("/admin/tenants/{name}/keys/{kid}", wrap(revoke), methods=["DELETE"]),
    ]
