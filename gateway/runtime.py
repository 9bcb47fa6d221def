"""The runtime: every shared resource of a running kvgate, created in lifespan.

One object owns the HTTP client, replica pool, routing policy, metrics, tenant
policy engine, Redis connection and semantic cache; the public and admin apps
both read it, so nothing lives in module globals and tests can build as many
gateways in one process as they like. Per-request stages live in
``gateway.proxy.stages``; this module is set-up and shutdown, and what they
need to keep the pool current (DNS, KV-event subscriptions). What an operator
asks of a running gateway (status, readiness, purge, reload, replicas, routing)
is ``gateway.admin.operations``.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from urllib.parse import urlsplit
from typing import TYPE_CHECKING, Any, Callable

import httpx

from policies import HygieneTracker, PolicyEngine, RateLimiter, RedisTenantStore, TenantRegistry, scan_memo
from routing import RoutingPolicy, RoutingSettings, dns_target, make_policy, resolve
from routing.kv_events import KVEvents
from routing.tokenization import Tokenization

from gateway.observe.endpoint_stats import EndpointStats
from . import redis_client
from gateway.observe.metrics import Metrics
from .routing_sync import RoutingSync, stream_for
from gateway.proxy.admission import Admission
from gateway.proxy.disagg import Disagg
from gateway.proxy.pool import PoolEvents, Replica, ReplicaPool
from gateway.apis.responses.ids import ResponseIds, derive_id_key
from .settings import Settings
from gateway.observe.savings import Savings
from gateway.observe.stats import DecisionTimes, TenantStats
from gateway.observe.tracing import Tracing
from gateway.observe.trends import Trends
from gateway.proxy.transport import UPSTREAM_HEADERS, LeanTransport
from gateway.server.worker_info import WorkerInfo

if TYPE_CHECKING:
    from semantic_cache import SemanticCache

log = logging.getLogger("kvgate.runtime")


def make_client(settings: Settings, transport: httpx.AsyncBaseTransport) -> httpx.AsyncClient:
    """The client for health checks, metrics scrapes and discovery (not the hot path)."""
    # trust_env=False: upstream hosts come only from configuration, never from proxy
    # variables. identity encoding: bytes are relayed as they come, never re-encoded.
    return httpx.AsyncClient(transport=transport, trust_env=False, follow_redirects=False,
                             headers=UPSTREAM_HEADERS,
                             timeout=httpx.Timeout(settings.timeouts.first_byte_s,
                                                   connect=settings.timeouts.connect_s))


def _make_kv_events(settings: Settings) -> KVEvents | None:
    kv = settings.routing.kv_events
    if not any(r.kv_events for r in settings.replicas) and not (kv.port and settings.routing.dns_name):
        return None
    # The replicas' --block-size: events of another size are skipped (counted), so a wrong one shows.
    return KVEvents(settings.routing.block_size, cpu_weight=kv.cpu_weight, stale_s=kv.stale_s,
                    max_blocks=kv.max_blocks)


def _redis(settings: Settings) -> redis_client.Client | None:
    if settings.redis_url is None:
        return None
    # Short socket timeouts: a hung Redis must cost at most this, then breakers take over.
    return redis_client.connect(settings.redis_url.get_secret_value(), timeout_s=settings.redis_timeout_s,
                                retry_on_timeout=False, health_check_interval=0)


class Runtime:
    def __init__(self, settings: Settings, transport: httpx.AsyncBaseTransport | None = None,
                 config_path: str | Path | None = None, span_exporter: Any = None,
                 worker: WorkerInfo | None = None, embedding_loader: Callable[[], Any] | None = None) -> None:
        """``embedding_loader`` loads the semantic cache's local model in place of the
        packaged one (the seam for a slow or failing load)."""
        self.settings = settings
        self._embedding_loader = embedding_loader
        self.config_path = config_path
        self.worker = worker  # one of several worker processes (gateway.server.workers), or None
        # The network seam: one httpx transport. The hot path calls it directly (an
        # AsyncClient's cookie, auth and redirect machinery cost more than the
        # transport itself); health checks use a client built on the same transport.
        self.transport = transport or LeanTransport(max_idle_per_origin=settings.pool.max_connections)
        self.client = make_client(settings, self.transport)
        self.metrics = Metrics(lambda: self.pool, cache=lambda: self.cache, policy=lambda: self.policy,
                               kv_events=lambda: self.kv_events, admission=lambda: self.admission,
                               routing_sync=lambda: self.routing_sync,
                               multiprocess_dir=worker.metrics_dir if worker else None)
        self.tracing = Tracing(otlp_endpoint=settings.otlp_endpoint, exporter=span_exporter)
        self.pool = ReplicaPool(settings.pool, self.client, settings.replicas,
                                events=PoolEvents(on_eject=self._on_eject, on_failure=self._on_failure,
                                                  on_adapters=self._on_adapters,
                                                  on_release=lambda r: self.admission.released(r),
                                                  on_refresh=lambda: self.admission.pump()),
                                transport=self.transport)
        # Precise mode's truth: the replicas' KV events (routing.kv_events), when any publish them.
        self.kv_events: KVEvents | None = _make_kv_events(settings)
        self.policy: RoutingPolicy = self.make_policy(settings.routing)
        # P/D prefill legs' own policy (routing.prefill_pick), or the same one.
        self.prefill_policy: RoutingPolicy = self.make_prefill_policy(settings.routing)
        # Exact token ids per model (in process or from a render server), else approximate keys.
        self.tokenization = Tokenization(settings.routing)
        self.replica_keys = {r.name: r.api_key.get_secret_value() for r in settings.replicas if r.api_key}
        self.redis = _redis(settings)
        secret = settings.server_secret.get_secret_value()
        id_secret = settings.response_id_secret.get_secret_value() if settings.response_id_secret else secret
        self.response_ids = ResponseIds(derive_id_key(id_secret))
        store = RedisTenantStore(self.redis, timeout_s=settings.redis_timeout_s) if self.redis else None
        self.hygiene = HygieneTracker()
        self.engine = PolicyEngine(
            TenantRegistry(settings.tenants, secret, store),
            RateLimiter(self.redis, timeout_s=settings.redis_timeout_s), self.hygiene,
            boundary_marker=settings.routing.boundary_marker, scans=scan_memo())
        # The fair queue: on when tenants are configured (a runtime tenant created later turns it on).
        self.admission = Admission(self.pool, metrics=self.metrics, active=lambda: (
            self.settings.pool.fair_queue and not self.engine.registry.open_mode))
        self.cache: SemanticCache | None = None
        self.tenant_stats = TenantStats()
        self.decision_times = DecisionTimes()
        self.endpoint_stats = EndpointStats()
        self.trends = Trends(self.metrics, interval_s=settings.admin.trend_interval_s,
                             samples=settings.admin.trend_samples)
        entries = settings.admin.savings_shadow_entries
        self.savings: Savings | None = Savings(settings.routing, self.metrics, entries) if entries else None
        self.routing_counts = {"first_choice": 0, "retried": 0}
        # P/D (gateway.proxy.disagg): idle unless a replica has role prefill or decode.
        self.disagg = Disagg(self)
        self.background: set[asyncio.Task[Any]] = set()
        self.routing_sync: RoutingSync | None = None
        self.started = False
        self.shutting_down = False

    # -- lifecycle --------------------------------------------------------
    async def start(self) -> None:
        registry = self.engine.registry
        if not self.tokenization.loaded:
            # Before serving, so a ready gateway routes on exact ids from its first request;
            # in a thread, so the event loop (other apps in the process, timers) keeps running.
            await asyncio.to_thread(self.tokenization.load)
        try:
            await registry.load()
        except Exception:  # a store fault must not stop start-up: we retry in watch()
            log.warning("tenant store unavailable at start-up; serving config tenants")
        if self.redis is not None:
            self.spawn(registry.watch())
            self.spawn(self._probe_rate_limits())
        if self.settings.semantic_cache.enabled:
            from semantic_cache import SemanticCache

            url = self.settings.redis_url.get_secret_value() if self.settings.redis_url else None
            self.cache = await SemanticCache.open(self.settings.semantic_cache, url, self.settings.redis_timeout_s,
                                                  connect=redis_client.connector(url) if url else None,
                                                  loader=self._embedding_loader,
                                                  workers=self.settings.workers)
        if self.settings.routing.dns_name:
            self.spawn(self._dns_loop())
        self._share_routing()
        self.sync_kv_events()
        self.spawn(self.trends.run())
        if self.metrics.multiprocess_dir is not None:
            self.spawn(self.metrics.sync_loop(1.0))
        await self.pool.start()
        self.started = True

    def close_queue(self) -> None:
        """Answer every request waiting in the fair queue with a 503, and queue none from now
        on: called as the listeners close, before the grace for requests in flight."""
        self.admission.close()

    async def stop(self) -> None:
        self.close_queue()  # again, for a runtime stopped without a signal (tests, embedding)
        for task in list(self.background):
            task.cancel()
        await asyncio.gather(*self.background, return_exceptions=True)
        await self.pool.stop()
        if self.kv_events is not None:
            await self.kv_events.aclose()
        if self.cache is not None:
            await self.cache.aclose()
        if self.routing_sync is not None:
            await self.routing_sync.aclose()
        await self.tokenization.aclose()
        if self.redis is not None:
            await self.redis.aclose()
        await self.client.aclose()
        self.tracing.shutdown()

    def make_policy(self, routing: RoutingSettings) -> RoutingPolicy:
        """A fresh policy for ``routing`` (at start-up, and when an operator changes routing)."""
        share = routing.share_index
        if share is None:
            # Unset: ttft shares its block facts wherever there is a channel. Several instances
            # with one Redis then keep one instance's reuse and tail; sharing nothing they lose
            # part of the reuse and much of the tail (docs/benchmarks/routing-ttft.md). Key facts
            # (prefix_affinity) did not pay, so they stay asked for.
            share = self.settings.redis_url is not None and routing.policy == "ttft"
        elif share and self.settings.redis_url is None:
            # Sharing without a channel would place new keys where other instances
            # cannot follow: route as an instance that shares nothing.
            log.warning("routing.share_index needs redis_url; routing on this instance's knowledge only")
            share = False
        return make_policy(routing.model_copy(update={"share_index": share}), truth=self.kv_events)

    def make_prefill_policy(self, routing: RoutingSettings) -> RoutingPolicy:
        """The policy of P/D prefill legs: its own ``ttft`` instance (routing.prefill_pick), which
        sees only prefill replicas, or ``self.policy``. It shares nothing through Redis: the
        gossip carries the main policy's facts."""
        if routing.prefill_pick == "policy":
            return self.policy
        return make_policy(routing.model_copy(update={"policy": "ttft", "share_index": False}), truth=self.kv_events)

    def use_routing(self, routing: RoutingSettings) -> None:
        """Fresh policies for ``routing`` (an operator changed it): what was learned starts over."""
        self.policy = self.make_policy(routing)
        self.prefill_policy = self.make_prefill_policy(routing)

    def sync_kv_events(self) -> None:
        """Subscribe to the KV events of every replica in the pool that publishes them; drop the rest."""
        if self.kv_events is None:
            return
        configured = {r.name: r for r in self.settings.replicas}
        kv = self.settings.routing.kv_events
        endpoints: dict[str, tuple[str, str | None]] = {}
        for name, replica in self.pool.replicas.items():
            spec = configured.get(name)
            if spec is not None and spec.kv_events:
                endpoints[name] = (spec.kv_events, spec.kv_events_replay)
            elif replica.source == "dns" and (found := kv.endpoints_at(urlsplit(replica.url).hostname or "")):
                endpoints[name] = found
        self.kv_events.sync(endpoints)

    def _share_routing(self) -> None:
        """Publish and apply routing facts through Redis while the policy shares them."""
        url = self.settings.redis_url
        if self.redis is None or url is None:
            return
        timeout = self.settings.redis_timeout_s
        # The tail blocks in XREAD for up to a second: its own connection, read timeout above that.
        tail = redis_client.connect(url.get_secret_value(), timeout_s=timeout, read_timeout_s=timeout + 1.0)
        fleet = [r.url for r in self.settings.replicas] + [self.settings.routing.dns_name or ""]
        self.routing_sync = RoutingSync(lambda: self.policy, self.redis, tail, stream=stream_for(fleet))
        self.spawn(self.routing_sync.run())

    def spawn(self, coro: Any) -> asyncio.Task[Any]:
        """A background task the runtime keeps a reference to (and cancels at stop)."""
        task = asyncio.ensure_future(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        return task

    async def _probe_rate_limits(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            if self.engine.limiter.degraded:
                await self.engine.limiter.probe()

    def _on_eject(self, replica: Replica) -> None:
        self.metrics.ejections.labels(replica.name).inc()

    def _on_failure(self, replica: Replica, kind: str) -> None:
        self.metrics.upstream_errors.labels(replica.name, kind).inc()

    def _on_adapters(self, names: frozenset[str]) -> None:
        if self.kv_events is not None:  # precise mode keys an adapter's blocks apart
            self.kv_events.index.note_adapters(names)

    async def _dns_loop(self) -> None:
        name = self.settings.routing.dns_name or ""
        while True:
            try:
                urls = await resolve(*dns_target(name))
                self._sync_dns(urls)
            except (OSError, ValueError):
                log.warning("DNS resolution failed", extra={"dns_name": name})
            await asyncio.sleep(self.settings.routing.dns_interval_s)

    def _sync_dns(self, urls: list[str]) -> None:
        wanted = {u.split("//", 1)[-1]: u for u in urls}
        for name, r in list(self.pool.replicas.items()):
            if r.source == "dns" and name not in wanted:
                self.pool.remove(name)
        for name, url in wanted.items():
            if name not in self.pool.replicas:
                self.pool.add(name, url, source="dns")
        self.sync_kv_events()
