"""Prometheus metrics, in a registry owned by the runtime (no module globals).

Replica gauges are read from the pool at scrape time by a collector, so the
hot path only increments counters and observes histograms.

With several workers (``gateway.workers``) every worker's counters and
histograms live in prometheus_client's multiprocess files, and ``/metrics``,
whichever worker answers it, sums them over all workers. In-flight requests
are a ``livesum`` gauge each worker refreshes every second and at each scrape
(a dead worker's leave the sum); what the replicas report about themselves
(up, running, waiting, KV usage, hit ratio) is the answering worker's own
scrape of them, as every worker scrapes the same replicas.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, values
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from .pool import ReplicaPool

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _PoolCollector(Collector):
    def __init__(self, pool: Callable[[], ReplicaPool | None], in_flight: bool = True) -> None:
        self._pool = pool
        self._in_flight = in_flight

    def collect(self) -> Iterator[GaugeMetricFamily]:
        pool = self._pool()
        if pool is None:
            return
        now = pool.clock()
        up = GaugeMetricFamily("kvgate_replica_up", "1 when the replica is available for routing", labels=["replica"])
        inflight = GaugeMetricFamily("kvgate_replica_in_flight", "requests in flight from this instance",
                                     labels=["replica"])
        running = GaugeMetricFamily("kvgate_replica_running", "vllm:num_requests_running as scraped",
                                    labels=["replica"])
        waiting = GaugeMetricFamily("kvgate_replica_waiting", "vllm:num_requests_waiting as scraped",
                                    labels=["replica"])
        kv = GaugeMetricFamily("kvgate_replica_kv_usage", "vllm:kv_cache_usage_perc as scraped", labels=["replica"])
        hit = GaugeMetricFamily("kvgate_replica_prefix_hit_ratio",
                                "replica's own prefix-cache hit ratio (hits/queries, tokens)", labels=["replica"])
        for r in pool.replicas.values():
            up.add_metric([r.name], 1.0 if r.available(now) else 0.0)
            if self._in_flight:
                inflight.add_metric([r.name], r.in_flight)
            if r.running is not None:
                running.add_metric([r.name], r.running)
            if r.waiting is not None:
                waiting.add_metric([r.name], r.waiting)
            if r.kv_usage is not None:
                kv.add_metric([r.name], r.kv_usage)
            if r.prefix_queries:
                hit.add_metric([r.name], (r.prefix_hits or 0.0) / r.prefix_queries)
        yield from (up, inflight, running, waiting, kv, hit) if self._in_flight else (up, running, waiting, kv, hit)


class Metrics:
    def __init__(self, pool: Callable[[], ReplicaPool | None] = lambda: None,
                 multiprocess_dir: Path | None = None) -> None:
        self._pool = pool
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.requests = Counter("kvgate_requests", "requests by endpoint, status and replica",
                                ["endpoint", "status", "replica", "tenant"], registry=r)
        self.latency = Histogram("kvgate_request_duration_seconds", "whole request duration",
                                 ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("kvgate_time_to_first_token_seconds", "time to first streamed event",
                              ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r)
        self.tokens = Counter("kvgate_tokens", "tokens by kind (prompt, completion, cached)",
                              ["kind", "replica", "tenant"], registry=r)
        self.upstream_errors = Counter("kvgate_upstream_errors", "replica failures by kind",
                                       ["replica", "kind"], registry=r)
        self.retries = Counter("kvgate_retries", "requests retried on another replica", registry=r)
        self.ejections = Counter("kvgate_ejections", "replica ejections", ["replica"], registry=r)
        self.disconnects = Counter("kvgate_client_disconnects", "clients gone before the answer ended",
                                   ["endpoint"], registry=r)
        self.routing = Counter("kvgate_routing_decisions", "routing outcome (first choice or spilled)",
                               ["decision"], registry=r)
        self.cache = Counter("kvgate_semantic_cache", "semantic-cache lookups by result and tier",
                             ["result", "tier", "tenant"], registry=r)
        self.hygiene = Counter("kvgate_prefix_warnings", "prompt-hygiene warnings by tenant and kind",
                               ["tenant", "kind"], registry=r)
        self.rate_limited = Counter("kvgate_rate_limited", "requests refused by a tenant limit",
                                    ["tenant", "limit"], registry=r)
        self.multiprocess_dir = multiprocess_dir
        if multiprocess_dir is None:
            r.register(_PoolCollector(pool))
            return
        if values.ValueClass is values.MutexValue:  # chosen once, when prometheus_client is imported
            raise RuntimeError("a worker's metrics need PROMETHEUS_MULTIPROC_DIR set before it starts "
                               "(the supervisor, gateway.workers, sets it)")
        self.in_flight = Gauge("kvgate_replica_in_flight", "requests in flight from this instance",
                               ["replica"], registry=None, multiprocess_mode="livesum")
        self._in_flight_names: set[str] = set()
        self._summed = CollectorRegistry(auto_describe=False)
        MultiProcessCollector(self._summed, path=str(multiprocess_dir))
        self._replica_facts = CollectorRegistry(auto_describe=False)
        self._replica_facts.register(_PoolCollector(pool, in_flight=False))

    def render(self) -> bytes:
        if self.multiprocess_dir is None:
            return generate_latest(self.registry)
        self.sync_in_flight()
        return generate_latest(self._replica_facts) + generate_latest(self._summed)

    async def render_async(self) -> bytes:
        """As ``render``; the sum over workers reads every worker's files, so off the loop."""
        if self.multiprocess_dir is None:
            return self.render()
        self.sync_in_flight()
        facts = generate_latest(self._replica_facts)
        return facts + await asyncio.to_thread(generate_latest, self._summed)

    def sync_in_flight(self) -> None:
        """Copy this worker's in-flight counts into its multiprocess gauge (workers only)."""
        pool = self._pool()
        if pool is None or self.multiprocess_dir is None:
            return
        names = set(pool.replicas)
        for name in self._in_flight_names - names:  # removed: its series stays, at zero
            self.in_flight.labels(name).set(0)
        for name, replica in pool.replicas.items():
            self.in_flight.labels(name).set(replica.in_flight)
        self._in_flight_names = names

    async def sync_loop(self, interval_s: float) -> None:
        while True:
            self.sync_in_flight()
            await asyncio.sleep(interval_s)
