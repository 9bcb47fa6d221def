"""Prometheus metrics, in a registry owned by the runtime (no module globals).

Replica gauges, the semantic cache's counters by reason and the routing
policy's own counts are read at scrape time by collectors, from state that
exists anyway, so the hot path only increments counters and observes
histograms.

With several workers (``gateway.server.workers``) every worker's counters and
histograms live in prometheus_client's multiprocess files, and ``/metrics``,
whichever worker answers it, sums them over all workers. In-flight requests
are a ``livesum`` gauge each worker refreshes every second and at each scrape
(a dead worker's leave the sum); what the replicas report about themselves
(up, running, waiting, KV usage, hit ratio), the semantic cache's tallies and
the policy's counts are the answering worker's own.
"""

from __future__ import annotations

import asyncio
from collections import Counter as Tally
from pathlib import Path
from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, values
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from gateway.proxy.pool import ReplicaPool

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _PoolCollector(Collector):
    def __init__(self, pool: Callable[[], ReplicaPool | None], in_flight: bool = True) -> None:
        self._pool = pool
        self._in_flight = in_flight

    def collect(self) -> Iterator[Metric]:
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
        # vLLM's own counters, passed on so a dashboard can rate() them: the ratio above is
        # since the replica started, these give the hit rate over any window.
        queries = CounterMetricFamily("kvgate_replica_prefix_cache_queries",
                                      "vllm:prefix_cache_queries_total as scraped (tokens)", labels=["replica"])
        hits = CounterMetricFamily("kvgate_replica_prefix_cache_hits",
                                   "vllm:prefix_cache_hits_total as scraped (tokens)", labels=["replica"])
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
            if r.prefix_queries is not None:
                queries.add_metric([r.name], r.prefix_queries)
                hits.add_metric([r.name], r.prefix_hits or 0.0)
        families = (up, inflight, running, waiting, kv, hit, queries, hits)
        yield from (f for f in families if self._in_flight or f is not inflight)


# The semantic cache's own tallies (``SemanticCache.counters``), by reason, as counters.
_CACHE_FAMILIES = (
    ("rejected", "kvgate_semantic_cache_rejections", "candidates the verifier rejected, by rule", "reason"),
    ("miss", "kvgate_semantic_cache_misses", "semantic-cache misses by reason", "reason"),
    ("bypass", "kvgate_semantic_cache_bypasses", "requests the semantic cache did not look up, by reason",
     "reason"),
    ("stores", "kvgate_semantic_cache_stores", "answers stored (ok), evicted or failed", "result"),
    ("refused", "kvgate_semantic_cache_refusals", "answers not stored, by reason", "reason"),
)


class _CacheCollector(Collector):
    def __init__(self, cache: Callable[[], Any]) -> None:
        self._cache = cache

    def collect(self) -> Iterator[Metric]:
        counters: dict[str, Tally[str]] = getattr(self._cache(), "counters", None) or {}
        for key, name, doc, label in _CACHE_FAMILIES:
            family = CounterMetricFamily(name, doc, labels=[label])
            for value, n in sorted(dict(counters.get(key) or {}).items()):
                family.add_metric([str(value)], n)
            yield family


class _PolicyCollector(Collector):
    """How prefix affinity chose: the key's home (its rendezvous first choice), or elsewhere by cost."""

    def __init__(self, policy: Callable[[], Any]) -> None:
        self._policy = policy

    def collect(self) -> Iterator[Metric]:
        policy = self._policy()
        family = CounterMetricFamily("kvgate_routing_policy_decisions",
                                     "prefix_affinity's decisions: the key's home, or another replica by cost",
                                     labels=["policy", "outcome"])
        overrides = CounterMetricFamily("kvgate_routing_bound_overrides",
                                        "prefix_affinity's decisions where the replica its cost preferred was past "
                                        "the load bound (routing.epsilon), so another took the request",
                                        labels=["policy"])
        decisions, moved = getattr(policy, "decisions", None), getattr(policy, "moved", None)
        bounded = getattr(policy, "bound_overrides", None)
        name = str(getattr(policy, "name", "?"))
        if isinstance(decisions, int) and isinstance(moved, int):
            family.add_metric([name, "home"], decisions - moved)
            family.add_metric([name, "left_home"], moved)
        if isinstance(bounded, int):
            overrides.add_metric([name], bounded)
        yield family
        yield overrides


class _FactsCollector(Collector):
    """The routing facts this instance shares with the others through Redis (gateway.routing_sync)."""

    def __init__(self, sync: Callable[[], Any], policy: Callable[[], Any]) -> None:
        self._sync = sync
        self._policy = policy

    def collect(self) -> Iterator[Metric]:
        published = CounterMetricFamily("kvgate_routing_facts_published",
                                        "routing facts this instance published to the other instances "
                                        "(routing.share_index)")
        applied = CounterMetricFamily("kvgate_routing_facts_applied", "routing facts of other instances applied")
        heard = GaugeMetricFamily("kvgate_routing_facts_instances_heard",
                                  "other instances heard on the fleet's stream within three heartbeats "
                                  "(0: this instance publishes no facts)")
        failing = GaugeMetricFamily("kvgate_routing_facts_failing", "1 while Redis fails the sharing, else 0")
        sync, gossip = self._sync(), getattr(self._policy(), "gossip", None)
        if sync is not None and gossip is not None:
            published.add_metric([], gossip.published)
            applied.add_metric([], gossip.applied)
            heard.add_metric([], sync.heard())
            failing.add_metric([], 1.0 if sync.failing else 0.0)
        yield from (published, applied, heard, failing)


class _KVEventsCollector(Collector):
    """Each replica's KV-event stream (routing.kv_events): trusted or not, and what it delivered."""

    def __init__(self, kv_events: Callable[[], Any]) -> None:
        self._kv_events = kv_events

    def collect(self) -> Iterator[Metric]:
        fleet = self._kv_events()
        if fleet is None:
            return
        precise = GaugeMetricFamily("kvgate_kv_events_precise",
                                    "1 while the replica is routed on its KV events (stream live, token ids "
                                    "agreeing), else 0", labels=["replica"])
        received = CounterMetricFamily("kvgate_kv_events_received", "KV events received", labels=["replica"])
        gaps = CounterMetricFamily("kvgate_kv_events_gaps", "sequence gaps, by whether replay filled them",
                                   labels=["replica", "filled"])
        blocks = GaugeMetricFamily("kvgate_kv_events_index_blocks", "blocks the event index holds",
                                   labels=["replica"])
        checks = CounterMetricFamily("kvgate_kv_events_token_checks",
                                     "requests served at the replica whose last prompt block did or did not "
                                     "appear in its events (did not: kvgate's token ids are not the replica's)",
                                     labels=["replica", "appeared"])
        for name, stream in sorted(fleet.streams.items()):
            precise.add_metric([name], 1.0 if fleet.live(name) else 0.0)
            checks.add_metric([name, "yes"], fleet.confirmed.get(name, 0))
            checks.add_metric([name, "no"], fleet.unconfirmed.get(name, 0))
            received.add_metric([name], stream.events)
            gaps.add_metric([name, "yes"], stream.gaps_replayed)
            gaps.add_metric([name, "no"], stream.gaps - stream.gaps_replayed)
            blocks.add_metric([name], fleet.index.size(name))
        yield from (precise, received, gaps, blocks, checks)


class _QueueCollector(Collector):
    """The fair queue now (gateway.proxy.admission): requests waiting, per tenant, and each
    replica's admission limit for this instance."""

    def __init__(self, admission: Callable[[], Any]) -> None:
        self._admission = admission

    def collect(self) -> Iterator[Metric]:
        admission = self._admission()
        if admission is None:
            return
        depth = GaugeMetricFamily("kvgate_queue_depth", "requests waiting in kvgate's fair queue for a replica "
                                  "slot, per tenant", labels=["tenant"])
        for tenant, n in sorted(admission.depths().items()):
            depth.add_metric([tenant], n)
        limit = GaugeMetricFamily("kvgate_replica_admission_limit",
                                  "requests this instance sends the replica before queueing (configured "
                                  "max_in_flight, or the seats it showed plus one, less other clients' load); "
                                  "absent: none",
                                  labels=["replica"])
        for r in admission.pool.replicas.values():
            value = admission.limit(r)
            if value is not None:
                limit.add_metric([r.name], value)
        yield depth
        yield limit


class Metrics:
    def __init__(self, pool: Callable[[], ReplicaPool | None] = lambda: None, *,
                 cache: Callable[[], Any] = lambda: None, policy: Callable[[], Any] = lambda: None,
                 kv_events: Callable[[], Any] = lambda: None, admission: Callable[[], Any] = lambda: None,
                 routing_sync: Callable[[], Any] = lambda: None, multiprocess_dir: Path | None = None) -> None:
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
        self.queue_wait = Histogram("kvgate_queue_wait_seconds", "time requests waited in kvgate's fair queue, "
                                    "per tenant (only requests that had to wait)", ["tenant"],
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_exits = Counter("kvgate_queue_exits", "how waits in the fair queue ended: served, timeout "
                                   "(429), disconnect, shutdown (503)", ["tenant", "outcome"], registry=r)
        # What routing saved (gateway.observe.savings): prompt tokens computed, and the same at each
        # replica's learned prefill rate, by the fleet (exact) and by round robin (the shadow's estimate).
        self.prefill_tokens = Counter("kvgate_prefill_computed_tokens",
                                      "prompt tokens computed (prompt - cached): placement=actual as the replicas "
                                      "reported, round_robin as the sampled shadow estimates round robin would "
                                      "have, at the replica it would have used", ["placement", "replica", "tenant"],
                                      registry=r)
        self.prefill_seconds = Counter("kvgate_prefill_computed_seconds",
                                       "kvgate_prefill_computed_tokens at each replica's learned prefill rate "
                                       "(GPU-seconds; not counted before a replica's rate is known)",
                                       ["placement", "replica", "tenant"], registry=r)
        self.semantic_saved = Counter("kvgate_semantic_cache_saved_tokens",
                                      "tokens never sent to a replica: the stored usage of answers served from "
                                      "the semantic cache, by kind (prompt, completion)", ["kind", "tenant"],
                                      registry=r)
        self.semantic_saved_decode = Counter("kvgate_semantic_cache_saved_decode_seconds",
                                             "decode seconds the semantic cache's hits saved: their completion "
                                             "tokens at the decode time per token measured on relayed streams",
                                             ["tenant"], registry=r)
        # P/D fleets (gateway.proxy.disagg): each leg by role, the decisions and their reasons,
        # the prefill side's prompt and cached tokens (its hit ratio), the tokens decode replicas
        # pulled, and each failed leg's fallback.
        self.pd_legs = Counter("kvgate_pd_legs", "P/D legs sent, by role (prefill, decode), replica and "
                               "outcome (ok, failed)", ["role", "replica", "outcome"], registry=r)
        self.pd_decisions = Counter("kvgate_pd_decisions", "P/D requests by decision (remote prefill or local) "
                                    "and its reason", ["decision", "reason"], registry=r)
        self.pd_prefill_tokens = Counter("kvgate_pd_prefill_tokens", "prompt tokens of prefill legs by kind "
                                         "(prompt, cached): the prefill side's hit ratio", ["kind", "replica"],
                                         registry=r)
        self.pd_transfer_tokens = Counter("kvgate_pd_transfer_tokens", "prompt tokens decode replicas pulled "
                                          "from prefill replicas (routing's estimate)", ["replica"], registry=r)
        self.pd_fallbacks = Counter("kvgate_pd_fallbacks", "failed P/D legs by leg (prefill, decode) and what "
                                    "followed (retry on another replica, local prefill)", ["leg", "fallback"],
                                    registry=r)
        self.multiprocess_dir = multiprocess_dir
        scraped = (_CacheCollector(cache), _PolicyCollector(policy), _KVEventsCollector(kv_events),
                   _QueueCollector(admission), _FactsCollector(routing_sync, policy))
        if multiprocess_dir is None:
            for c in (_PoolCollector(pool), *scraped):
                r.register(c)
            return
        if values.ValueClass is values.MutexValue:  # chosen once, when prometheus_client is imported
            raise RuntimeError("a worker's metrics need PROMETHEUS_MULTIPROC_DIR set before it starts "
                               "(the supervisor, gateway.server.workers, sets it)")
        self.in_flight = Gauge("kvgate_replica_in_flight", "requests in flight from this instance",
                               ["replica"], registry=None, multiprocess_mode="livesum")
        self._in_flight_names: set[str] = set()
        self._summed = CollectorRegistry(auto_describe=False)
        MultiProcessCollector(self._summed, path=str(multiprocess_dir))
        self._replica_facts = CollectorRegistry(auto_describe=False)
        for c in (_PoolCollector(pool, in_flight=False), *scraped):
            self._replica_facts.register(c)

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
