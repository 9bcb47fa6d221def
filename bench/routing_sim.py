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

Replicas may differ in speed (``SimSettings.speeds``): replica i prefills at
``speeds[i]`` times the timing model's rate (its own ``TimingModel`` copy).

Routers are ``RoutingPolicy`` objects, one per gateway instance, each with its
own ``ReplicaView`` objects: its own in-flight counts, plus the replicas'
scraped metrics (running, waiting, KV usage, the prefill rate learned from
vLLM's two per-request prefill histograms, ``routing.rates``, and the KV pool's
size in tokens), refreshed every ``scrape_s`` and shared by all instances, as
``gateway.proxy.pool`` does. A request picks an instance
uniformly at random (clients spread over gateway pods by a Service), is routed
to the first replica of its preference order, and on completion its instance
calls ``observe`` with the engine's real ``cached_tokens``.

With ``kv_events`` the replicas publish KV events as vLLM does (``vllm_sim.kv``
records them, ``vllm_sim.kv_events`` encodes each step's batch in vLLM's wire
format, ``routing.kv_wire`` decodes it) and every instance's ``truth`` (a
policy attribute: prefix_affinity's precise mode, the peers' precise rules)
reads one index fed by them ``event_delay_s`` after the step that stored the
blocks; the instances share no other state. Their index is one object because
it is identical by construction (each instance applies the same batches in the
same order); what each instance has in flight stays its own. The workloads
carry the engine's block hashes, not token ids, so the token ids a router
sees stand in: 16 per block derived from the engine's hash of that block,
equal between two requests exactly as far as their real ids are block by block.

A policy with a ``choose_sim(request, engines, views)`` method is an oracle
(``bench.routing_reference``): it is given the replicas themselves (their KV
pools and queues) instead of only what a gateway sees.

Arrivals are the workload's own (open loop, and closed-loop follow-up turns),
or a fixed number of closed-loop clients (``SimSettings.closed_loop``, else
the workload's ``closed_loop``; see ``bench.workloads.ClosedLoop``).

Besides hit ratio and TTFT, every run records how evenly requests were spread:
per-replica request counts over the whole run, and at every routing decision
the chosen replica's in-flight (this request included) against the bounded-
loads cap ``ceil((1+eps) x mean in-flight)``, the mean taken over the fleet's
in-flight including this request (``load_bound``). ``max_bound_ratio`` above
1 means some replica took a request past that cap.
"""

from __future__ import annotations

import heapq
import math
import random
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable

from routing.base import RouteFeedback, RouteRequest, RoutingPolicy
from routing.kv_events import KVEvents
from routing.kv_index import KVEventIndex
from routing.kv_wire import decode_batch
from routing.rates import prefill_rate
from vllm_sim.kv import Allocation, KVPool
from vllm_sim.kv_events import encode_batch
from vllm_sim.timing import TimingModel

from .routing_stats import RunStats, belief_gap
from .workloads import ClosedLoop, Request, Workload, chains

__all__ = ["SimSettings", "SimView", "PolicyFactory", "simulate", "load_bound"]

_ARRIVE, _STEP, _SCRAPE, _GOSSIP, _EVENTS = 0, 1, 2, 3, 4


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
    # Replay by this many closed-loop clients (None: the workload's own arrivals, or its closed_loop).
    closed_loop: ClosedLoop | None = None
    # The epsilon of the bounded-loads cap every decision is measured against.
    bound_epsilon: float = 0.25
    # Replicas publish KV events; policies with a ``truth`` attribute read them.
    kv_events: bool = False
    # From the end of the step that stored the blocks to the index: a ZMQ hop on a LAN
    # and the consumer's turn on its event loop, a few milliseconds.
    event_delay_s: float = 0.005
    # Replica i prefills at speeds[i] x the timing model's rate (0.5: every prefill takes
    # twice as long; decode unchanged). None: all at 1.0.
    speeds: tuple[float, ...] | None = None
    # kvgate is told each replica's seats (its max_num_seqs, as ``max_in_flight``), as the docs ask
    # an operator to; False (kvgate's default configuration): unknown.
    seats_known: bool = False


def token_ids(req: Request, block_size: int) -> list[int]:
    """Stand-in token ids: 16 per full block from the engine's hash of it, then the partial tail."""
    out: list[int] = []
    pad = [0] * (block_size - 4)
    for h in req.kv_hashes:
        a, b = int.from_bytes(h[:8], "little"), int.from_bytes(h[8:16], "little")
        out += (a & 0xFFFFFFFF, a >> 32, b & 0xFFFFFFFF, b >> 32)
        out += pad
    out += [0] * max(0, req.prompt_tokens - len(out))
    return out


class BenchTruth(KVEvents):
    """Precise mode's truth without sockets: the shared event index, this instance's own in-flight overlay."""

    def __init__(self, index: KVEventIndex, clock: Callable[[], float]) -> None:
        super().__init__(index.block_size, clock=clock)
        self.index = index

    def live(self, name: str) -> bool:
        return True


def load_bound(in_flight: int, replicas: int, epsilon: float = 0.25) -> int:
    """The bounded-loads cap: ceil((1+eps) x in_flight / replicas), ``in_flight`` counting the new request.

    (Mirrokni et al., consistent hashing with bounded loads.) The least-loaded
    replica always fits under it, so a policy can always keep to it. Computed
    in integers where eps is a multiple of 1/100, so 1.25 x 8 / 4 is exactly 3.
    """
    if replicas < 1:
        raise ValueError("replicas must be >= 1")
    scaled = round((1 + epsilon) * 100)
    if abs(scaled - (1 + epsilon) * 100) < 1e-9:
        return max(1, -(-scaled * in_flight // (100 * replicas)))
    return max(1, math.ceil((1 + epsilon) * in_flight / replicas))


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
    prefill_rate: float | None = None
    kv_tokens: float | None = None
    seats: float | None = None  # the replica's max_num_seqs, when its operator configured it


@dataclass(eq=False, slots=True)
class _Job:
    req: Request
    route: RouteRequest
    instance: int
    engine: "SimEngine"
    arrival: float
    alloc: Allocation | None = None
    ttft: float | None = None
    kv_wait: float = 0.0  # time spent queued while its replica's next job could not get KV blocks
    prefill_s: float = 0.0  # its prefill step's length: from its scheduling to its first token


class SimEngine:
    """One replica: KV pool, waiting queue, running batch, and a prefill in progress."""

    def __init__(self, name: str, settings: SimSettings, speed: float = 1.0) -> None:
        self.name = name
        self.pool = KVPool(max(1, settings.kv_tokens // settings.block_size), settings.block_size,
                           events=settings.kv_events)
        self.block_size = settings.block_size
        # Its own copy when it runs at another speed (the settings' model is shared otherwise).
        self.timing = settings.timing if speed == 1.0 else replace(settings.timing, prefill_speed=speed)
        # vLLM's two per-request prefill histograms' _sums, added when a request finishes:
        # seconds from its scheduling to its first token (its batch's prefill step, whole,
        # for every job of the batch), and its prompt tokens not served from the cache.
        self.prefill_seconds_sum = 0.0
        self.prefill_tokens_sum = 0
        self.max_batched = settings.max_batched_tokens
        self.waiting: deque[_Job] = deque()
        self.running: list[tuple[float, int, _Job]] = []  # (decode progress at which it finishes, seq, job)
        self.prefill: list[_Job] = []
        self.prefill_end = 0.0  # when the prefill under way ends (the TTFT references read it)
        # Since when the queue's next job has been waiting for KV blocks (slots were free):
        # the wait a small pool adds, which no prefill figure shows (RunStats.kv_waits).
        self.kv_blocked_since: float | None = None
        self.progress = 0.0  # tokens decoded by every running sequence so far (processor sharing)
        self.decoding = False
        self.version = 0
        self.last = 0.0
        self.load_area = 0.0
        self.busy = 0.0
        self.requests = 0

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
        batch, uncached = self._admit()
        if batch and self.kv_blocked_since is not None:
            # Every job queued during the block, admitted now or still waiting, waited for memory
            # since it arrived or the block began.
            for job in (*batch, *self.waiting):
                job.kv_wait += max(0.0, self.last - max(self.kv_blocked_since, job.arrival))
            self.kv_blocked_since = None
        if not batch and self.waiting and len(self.running) < self.timing.max_num_seqs \
                and self.kv_blocked_since is None:
            self.kv_blocked_since = self.last
        return batch, uncached

    def _admit(self) -> tuple[list[_Job], int]:
        batch: list[_Job] = []
        uncached = 0
        slots = self.timing.max_num_seqs - len(self.running)
        while self.waiting and len(batch) < slots and (not batch or uncached < self.max_batched):
            job = self.waiting[0]
            ids = (job.route.token_ids or token_ids(job.req, self.block_size)) if self.pool.records_events else None
            alloc = self.pool.allocate(list(job.req.kv_hashes), job.req.prompt_tokens + job.req.output_tokens, ids)
            if alloc is None:
                break
            self.waiting.popleft()
            job.alloc = alloc
            batch.append(job)
            uncached += job.req.prompt_tokens - alloc.cached_tokens
        return batch, uncached


Clock = Callable[[], float]
PolicyFactory = Callable[[Clock], RoutingPolicy]


class _Fleet:
    def __init__(self, workload: Workload, make_policy: PolicyFactory, settings: SimSettings) -> None:
        self.w = workload
        self.s = settings
        self.now = 0.0
        # Policies read simulated time (load averages), never the wall clock.
        self.policies = [make_policy(lambda: self.now) for _ in range(settings.instances)]
        self.index = KVEventIndex(settings.block_size) if settings.kv_events else None
        if self.index is not None:
            for policy in self.policies:
                if hasattr(policy, "truth"):
                    policy.truth = BenchTruth(self.index, lambda: self.now)  # type: ignore[attr-defined]
        speeds = settings.speeds or (1.0,) * settings.replicas
        if len(speeds) != settings.replicas:
            raise ValueError(f"speeds: {len(speeds)} figures for {settings.replicas} replicas")
        self.engines = [SimEngine(f"r{i}", settings, speeds[i]) for i in range(settings.replicas)]
        self.by_name = {e.name: e for e in self.engines}
        # The operator told kvgate each replica's --max-num-seqs (``max_in_flight``), as the docs ask.
        seats = float(settings.timing.max_num_seqs) if settings.seats_known else None
        self.views = [[SimView(e.name, seats=seats) for e in self.engines] for _ in self.policies]
        self.view_of = [{v.name: v for v in views} for views in self.views]
        self.rng = random.Random(settings.seed)
        self.events: list[tuple[float, int, int, object, int]] = []
        self.seq = 0
        self.routed_to: dict[int, str] = {}
        self.followers: dict[int, list[Request]] = {}
        self.stats = RunStats(self.policies[0].name, workload.name, len(self.policies))
        self.outstanding = 0
        self.in_flight = 0  # requests routed and not yet completed, fleet-wide
        self.closed = settings.closed_loop or workload.closed_loop
        self.conversations: deque[list[Request]] = deque()
        self.client_of: dict[int, deque[Request]] = {}  # rid -> the rest of its client's conversation

    def push(self, t: float, kind: int, obj: object, version: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, obj, version))

    # -- routing -----------------------------------------------------------------------
    def route(self, req: Request, now: float) -> None:
        inst = self.rng.randrange(len(self.policies))
        route = RouteRequest(req.endpoint, req.model, req.namespace, req.body(),
                             boundary_hint=req.headers.get("x-kvgate-cache-boundary"))
        if self.index is not None:
            route.token_ids = token_ids(req, self.s.block_size)
        policy = self.policies[inst]
        oracle = getattr(policy, "choose_sim", None)
        started = time.perf_counter()
        if oracle is not None:
            order = oracle(req, self.engines, self.views[inst])
        else:
            order = policy.prefer(route, self.views[inst])
        self.stats.route_s += time.perf_counter() - started
        self.stats.routed += 1
        name = order[0].name
        self._account(self.by_name[name])
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

    def _account(self, chosen: SimEngine) -> None:
        """Request counts, and the chosen replica's in-flight against the bounded-loads cap."""
        self.in_flight += 1
        chosen.requests += 1
        bound = load_bound(self.in_flight, len(self.engines), self.s.bound_epsilon)
        ratio = (chosen.load() + 1) / bound
        st = self.stats
        st.max_bound_ratio = max(st.max_bound_ratio, ratio)
        st.over_bound += ratio > 1
        st.max_in_flight = max(st.max_in_flight, self.in_flight)

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
            duration = e.timing.prefill_time(uncached)
            done = e.prefill_end = now + duration
            for job in batch:
                job.prefill_s = duration
            self.push(done, _STEP, e, e.version)
            events = e.pool.take_events()
            if events and self.index is not None:
                # Published once the step has computed the blocks, as vLLM does.
                payload = encode_batch(events, e.block_size, ts=done)
                self.push(done + self.s.event_delay_s, _EVENTS, (e.name, payload))
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
                started = getattr(self.policies[job.instance], "started", None)
                if started is not None:  # the first token reaches the gateway (a stream's first byte)
                    started(job.route, e.name)
                    # What a first token teaches (ttft's DONE facts) goes out as the gateway's
                    # flush would send it, not with the instance's next decision.
                    self._publish(job.instance, now)
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
        e.prefill_seconds_sum += job.prefill_s
        e.prefill_tokens_sum += req.prompt_tokens - job.alloc.cached_tokens
        self.view_of[job.instance][e.name].in_flight -= 1
        self.policies[job.instance].observe(
            job.route, RouteFeedback(e.name, req.prompt_tokens, job.alloc.cached_tokens, True, ttft_s=job.ttft,
                                      completion_tokens=req.output_tokens))
        self._publish(job.instance, now)
        st = self.stats
        st.prompt_tokens += req.prompt_tokens
        st.cached_tokens += job.alloc.cached_tokens
        st.output_tokens += req.output_tokens
        st.ttfts.append(job.ttft)
        st.kv_waits.append(job.kv_wait)
        st.makespan = max(st.makespan, now)
        self._done(req, now)

    def _drop(self, job: _Job, now: float) -> None:
        self.stats.dropped += 1
        self.view_of[job.instance][job.engine.name].in_flight -= 1
        self._done(job.req, now)

    def _done(self, req: Request, now: float) -> None:
        self.outstanding -= 1
        self.in_flight -= 1
        if self.closed is not None:
            self._client_next(self.client_of.pop(req.rid, None), now)
            return
        for nxt in self.followers.pop(req.rid, ()):
            self.push(now + nxt.arrival, _ARRIVE, nxt)

    def _client_next(self, rest: deque[Request] | None, now: float) -> None:
        """A closed-loop client sends its conversation's next turn, else starts the next conversation."""
        assert self.closed is not None
        if not rest:
            if not self.conversations:
                return  # this client is done
            rest = deque(self.conversations.popleft())
        nxt = rest.popleft()
        self.client_of[nxt.rid] = rest
        self.push(self.closed.next_start(now), _ARRIVE, nxt)

    def scrape(self) -> None:
        for e in self.engines:
            running, waiting, usage = float(len(e.running) + len(e.prefill)), float(len(e.waiting)), e.pool.usage
            rate = prefill_rate(float(e.prefill_tokens_sum), e.prefill_seconds_sum)
            kv_tokens = float(e.pool.num_blocks * e.block_size)
            for views in self.view_of:
                v = views[e.name]
                v.running, v.waiting, v.kv_usage = running, waiting, usage
                v.prefill_rate, v.kv_tokens = rate, kv_tokens
                v.in_flight_at_scrape = v.in_flight

    # -- main loop ---------------------------------------------------------------------
    def run(self) -> RunStats:
        if self.closed is not None:
            self.conversations = deque(chains(self.w))
            for _ in range(self.closed.clients):
                self._client_next(None, 0.0)
        else:
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
            elif kind == _EVENTS:
                assert self.index is not None
                name, payload = obj  # type: ignore[misc]
                self.index.apply(name, decode_batch(payload))
            else:
                self.scrape()
                self.push(now + self.s.scrape_s, _SCRAPE, None)
        self.stats.belief_gap = belief_gap(self.policies)
        for e in self.engines:
            e.advance(self.stats.makespan)
            self.stats.loads.append(e.load_area / self.stats.makespan if self.stats.makespan else 0.0)
            self.stats.busy.append(e.busy / self.stats.makespan if self.stats.makespan else 0.0)
            self.stats.requests_per_replica.append(e.requests)
            self.stats.prefill_rates.append(prefill_rate(float(e.prefill_tokens_sum), e.prefill_seconds_sum))
            self.stats.computed_per_replica.append(e.prefill_tokens_sum)
        return self.stats


def simulate(workload: Workload, make_policy: PolicyFactory, settings: SimSettings) -> RunStats:
    """Replay ``workload`` through ``settings.instances`` fresh policies, ``make_policy(clock)`` each."""
    started = time.perf_counter()
    stats = _Fleet(workload, make_policy, settings).run()
    stats.wall_s = time.perf_counter() - started
    return stats
