"""``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel``: to the replica holding it.

Not hot-path routes (a client polls a background response, or cancels one), so
they are plain Starlette endpoints. Each authenticates the tenant, decodes the
id kvgate issued (``response_ids``; anything else is a 404 ``response_not_found``),
forwards to that one replica (``responses_api.pinned_replica``: gone or down is
``response_replica_unavailable``) and rewrites the ids in the answer. vLLM 0.33
serves no ``DELETE`` for responses, so neither does kvgate; ``GET ?stream=true``
(replaying a background stream) is refused with a 400 rather than half-supported.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import httpx
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.proxy import stages
from gateway.errors import BadRequest, GatewayError, UpstreamTimeout, error_payload, internal_error
from gateway.proxy.relay import read_whole
from .ids import StoredAt
from .endpoint import ReplicaUnavailable, pinned_replica, response_not_found
from .sse import IdRewriter
from gateway.proxy.transport import UPSTREAM_HEADERS
from gateway.proxy.upstream import read_error_body

if TYPE_CHECKING:
    from gateway.proxy.pool import Replica
    from gateway.runtime import Runtime

__all__ = ["response_routes"]

log = logging.getLogger("kvgate.access")


def _error(err: GatewayError) -> Response:
    return Response(error_payload(err), status_code=err.status, media_type="application/json", headers=err.headers)


async def _call(rt: "Runtime", replica: "Replica", at: StoredAt, method: str, suffix: str,
                rid: str) -> tuple[bytes, dict[str, Any]]:
    """One request to the replica holding the response; its whole JSON answer."""
    headers = {**UPSTREAM_HEADERS, "x-request-id": rid}
    if replica.name in rt.replica_keys:
        headers["authorization"] = f"Bearer {rt.replica_keys[replica.name]}"
    t = rt.settings.timeouts
    timeout = {"connect": t.connect_s, "read": t.non_stream_s, "write": t.connect_s, "pool": t.connect_s}
    # Not Replica.url_for: it caches parsed URLs per path, and these paths are per response.
    url = httpx.URL(f"{replica.url}/v1/responses/{quote(at.upstream_id, safe='')}{suffix}")
    with rt.pool.acquire(replica):
        try:
            upstream = await rt.pool.transport.handle_async_request(
                httpx.Request(method, url, headers=headers, extensions={"timeout": timeout}))
        except httpx.TimeoutException:
            raise UpstreamTimeout(f"replica {replica.name} did not answer in time") from None
        except httpx.HTTPError:
            raise ReplicaUnavailable("the replica that stored this response is unavailable; retry later",
                                     headers={"retry-after": "1"}) from None
        try:
            if upstream.status_code == 404:
                raise response_not_found()  # e.g. the replica restarted: its memory is gone
            if upstream.status_code != 200:
                raise await read_error_body(upstream, replica)
            return await read_whole(upstream, timeout_s=t.non_stream_s)
        finally:
            await upstream.aclose()


async def _forward(rt: "Runtime", request: Request, endpoint: str, method: str, suffix: str) -> Response:
    started = time.perf_counter()
    rid = request.scope.get("kvgate.request_id", "")
    status, replica_name, tenant_name = 0, "-", "-"
    try:
        headers = {k.lower(): v for k, v in request.headers.items()}
        tenant = stages.authenticate(rt, headers, request.scope.get("query_string", b""))
        tenant_name = tenant.name
        if request.query_params.get("stream") in ("true", "1"):
            raise BadRequest("streaming a stored response is not supported through kvgate; omit 'stream'",
                             param="stream", code="unsupported_parameter")
        at = rt.response_ids.decode(request.path_params["response_id"], tenant.namespace)
        if at is None:
            raise response_not_found()
        replica = pinned_replica(rt, at)
        replica_name = replica.name
        body, obj = await _call(rt, replica, at, method, suffix, rid)
        rewriter = IdRewriter(lambda upstream_id: rt.response_ids.encode(replica.name, upstream_id, tenant.namespace))
        rewriter.learn(obj.get("id"))
        rewriter.learn(obj.get("previous_response_id"))  # a continuation lives where its parent does
        status = 200
        return Response(rewriter.apply(body), media_type="application/json",
                        headers={"x-kvgate-replica": replica.name})
    except GatewayError as err:
        status = err.status
        return _error(err)
    except Exception:
        log.exception("unhandled error", extra={"request_id": rid})
        status = 500
        return _error(internal_error())
    finally:
        elapsed = time.perf_counter() - started
        rt.metrics.requests.labels(endpoint, str(status), replica_name, tenant_name).inc()
        rt.metrics.latency.labels(endpoint).observe(elapsed)
        if log.isEnabledFor(logging.INFO):
            log.info("request", extra={"request_id": rid, "endpoint": endpoint, "status": status,
                                       "replica": replica_name, "tenant": tenant_name,
                                       "duration_ms": round(elapsed * 1000, 2)})


def response_routes(rt: "Runtime") -> list[Route]:
    async def retrieve(request: Request) -> Response:
        return await _forward(rt, request, "responses_retrieve", "GET", "")

    async def cancel(request: Request) -> Response:
        return await _forward(rt, request, "responses_cancel", "POST", "/cancel")

    return [
        Route("/v1/responses/{response_id}", retrieve, methods=["GET"]),
        Route("/v1/responses/{response_id}/cancel", cancel, methods=["POST"]),
    ]
