"""The replica pool: membership, health, ejection, load view and in-flight leases.

Everything that changes a replica's state lives here, so accounting cannot
drift: routing policies only read ``Replica`` objects (``routing.base.ReplicaView``)
and the proxy only holds ``Lease`` objects, whose release is idempotent.

Health has two sources. Active: ``GET /health`` every ``health_interval_s``
(and ``/v1/models`` to discover models). Passive (Envoy-style outlier
detection): consecutive 5xx or connect errors eject a replica for
``eject_base_s x ejections`` (capped), never the last available one; it
returns when the ejection has expired and an active check passes. A 429 is
back-pressure and never counts. Load: ``vllm:num_requests_running`` /
``_waiting`` / ``kv_cache_usage_perc`` scraped from ``/metrics`` about every
second, the view every gateway instance shares. From the same scrape, each
replica's prefill rate (``routing.rates``: the ``_sum``s of vLLM's per-request
prefill histograms) and the size of its KV pool in tokens (``num_gpu_blocks`` x
``block_size``, labels of ``vllm:cache_config_info``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import httpx

from routing.base import others_reported
from routing.rates import RATE_METRICS, prefill_rate

from gateway.settings import PoolSettings, ReplicaSettings

log = logging.getLogger("kvgate.pool")


@dataclass(eq=False)
class Replica:
    name: str
    url: str
    weight: float = 1.0
    configured_models: tuple[str, ...] = ()
    discovered_models: frozenset[str] = frozenset()
    source: str = "config"  # "config" | "dns" | "admin"
    scheduling_policy: str = "fcfs"  # vLLM's --scheduling-policy: only "priority" takes `priority`
    max_in_flight: int | None = None  # configured admission limit (gateway.proxy.admission)
    # Its part in a P/D fleet (ReplicaSettings.role): "prefill", "decode" or "both".
    role: str = "both"
    # Seats the replica has shown it holds: its running count at a scrape that also showed
    # requests waiting beside a batch that is not prefilling (``_learn_seats``). None until then.
    capacity: float | None = None
    # The replica has shown it has no seat beyond ``capacity``: it kept a request waiting while it
    # held no more than ``capacity`` + 1 (``apply_vllm_metrics``). Admission then gives no probe
    # seat while slots are promised.
    capacity_confirmed: bool = False
    # Active health: unknown (None) until the first check answers.
    healthy: bool | None = None
    draining: bool = False
    ejected_until: float = 0.0
    ejections: int = 0
    consecutive_failures: int = 0
    last_ok: float = 0.0
    in_flight: int = 0
    # Of ``in_flight``, leases whose answer is in its last decode step and whose slot was handed
    # on (``admission.Ticket.last_step``): the replica finishes them at that step's end.
    ending: int = 0
    # The most ``held`` at once since the last scrape (``apply_vllm_metrics``).
    in_flight_peak: int = 0
    # Of ``in_flight``, the streams whose first event has not come back: the replica keeps them
    # waiting or is prefilling them (``_learn_seats``). An answer not streamed shows nothing before
    # its end, so it is not counted: one of them mid-prefill is unseen, as another client's is.
    unstarted: int = 0
    # Shared load view, from the replica's own /metrics.
    waiting: float | None = None
    running: float | None = None
    kv_usage: float | None = None
    in_flight_at_scrape: int = 0
    prefill_rate: float | None = None
    kv_tokens: float | None = None
    prefix_queries: float | None = None
    prefix_hits: float | None = None
    served: int = 0
    failures: int = 0
    _urls: dict[str, httpx.URL] = field(default_factory=dict, repr=False)

    @property
    def held(self) -> int:
        """This instance's requests the replica can be holding at a step's end: ``in_flight`` less
        those it finishes at the end of the step under way (``ending``)."""
        return self.in_flight - self.ending

    @property
    def seats(self) -> float | None:
        """Its sequence slots for routing (``routing.base.ReplicaView.seats``): the operator's
        ``max_in_flight``, vLLM's --max-num-seqs. Never the learned ``capacity``: a queue beside a
        full KV pool, or beside a prefill step in progress, shows fewer running than its seats."""
        return float(self.max_in_flight) if self.max_in_flight else None

    def url_for(self, path: str) -> httpx.URL:
        """Parsed once per path: URL parsing is a visible share of a proxied request's cost."""
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = httpx.URL(self.url + path)
        return url

    @property
    def models(self) -> frozenset[str]:
        return frozenset(self.configured_models) if self.configured_models else self.discovered_models

    def ejected(self, now: float) -> bool:
        return now < self.ejected_until

    def available(self, now: float) -> bool:
        # Unknown health counts as available: at start-up the first request should
        # not wait for the first check, and a refused connect is retried anyway.
        return self.healthy is not False and not self.draining and not self.ejected(now)

    def serves(self, model: str) -> bool:
        models = self.models
        return not models or model in models


class Lease:
    """One request's hold on a replica. ``release()`` may be called any number of times."""

    __slots__ = ("replica", "_released", "_on_release", "_started")

    def __init__(self, replica: Replica, on_release: Callable[[Replica], None], stream: bool = False) -> None:
        self.replica = replica
        self._released = False
        # Only a stream has a first token to wait for (``Replica.unstarted``).
        self._started = not stream
        self._on_release = on_release
        replica.in_flight += 1
        if stream:
            replica.unstarted += 1
        if replica.held > replica.in_flight_peak:
            replica.in_flight_peak = replica.held

    def started(self) -> None:
        """Its first token came back (``Replica.unstarted``); any number of calls."""
        if not self._started:
            self._started = True
            self.replica.unstarted -= 1

    def release(self) -> None:
        if not self._released:
            self.started()
            self._released = True
            self.replica.in_flight -= 1
            self._on_release(self.replica)

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass
class RetryBudget:
    """Envoy's retry budget: concurrent retries ≤ max(min, ratio x active requests)."""

    ratio: float
    minimum: int
    active_retries: int = 0

    def try_acquire(self, active_requests: int) -> bool:
        if self.active_retries >= max(self.minimum, int(self.ratio * active_requests)):
            return False
        self.active_retries += 1
        return True

    def release(self) -> None:
        self.active_retries = max(0, self.active_retries - 1)


@dataclass
class PoolEvents:
    """Callbacks the metrics layer subscribes to (no import cycle, no globals)."""

    on_eject: Callable[[Replica], None] = lambda r: None
    on_restore: Callable[[Replica], None] = lambda r: None
    on_failure: Callable[[Replica, str], None] = lambda r, kind: None
    # LoRA adapters a replica lists in /v1/models (an id with a parent model).
    on_adapters: Callable[[frozenset[str]], None] = lambda names: None
    # A lease ended: a slot is free on the replica (gateway.proxy.admission hands it on).
    on_release: Callable[[Replica], None] = lambda r: None
    # A scrape or health check may have changed what the replicas can take.
    on_refresh: Callable[[], None] = lambda: None


class ReplicaPool:
    def __init__(
        self,
        settings: PoolSettings,
        client: httpx.AsyncClient,
        replicas: Iterable[ReplicaSettings] = (),
        *,
        events: PoolEvents | None = None,
        clock: Callable[[], float] = time.monotonic,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.settings = settings
        self.client = client
        # The hot path sends through the transport directly; see Runtime.
        self.transport: httpx.AsyncBaseTransport = transport or client._transport
        self.clock = clock
        self.events = events or PoolEvents()
        self.replicas: dict[str, Replica] = {}
        self.budget = RetryBudget(settings.retry_budget_ratio, settings.retry_budget_min)
        self.active_requests = 0
        self._tasks: list[asyncio.Task[None]] = []
        for r in replicas:
            self.add(r.name, r.url, weight=r.weight, models=r.models, scheduling_policy=r.scheduling_policy,
                     max_in_flight=r.max_in_flight, role=r.role)

    # -- membership -------------------------------------------------------
    def add(self, name: str, url: str, *, weight: float = 1.0, models: Iterable[str] = (),
            source: str = "config", scheduling_policy: str = "fcfs", max_in_flight: int | None = None,
            role: str = "both") -> Replica:
        if name in self.replicas:
            raise ValueError(f"replica {name!r} already exists")
        replica = Replica(name=name, url=url.rstrip("/"), weight=weight,
                          configured_models=tuple(models), source=source, scheduling_policy=scheduling_policy,
                          max_in_flight=max_in_flight, role=role)
        self.replicas[name] = replica
        return replica

    def drain(self, name: str, draining: bool = True) -> Replica:
        replica = self.replicas[name]
        replica.draining = draining
        return replica

    def remove(self, name: str) -> Replica:
        # In-flight leases keep a reference and release into the detached object.
        return self.replicas.pop(name)

    # -- selection --------------------------------------------------------
    def eligible(self, model: str, roles: frozenset[str] | None = None) -> list[Replica]:
        """The replicas that can take a request for ``model`` now (of one of ``roles``: a P/D leg's)."""
        now = self.clock()
        return [r for r in self.replicas.values()
                if r.serves(model) and r.available(now) and (roles is None or r.role in roles)]

    @property
    def disaggregated(self) -> bool:
        """Whether any replica has a P/D role (prefill or decode): only then does P/D run."""
        return any(r.role != "both" for r in self.replicas.values())

    def known_model(self, model: str) -> bool:
        return any(r.serves(model) for r in self.replicas.values())

    def models(self, *, healthy_only: bool = True) -> list[str]:
        now = self.clock()
        names: set[str] = set()
        for r in self.replicas.values():
            if not healthy_only or r.available(now):
                names |= r.models
        return sorted(names)

    def acquire(self, replica: Replica, stream: bool = False) -> Lease:
        self.active_requests += 1
        return Lease(replica, self._released, stream)

    def _released(self, replica: Replica) -> None:
        self.active_requests -= 1
        self.events.on_release(replica)

    # -- passive health ---------------------------------------------------
    def record_success(self, replica: Replica) -> None:
        replica.consecutive_failures = 0
        replica.served += 1
        replica.last_ok = self.clock()

    def record_failure(self, replica: Replica, kind: str = "response") -> None:
        """A 5xx or connect error from the replica (never our own rejections, never 429).

        ``kind`` (connect, connect_timeout, http_503, ...; "response": a reply that failed
        after its status, a broken or stalled stream) labels kvgate_upstream_errors_total."""
        self.events.on_failure(replica, kind)
        replica.failures += 1
        replica.consecutive_failures += 1
        if replica.consecutive_failures >= self.settings.eject_consecutive_failures:
            self._eject(replica)

    def _eject(self, replica: Replica) -> None:
        now = self.clock()
        if replica.ejected(now):
            return
        others = [r for r in self.replicas.values() if r is not replica and r.available(now)]
        if replica.role != "prefill":
            # Only a decode-capable replica serves a whole request (a prefill replica's work can
            # always be done locally on one): those are the ones that must not all go.
            others = [r for r in others if r.role != "prefill"]
        if not others:
            # Never eject the last available replica: a degraded answer beats none.
            return
        replica.ejections += 1
        duration = min(self.settings.eject_base_s * replica.ejections, self.settings.eject_max_s)
        replica.ejected_until = now + duration
        replica.consecutive_failures = 0
        # The replica must prove itself to an active check before it returns.
        replica.healthy = False
        log.warning("ejected replica", extra={"replica": replica.name, "seconds": duration})
        self.events.on_eject(replica)

    # -- active health and load ------------------------------------------
    async def start(self) -> None:
        await self.check_all()
        self._tasks = [
            asyncio.create_task(self._loop(self.check_all, self.settings.health_interval_s), name="health"),
            asyncio.create_task(self._loop(self.scrape_all, self.settings.metrics_interval_s), name="scrape"),
        ]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except asyncio.CancelledError:
                pass
        self._tasks = []

    async def _loop(self, fn: Callable[[], "asyncio.Future[None] | object"], interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await fn()  # type: ignore[misc]
            except Exception:  # a monitoring hiccup must never kill the loop
                log.exception("pool monitor iteration failed")

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(r) for r in list(self.replicas.values())))
        self.events.on_refresh()

    async def check(self, replica: Replica) -> None:
        timeout = httpx.Timeout(min(2.0, self.settings.health_interval_s * 2))
        try:
            resp = await self.client.get(replica.url + "/health", timeout=timeout)
            ok = resp.status_code == 200
        except httpx.HTTPError:
            ok = False
        now = self.clock()
        if ok and not replica.configured_models and (not replica.discovered_models or not replica.healthy):
            replica.discovered_models = await self._discover(replica, timeout)
        was = replica.healthy
        if replica.ejected(now):
            return  # stays out until the ejection expires, whatever the check says
        replica.healthy = ok
        if ok and was is False:
            log.info("replica healthy again", extra={"replica": replica.name})
            self.events.on_restore(replica)
        if ok and replica.ejections and now - replica.last_ok > self.settings.eject_max_s:
            replica.ejections = 0  # a long healthy stretch forgives past ejections

    async def _discover(self, replica: Replica, timeout: httpx.Timeout) -> frozenset[str]:
        try:
            resp = await self.client.get(replica.url + "/v1/models", timeout=timeout)
            data = [m for m in resp.json().get("data", []) if isinstance(m, dict) and isinstance(m.get("id"), str)]
            # vLLM lists a LoRA adapter with its base model as parent: precise routing keys its
            # blocks apart (routing.token_keys), from its first request on.
            adapters = frozenset(m["id"] for m in data if isinstance(m.get("parent"), str) and m["parent"]
                                 and m["parent"] != m["id"])
            if adapters:
                self.events.on_adapters(adapters)
            return frozenset(m["id"] for m in data)
        except (httpx.HTTPError, ValueError, AttributeError, KeyError):
            return replica.discovered_models

    async def scrape_all(self) -> None:
        await asyncio.gather(*(self.scrape(r) for r in list(self.replicas.values()) if r.healthy is not False))
        self.events.on_refresh()

    async def scrape(self, replica: Replica) -> None:
        ours = replica.in_flight  # before the replica takes its figures (``apply_vllm_metrics``)
        try:
            resp = await self.client.get(replica.url + "/metrics", timeout=httpx.Timeout(2.0))
            if resp.status_code != 200:
                return
            apply_vllm_metrics(replica, resp.text, ours_before=ours)
        except httpx.HTTPError:
            return


_GAUGES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:gpu_cache_usage_perc": "kv_usage",  # pre-V1 name
    "vllm:prefix_cache_queries_total": "prefix_queries",
    "vllm:prefix_cache_hits_total": "prefix_hits",
    "vllm:gpu_prefix_cache_queries_total": "prefix_queries",
    "vllm:gpu_prefix_cache_hits_total": "prefix_hits",
    # Not replica attributes: apply_vllm_metrics turns the two into prefill_rate.
    **RATE_METRICS,
}
_CACHE_INFO = "vllm:cache_config_info"


def parse_vllm_metrics(text: str) -> dict[str, float]:
    """Sum the samples of the metrics kvgate reads, across label sets (one per model or engine).

    ``kv_tokens``: ``num_gpu_blocks`` x ``block_size`` from ``vllm:cache_config_info``'s
    labels, summed over its engines (each has a pool of its own); absent while vLLM
    has not sized its pool (``num_gpu_blocks="None"``)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name_end = line.find("{")
        space = line.rfind(" ")
        name = line[: name_end if name_end >= 0 else line.find(" ")]
        attr = _GAUGES.get(name)
        if attr is None:
            if name == _CACHE_INFO and name_end >= 0:
                tokens = _pool_tokens(line[name_end:space])
                if tokens is not None:
                    out["kv_tokens"] = out.get("kv_tokens", 0.0) + tokens
            continue
        try:
            value = float(line[space + 1:])
        except ValueError:
            continue
        out[attr] = out.get(attr, 0.0) + value
    return out


def _label(labels: str, key: str) -> str | None:
    """The value of label ``key`` in a ``{a="x",b="y"}`` block (values here never hold quotes)."""
    for opener in ("{", ","):
        start = labels.find(f'{opener}{key}="')
        if start >= 0:
            start += len(key) + 3
            end = labels.find('"', start)
            return labels[start:end] if end >= 0 else None
    return None


def _pool_tokens(labels: str) -> float | None:
    blocks, block_size = _label(labels, "num_gpu_blocks"), _label(labels, "block_size")
    try:
        tokens = int(blocks or "") * int(block_size or "")
    except ValueError:
        return None  # "None" before vLLM sizes the pool, or missing
    return float(tokens) if tokens > 0 else None


def apply_vllm_metrics(replica: Replica, text: str, ours_before: int | None = None) -> None:
    """``text``, the replica's ``/metrics``, read into ``replica``; ``ours_before``: this instance's
    requests in flight there when the scrape was sent (None: taken as those now)."""
    values = parse_vllm_metrics(text)
    tokens_sum, seconds_sum = values.pop("prefill_tokens_sum", None), values.pop("prefill_seconds_sum", None)
    if tokens_sum is not None and seconds_sum is not None:
        # None again after a restart (the counters start at zero) until a prefill finishes.
        replica.prefill_rate = prefill_rate(tokens_sum, seconds_sum)
    for attr, value in values.items():
        setattr(replica, attr, value)
    # Which of the reported requests were ours (routing.base.load_now). The replica took its
    # figures at some moment of the scrape's round trip; a request of ours that ended in it was
    # still counted there, so ours are the more of our count at its start and at its end. With
    # the count at the end only, each such request was read as another client's for a second.
    replica.in_flight_at_scrape = replica.in_flight if ours_before is None else max(ours_before, replica.in_flight)
    _learn_seats(replica)
    replica.in_flight_peak = replica.held  # the next scrape's peak counts from here


def _learn_seats(replica: Replica) -> None:
    """The replica's seats (``capacity``) from a scrape, and whether it has shown it has no more.

    vLLM leaves a request waiting while seats are free only when the step's token budget
    (--max-num-batched-tokens: 2048 by default on most GPUs, 8192 from 70 GB) went to prefill: it
    schedules the running requests first, a long prompt's next chunk among them, and admits waiting
    ones only while budget is left (``Scheduler.schedule``'s ``while token_budget > 0``). So a queue
    shows the seats only beside a batch that is not prefilling; beside one that is, it shows a
    prompt being chunked (a 6,000-token prompt beside one request kept waiting read as one seat,
    confirmed). This instance knows which of its own streams have their first token: while more
    of them lack it than the replica reports waiting, some of them run mid-prefill, and the scrape
    learns no seats. A request not streamed, or another client's, mid-prefill is not seen here.
    Beside a batch that is not prefilling, what runs is what it holds (--max-num-seqs or KV
    blocks); once known, any larger batch it runs raises it (admission's probe seat is how it gets
    the chance). The largest seen: a batch of long prompts holds fewer, and kvgate would rather let
    the replica queue one request than leave seats empty after a run of long prompts.

    The running count is a floor, never a ceiling: vLLM sets its gauges at the end of a step,
    after it counted the requests that finished in it out of running and before the next step
    admits waiting ones to their seats (``Scheduler.make_stats`` in ``update_from_output``). So a
    full replica scraped after a step in which a request finished shows a seat short beside a
    queue, and any number of such scrapes can agree on it. What proves the ceiling is a probe
    refused: a request kept waiting while the replica held no more than ``capacity`` + 1 (with a
    seat more, all of them would have run). Held: ours at their most since the last scrape, and
    others' as this scrape shows them. Ours at their most, not at the scrape: one that finished in
    the step has left our count by then, and it is the one the gauges no longer show. Every
    request the step held stays in our count until the step ends (a lease ends after its stream),
    so the peak counts it if the step ended after the last scrape, as it has while requests wait:
    vLLM then steps back to back, each step far shorter than the interval between scrapes. Of
    another client's requests only those the scrape shows are counted: one of theirs that
    finished in the step is as invisible here as ours would be at the scrape.

    While a flood that came before any limit was known queues at the replica, or a last-step
    hand-on (``admission.Ticket.last_step``) puts a request beside one finishing, the replica holds
    more than ``capacity`` + 1 and nothing is confirmed: admission keeps the probe seat, the
    replica runs all its seats, and the count rises to them."""
    running, waiting = replica.running, replica.waiting
    full = waiting is not None and waiting > 0 and replica.unstarted <= waiting  # a queue beside no prefill of ours
    if not running or not (full or replica.capacity is not None):
        return
    if replica.capacity is None or running > replica.capacity:
        replica.capacity, replica.capacity_confirmed = running, False
    if full and replica.in_flight_peak + others_reported(replica) <= replica.capacity + 1:
        replica.capacity_confirmed = True


def snapshot(pool: ReplicaPool) -> list[dict[str, Any]]:
    """A read-only view for /readyz, the admin API and the status page."""
    now = pool.clock()
    rows = []
    for r in pool.replicas.values():
        hit = ((r.prefix_hits or 0.0) / r.prefix_queries) if r.prefix_queries else None
        rows.append({
            "name": r.name, "url": r.url, "models": sorted(r.models), "healthy": r.healthy,
            "available": r.available(now), "draining": r.draining, "ejected": r.ejected(now),
            "ejections": r.ejections, "in_flight": r.in_flight, "running": r.running, "waiting": r.waiting,
            "kv_usage": r.kv_usage, "prefix_hit_rate": hit, "served": r.served, "failures": r.failures,
            "weight": r.weight, "source": r.source, "prefill_rate": r.prefill_rate, "kv_tokens": r.kv_tokens,
            "scheduling_policy": r.scheduling_policy, "max_in_flight": r.max_in_flight, "capacity": r.capacity,
            "capacity_confirmed": r.capacity_confirmed, "role": r.role,
        })
    return rows
