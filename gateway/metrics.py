"""Prometheus metrics, in a registry owned by the runtime (no module globals).

Replica gauges are read from the pool at scrape time by a collector, so the
hot path only increments counters and observes histograms.
"""

from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from .pool import ReplicaPool

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _PoolCollector(Collector):
    def __init__(self, pool: Callable[[], ReplicaPool | None]) -> None:
        self._pool = pool

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
            inflight.add_metric([r.name], r.in_flight)
            if r.running is not None:
                running.add_metric([r.name], r.running)
            if r.waiting is not None:
                waiting.add_metric([r.name], r.waiting)
            if r.kv_usage is not None:
                kv.add_metric([r.name], r.kv_usage)
            if r.prefix_queries:
                hit.add_metric([r.name], (r.prefix_hits or 0.0) / r.prefix_queries)
        yield from (up, inflight, running, waiting, kv, hit)


class Metrics:
    def __init__(self, pool: Callable[[], ReplicaPool | None] = lambda: None) -> None:
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
        r.register(_PoolCollector(pool))

    def render(self) -> bytes:
        return generate_latest(self.registry)
