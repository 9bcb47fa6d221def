"""A discrete-event simulation of a vLLM fleet behind one or more routers, in one process.

Each replica is a ``SimEngine``: ``vllm_sim.kv.KVPool`` for its prefix cache
(finite: eviction is real) and ``vllm_sim.timing.TimingModel`` for step times.
The scheduler is vLLM's without chunked prefill: waiting requests are admitted
FIFO while a sequence slot and KV blocks are free, and prefilled together
(one step costing ``prefill_time`` of their uncached tokens) ahead of decode;
between prefills every running sequence decodes one token per step of
``decode_step_time(batch)``. Decode is advanced analytically between events,
so the cost is per request, not per engine step, and an hour of traffic
replays in seconds.

Routers are ``RoutingPolicy`` objects, one per gateway instance, each with its
own ``ReplicaView`` objects: its own in-flight counts, plus the replicas'
scraped metrics (running, waiting, KV usage), refreshed every ``scrape_s`` and
shared by all instances, as ``gateway.pool`` does. A request picks an instance
uniformly at random (clients spread over gateway pods by a Service), is routed
to the first replica of its preference order, and on completion its instance
calls ``observe`` with the engine's real ``cached_tokens``.
"""

from __future__ import annotations

import heapq
import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from routing.base import RouteFeedback, RouteRequest, RoutingPolicy
from vllm_sim.kv import Allocation, KVPool
from vllm_sim.timing import TimingModel

from .workloads import Request, Workload

__all__ = ["SimSettings", "SimView", "RunStats", "PolicyFactory", "simulate"]

_ARRIVE, _STEP, _SCRAPE, _GOSSIP = 0, 1, 2, 3


@dataclass(slots=True)
class SimSettings:
    replicas: int = 8
    kv_tokens: int = 1 << 20
    block_size: int = 16
    timing: TimingModel = field(default_factory=TimingModel)
    max_batched_tokens: int = 16384
    scrape_s: float = 1.0
    instances: int = 1
    seed: int = 7
    # Measure agreement: ask every instance (side-effect free ``peek``) where it would send each request.
    agreement: bool = False
    # Instances share what they learn (routing.share_index): each fact reaches the
    # others this many seconds later (a Redis stream's round trip), None: off.
    share_s: float | None = None


@dataclass(eq=False, slots=True)
class SimView:
    """What a router instance sees of a replica (``routing.base.ReplicaView``)."""

    name: str
    weight: float = 1.0
    in_flight: int = 0
    waiting: float | None = None
    running: float | None = None
    kv_usage: float | None = None
    in_flight_at_scrape: int = 0


@dataclass(eq=False, slots=True)
class _Job:
    req: Request
    route: RouteRequest
    instance: int
    engine: "SimEngine"
    arrival: float
    alloc: Allocation | None = None
    ttft: float | None = None


class SimEngine:
    """One replica: KV pool, waiting queue, running batch, and a prefill in progress."""

    def __init__(self, name: str, settings: SimSettings) -> None:
        self.name = name
        self.pool = KVPool(max(1, settings.kv_tokens // settings.block_size), settings.block_size)
        self.timing = settings.timing
        self.max_batched = settings.max_batched_tokens
        self.waiting: deque[_Job] = deque()
        self.running: list[tuple[float, int, _Job]] = []  # (decode progress at which it finishes, seq, job)
        self.prefill: list[_Job] = []
        self.progress = 0.0  # tokens decoded by every running sequence so far (processor sharing)
        self.decoding = False
        self.version = 0
        self.last = 0.0
        self.load_area = 0.0
        self.busy = 0.0

    def load(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.prefill)

    def advance(self, now: float) -> None:
        """Account time up to ``now``: decode progress and the load integral."""
        dt = now - self.last
        if dt > 0:
            self.load_area += self.load() * dt
            if self.decoding and self.running:
                self.progress += dt / self.timing.decode_step_time(len(self.running))
                self.busy += dt
            elif self.prefill:
                self.busy += dt
        self.last = now

    def admit(self) -> tuple[list[_Job], int]:
        """Jobs to prefill now (FIFO, while slots, KV and the token budget allow)."""
        batch: list[_Job] = []
        uncached = 0
        slots = self.timing.max_num_seqs - len(self.running)
        while self.waiting and len(batch) < slots and (not batch or uncached < self.max_batched):
            job = self.waiting[0]
            alloc = self.pool.allocate(list(job.req.kv_hashes), job.req.prompt_tokens + job.req.output_tokens)
            if alloc is None:
                break
            self.waiting.popleft()
            job.alloc = alloc
            batch.append(job)
            uncached += job.req.prompt_tokens - alloc.cached_tokens
        return batch, uncached


@dataclass
class RunStats:
    policy: str
    workload: str
    instances: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    ttfts: list[float] = field(default_factory=list)
    makespan: float = 0.0
    loads: list[float] = field(default_factory=list)
    busy: list[float] = field(default_factory=list)
    follow_ups: int = 0
    follow_ups_warm: int = 0
    agreement_checked: int = 0
    agreement_same: int = 0
    route_s: float = 0.0
    routed: int = 0
    dropped: int = 0
    wall_s: float = 0.0

    @property
    def hit_ratio(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def ttft(self, q: float) -> float:
        if not self.ttfts:
            return float("nan")
        xs = sorted(self.ttfts)
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    @property
    def max_over_mean_load(self) -> float:
        mean = sum(self.loads) / len(self.loads) if self.loads else 0.0
        return max(self.loads) / mean if mean else float("nan")

    @property
    def throughput(self) -> float:
        return self.output_tokens / self.makespan if self.makespan else 0.0

    @property
    def warm_share(self) -> float:
        return self.follow_ups_warm / self.follow_ups if self.follow_ups else float("nan")

    @property
    def agreement(self) -> float:
        return self.agreement_same / self.agreement_checked if self.agreement_checked else float("nan")

    @property
    def route_us(self) -> float:
        return self.route_s / self.routed * 1e6 if self.routed else float("nan")


Clock = Callable[[], float]
PolicyFactory = Callable[[Clock], RoutingPolicy]


class _Fleet:
    def __init__(self, workload: Workload, make_policy: PolicyFactory, settings: SimSettings) -> None:
        self.w = workload
        self.s = settings
        self.now = 0.0
        # Policies read simulated time (load averages), never the wall clock.
        self.policies = [make_policy(lambda: self.now) for _ in range(settings.instances)]
        self.engines = [SimEngine(f"r{i}", settings) for i in range(settings.replicas)]
        self.by_name = {e.name: e for e in self.engines}
        self.views = [[SimView(e.name) for e in self.engines] for _ in self.policies]
        self.view_of = [{v.name: v for v in views} for views in self.views]
        self.rng = random.Random(settings.seed)
        self.events: list[tuple[float, int, int, object, int]] = []
        self.seq = 0
        self.routed_to: dict[int, str] = {}
        self.followers: dict[int, list[Request]] = {}
        self.stats = RunStats(self.policies[0].name, workload.name, len(self.policies))
        self.outstanding = 0

    def push(self, t: float, kind: int, obj: object, version: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, obj, version))

    # -- routing -----------------------------------------------------------------------
    def route(self, req: Request, now: float) -> None:
        inst = self.rng.randrange(len(self.policies))
        route = RouteRequest(req.endpoint, req.model, req.namespace, req.body(),
                             boundary_hint=req.headers.get("x-kvgate-cache-boundary"))
        started = time.perf_counter()
        order = self.policies[inst].prefer(route, self.views[inst])
        self.stats.route_s += time.perf_counter() - started
        self.stats.routed += 1
        name = order[0].name
        if self.s.agreement and len(self.policies) > 1:
            self._agreement(route, name)
        self.view_of[inst][name].in_flight += 1
        self._publish(inst, now)
        if req.prev is not None:
            # The previous turn's replica, known from when it was routed (it may still be running).
            self.stats.follow_ups += 1
            self.stats.follow_ups_warm += self.routed_to.get(req.prev) == name
        self.routed_to[req.rid] = name
        engine = self.by_name[name]
        engine.advance(now)
        engine.waiting.append(_Job(req, route, inst, engine, now))
        self.kick(engine, now)

    def _publish(self, inst: int, now: float) -> None:
        gossip = getattr(self.policies[inst], "gossip", None)
        if self.s.share_s is None or gossip is None or not len(gossip):
            return
        self.push(now + self.s.share_s, _GOSSIP, (inst, gossip.drain()))

    def _deliver(self, inst: int, facts: list) -> None:
        for i, policy in enumerate(self.policies):
            if i != inst:
                for fact in facts:
                    policy.learn_remote(fact)  # type: ignore[attr-defined]

    def _agreement(self, route: RouteRequest, chosen: str) -> None:
        self.stats.agreement_checked += 1
        same = True
        for i, policy in enumerate(self.policies):
            peek = getattr(policy, "peek", None)
            if peek is not None and peek(route, self.views[i])[0].name != chosen:
                same = False
        self.stats.agreement_same += same

    # -- engine ------------------------------------------------------------------------
    def kick(self, e: SimEngine, now: float) -> None:
        """Start the engine's next step unless a prefill is under way."""
        if e.prefill:
            return
        e.advance(now)
        batch, uncached = e.admit()
        e.version += 1
        if batch:
            e.prefill, e.decoding = batch, False
            self.push(now + e.timing.prefill_time(uncached), _STEP, e, e.version)
            return
        if e.waiting and not e.running:
            self._drop(e.waiting.popleft(), now)  # larger than the whole pool: cannot ever run
            self.kick(e, now)
            return
        e.decoding = bool(e.running)
        if e.running:
            left = max(0.0, e.running[0][0] - e.progress)
            self.push(now + left * e.timing.decode_step_time(len(e.running)), _STEP, e, e.version)

    def step(self, e: SimEngine, version: int, now: float) -> None:
        if version != e.version:
            return
        e.advance(now)
        if e.prefill:
            for job in e.prefill:
                job.ttft = now - job.arrival
                self.seq += 1
                heapq.heappush(e.running, (e.progress + job.req.output_tokens - 1, self.seq, job))
            e.prefill = []
        while e.running and e.running[0][0] <= e.progress + 1e-9:
            self.complete(heapq.heappop(e.running)[2], now)
        self.kick(e, now)

    def complete(self, job: _Job, now: float) -> None:
        e, req = job.engine, job.req
        assert job.alloc is not None and job.ttft is not None
        e.pool.release(job.alloc)
        self.view_of[job.instance][e.name].in_flight -= 1
        self.policies[job.instance].observe(
            job.route, RouteFeedback(e.name, req.prompt_tokens, job.alloc.cached_tokens, True))
        self._publish(job.instance, now)
        st = self.stats
        st.prompt_tokens += req.prompt_tokens
        st.cached_tokens += job.alloc.cached_tokens
        st.output_tokens += req.output_tokens
        st.ttfts.append(job.ttft)
        st.makespan = max(st.makespan, now)
        self.outstanding -= 1
        for nxt in self.followers.pop(req.rid, ()):
            self.push(now + nxt.arrival, _ARRIVE, nxt)

    def _drop(self, job: _Job, now: float) -> None:
        self.stats.dropped += 1
        self.view_of[job.instance][job.engine.name].in_flight -= 1
        self.outstanding -= 1
        for nxt in self.followers.pop(job.req.rid, ()):
            self.push(now + nxt.arrival, _ARRIVE, nxt)

    def scrape(self) -> None:
        for e in self.engines:
            running, waiting, usage = float(len(e.running) + len(e.prefill)), float(len(e.waiting)), e.pool.usage
            for views in self.view_of:
                v = views[e.name]
                v.running, v.waiting, v.kv_usage = running, waiting, usage
                v.in_flight_at_scrape = v.in_flight

    # -- main loop ---------------------------------------------------------------------
    def run(self) -> RunStats:
        for req in self.w.requests:
            if req.after is None:
                self.push(req.arrival, _ARRIVE, req)
            else:
                self.followers.setdefault(req.after, []).append(req)
        self.outstanding = len(self.w.requests)
        self.push(0.0, _SCRAPE, None)
        while self.events and self.outstanding > 0:
            now, _, kind, obj, version = heapq.heappop(self.events)
            self.now = now
            if kind == _ARRIVE:
                self.route(obj, now)  # type: ignore[arg-type]
            elif kind == _STEP:
                self.step(obj, version, now)  # type: ignore[arg-type]
            elif kind == _GOSSIP:
                self._deliver(*obj)  # type: ignore[misc]
            else:
                self.scrape()
                self.push(now + self.s.scrape_s, _SCRAPE, None)
        for e in self.engines:
            e.advance(self.stats.makespan)
            self.stats.loads.append(e.load_area / self.stats.makespan if self.stats.makespan else 0.0)
            self.stats.busy.append(e.busy / self.stats.makespan if self.stats.makespan else 0.0)
        return self.stats


def simulate(workload: Workload, make_policy: PolicyFactory, settings: SimSettings) -> RunStats:
    """Replay ``workload`` through ``settings.instances`` fresh policies, ``make_policy(clock)`` each."""
    started = time.perf_counter()
    stats = _Fleet(workload, make_policy, settings).run()
    stats.wall_s = time.perf_counter() - started
    return stats
