"""Worker 0's admin listener passes each change on to the other workers.

With several workers, one of them (worker 0) serves the admin port, so an
operator has one status page and one place to act. Replicas, routing and
config reloads are state of each worker's own runtime: a change that worker 0
accepted (2xx) is replayed, same method, path, body and token, to every other
worker's admin API on its private unix socket before worker 0 answers. The
answer carries ``x-kvgate-workers-applied: k/N``; a worker that is down
(restarting) misses the change and starts again from the config file.

Tenants are different: a key issued twice would be two keys. Changes to them
are left to the shared tenant store (Redis), which every worker already
watches; without ``redis_url`` they are refused with 409 while several
workers run. Reads (GET) are answered by worker 0 alone.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import httpx

from gateway.proxy.asgi_io import Receive, Scope, Send
from gateway.errors import GatewayError, error_payload

log = logging.getLogger("kvgate.admin")

_READS = frozenset({"GET", "HEAD", "OPTIONS"})
_MAX_BODY = 1024 * 1024 + 1  # the admin API refuses bodies over 1 MiB itself
_PASSED = (b"authorization", b"content-type")


class FanOut:
    def __init__(self, app: Any, peers: list[Path], *, tenants_shared: bool, timeout_s: float = 10.0) -> None:
        self.app = app
        self.peers = peers
        self.tenants_shared = tenants_shared
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in _READS or not self.peers:
            await self.app(scope, receive, send)
            return
        if scope["path"].startswith("/admin/tenants"):
            if self.tenants_shared:  # the store carries it to every worker
                await self.app(scope, receive, send)
            else:
                await _refuse(send)
            return
        body = await _read(receive)
        held: list[dict[str, Any]] = []

        async def replay() -> dict[str, Any]:
            return {"type": "http.request", "body": body, "more_body": False}

        async def hold(message: dict[str, Any]) -> None:
            held.append(message)

        await self.app(scope, replay, hold)
        status = held[0]["status"] if held else 500
        if 200 <= status < 300:
            applied = 1 + await self._replicate(scope, body)
            mark = (b"x-kvgate-workers-applied", f"{applied}/{len(self.peers) + 1}".encode())
            held[0] = {**held[0], "headers": [*held[0].get("headers", ()), mark]}
        for message in held:
            await send(message)

    async def _replicate(self, scope: Scope, body: bytes) -> int:
        headers = [(k, v) for k, v in scope["headers"] if k in _PASSED]
        url = scope["path"] + ("?" + scope["query_string"].decode("latin-1") if scope.get("query_string") else "")
        applied = 0
        for path in self.peers:
            transport = httpx.AsyncHTTPTransport(uds=str(path))
            try:
                async with httpx.AsyncClient(transport=transport, base_url="http://kvgate-worker",
                                             timeout=self.timeout_s, trust_env=False) as client:
                    r = await client.request(scope["method"], url, headers=headers, content=body)
                ok = r.status_code < 300
            except httpx.HTTPError:
                ok = False
            applied += ok
            if not ok:
                log.warning("admin change not applied by a worker", extra={"socket": path.name,
                                                                           "path": scope["path"]})
        return applied


async def _read(receive: Receive) -> bytes:
    body = b""
    more = True
    while more and len(body) < _MAX_BODY:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    return body


async def _refuse(send: Send) -> None:
    err = GatewayError("changing tenants at runtime with several workers needs redis_url (a tenant store "
                       "every worker shares), or a config file",
                       code="tenants_need_shared_store")
    err.status, err.type = 409, "invalid_request_error"
    body = error_payload(err)
    await send({"type": "http.response.start", "status": 409,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
