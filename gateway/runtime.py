"""The runtime: every shared resource of a running kvgate, created in lifespan.

One object owns the HTTP client, replica pool, routing policy, metrics, tenant
registry, rate limiter and semantic cache; the public and admin apps both read
it, so nothing lives in module globals and tests can build as many gateways in
one process as they like.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx

from routing import RoutingPolicy, make_policy

from .asgi_io import Exchange
from .errors import Unauthorized
from .metrics import Metrics
from .pool import PoolEvents, Replica, ReplicaPool
from .settings import Settings
from .transport import LeanTransport

if TYPE_CHECKING:
    from .proxy import RequestContext
    from .relay import Outcome

log = logging.getLogger("kvgate.runtime")


@dataclass(frozen=True, slots=True)
class Principal:
    tenant: str
    namespace: str


def make_client(settings: Settings) -> httpx.AsyncClient:
    # trust_env=False: upstream hosts come only from configuration, never from proxy
    # variables. identity encoding: bytes are relayed as they come, never re-encoded.
    return httpx.AsyncClient(transport=LeanTransport(max_idle_per_origin=settings.pool.max_connections),
                             trust_env=False, follow_redirects=False,
                             headers={"accept-encoding": "identity", "user-agent": "kvgate"},
                             timeout=httpx.Timeout(settings.timeouts.first_byte_s,
                                                   connect=settings.timeouts.connect_s))


def _key_in_query(query_string: bytes) -> bool:
    if not query_string:
        return False
    names = {part.split(b"=", 1)[0].lower() for part in query_string.split(b"&")}
    return bool(names & {b"api_key", b"api-key", b"key", b"apikey", b"access_token", b"token"})


class Runtime:
    def __init__(self, settings: Settings, client: httpx.AsyncClient | None = None) -> None:
        self.settings = settings
        self._own_client = client is None
        self.client = client or make_client(settings)
        self.metrics = Metrics(lambda: self.pool)
        events = PoolEvents(on_eject=self._on_eject)
        self.pool = ReplicaPool(settings.pool, self.client, settings.replicas, events=events)
        self.policy: RoutingPolicy = make_policy(settings.routing)
        self.replica_keys = {r.name: r.api_key.get_secret_value() for r in settings.replicas if r.api_key}
        secret = settings.server_secret.get_secret_value().encode()
        self._secret = secret
        self._keys = {
            self._key_digest(k.get_secret_value()): Principal(t.name, t.cache_namespace)
            for t in settings.tenants for k in t.api_keys
        }
        self.started = False

    # -- lifecycle --------------------------------------------------------
    async def start(self) -> None:
        await self.pool.start()
        self.started = True

    async def stop(self) -> None:
        await self.pool.stop()
        if self._own_client:
            await self.client.aclose()

    def _on_eject(self, replica: Replica) -> None:
        self.metrics.ejections.labels(replica.name).inc()

    # -- policy hooks used by the proxy -----------------------------------
    def _key_digest(self, key: str) -> bytes:
        return hmac.new(self._secret, key.encode(), hashlib.sha256).digest()

    def admit_key(self, headers: dict[str, str], query_string: bytes) -> Principal:
        if _key_in_query(query_string):
            # Query strings end up in access logs and browser history: refuse, don't use.
            raise Unauthorized("API keys are not accepted in the URL; send 'Authorization: Bearer <key>'",
                               code="key_in_query")
        if not self._keys:
            return Principal("default", "default")
        auth = headers.get("authorization", "")
        key = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        if not key:
            raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'", code="missing_api_key")
        digest = self._key_digest(key)
        found = self._keys.get(digest)
        if found is None or not hmac.compare_digest(digest, self._key_digest(key)):
            raise Unauthorized("invalid API key")
        return found

    async def admit_request(self, ctx: "RequestContext") -> None:
        return None

    async def try_cache(self, ctx: "RequestContext", exchange: Exchange) -> bool:
        return False

    def upstream_body(self, ctx: "RequestContext") -> dict[str, Any]:
        body = dict(ctx.body)
        if ctx.stream and not ctx.include_usage:
            so = body.get("stream_options")
            body["stream_options"] = {**(so if isinstance(so, dict) else {}), "include_usage": True}
        return body

    def after_response(self, ctx: "RequestContext", replica: str, outcome: "Outcome") -> None:
        usage = outcome.usage
        if usage is None:
            return
        tokens = self.metrics.tokens
        tenant = ctx.principal.tenant
        if usage.prompt_tokens:
            tokens.labels("prompt", replica, tenant).inc(usage.prompt_tokens)
        if usage.completion_tokens:
            tokens.labels("completion", replica, tenant).inc(usage.completion_tokens)
        if usage.cached_tokens:
            tokens.labels("cached", replica, tenant).inc(usage.cached_tokens)

    # -- readiness ----------------------------------------------------------
    def readiness(self) -> tuple[bool, dict[str, Any]]:
        now = self.pool.clock()
        configured = {m for r in self.settings.replicas for m in r.models}
        models = configured | set(self.pool.models(healthy_only=False))
        degraded: list[str] = []
        unserved = sorted(m for m in models if not self.pool.eligible(m))
        for m in unserved:
            degraded.append(f"model {m}: no healthy replica")
        down = [r.name for r in self.pool.replicas.values() if not r.available(now)]
        if down:
            degraded.append("replicas unavailable: " + ", ".join(sorted(down)))
        ready = self.started and bool(self.pool.replicas) and not unserved and bool(models)
        if not self.pool.replicas:
            degraded.append("no replicas configured")
        return ready, {"ready": ready, "models": sorted(models), "degraded": degraded}
