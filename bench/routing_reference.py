"""Omniscient references: what a router that could read every KV pool would reach.

None is a router anyone could deploy: they read the simulated replicas
themselves (``bench.routing_sim`` hands them the engines), exactly what each
KV pool holds and exactly how many requests each replica has in flight.

``run_bounded_reference`` (``RunBoundedReference``), **the hit-ratio
yardstick** the benchmarks divide by (``%ref``): greedy longest cached prefix
(``pool.match`` of the request's KV blocks) among the replicas whose count of
requests placed so far by this oracle, this one included, stays within
``ceil(1.3 x mean placed so far)`` (the mean counting this request; the least
placed replica always fits); ties go to the least placed, then the name. It
bounds what each replica takes over the run, not what it has in flight, so a
warm replica may take a burst as long as its share over the run stays within
1.3x: a request-count bound that lets each organisation stay on its replica.

``bounded_reference`` (``BoundedReference``), the earlier yardstick, off by
default now: the same greedy rule among the replicas whose in-flight, this
request included, stays within the bounded-loads cap ``ceil((1+eps) x mean
in-flight)`` (``load_bound``; eps 0.25 as kvgate's bound); ties go to the
least loaded, then to the name. Bounding in-flight at every decision spreads a
burst of one prefix over every replica, as a bounded router does, so it
understates the reuse available; run it with ``--policies ...
bounded_reference``.

The TTFT oracles (``TTFTReference``, bounded and not) are the latency
yardsticks.

Greedy, not optimal: they do not plan ahead, so a real policy can beat them on
a workload where spreading a hot prefix early pays later.
"""

from __future__ import annotations

from typing import Callable, Sequence

from routing.base import ReplicaView, RouteFeedback, RouteRequest

from .routing_sim import SimEngine, load_bound
from .workloads import Request

__all__ = ["BoundedReference", "REFERENCE", "RunBoundedReference", "RUN_REFERENCE", "RUN_EPSILON", "TTFTReference",
           "TTFT_BOUNDED", "TTFT_UNBOUNDED"]

REFERENCE = "bounded_reference"
RUN_REFERENCE = "run_bounded_reference"
# The run-level reference's bound: each replica at most ceil(1.3 x the mean placed so far), the figure.
RUN_EPSILON = 0.3
TTFT_BOUNDED = "ttft_oracle"
TTFT_UNBOUNDED = "ttft_oracle_unbounded"


class _Oracle:
    """What the references share: the simulator's oracle hook, the fleet's loads and the cap."""

    name = "oracle"

    def __init__(self, epsilon: float = 0.25) -> None:
        self.epsilon = epsilon

    def _fleet(self, engines: Sequence[SimEngine],
               views: Sequence[ReplicaView]) -> tuple[dict[str, SimEngine], dict[str, int], int]:
        """Each replica's engine and in-flight by name, and the cap this request counts in."""
        by_name = {e.name: e for e in engines}
        loads = {v.name: by_name[v.name].load() for v in views}
        return by_name, loads, load_bound(sum(e.load() for e in engines) + 1, len(engines), self.epsilon)

    def prefer(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
        raise TypeError(f"{self.name} reads the simulated replicas: run it through bench.routing_sim")

    def observe(self, request: RouteRequest, feedback: RouteFeedback) -> None:
        return None


class BoundedReference(_Oracle):
    name = REFERENCE

    def choose_sim(self, request: Request, engines: Sequence[SimEngine],
                   views: Sequence[ReplicaView]) -> list[ReplicaView]:
        """Every replica in ``views``, the chosen one first (the simulator's oracle hook)."""
        by_name, loads, bound = self._fleet(engines, views)
        hashes = request.kv_hashes

        def rank(v: ReplicaView) -> tuple[int, int, int, str]:
            fits = loads[v.name] + 1 <= bound
            return (not fits, -by_name[v.name].pool.match(hashes) if fits else 0, loads[v.name], v.name)

        return sorted(views, key=rank)


class RunBoundedReference(_Oracle):
    """Greedy longest cached prefix, each replica within ceil(1.3 x mean) of the requests placed over the run."""

    name = RUN_REFERENCE

    def __init__(self, epsilon: float = RUN_EPSILON) -> None:
        super().__init__(epsilon)
        self.placed: dict[str, int] = {}  # requests this oracle sent to each replica so far

    def bound(self, replicas: int) -> int:
        """The most requests one replica may have been sent, this request included."""
        return load_bound(sum(self.placed.values()) + 1, replicas, self.epsilon)

    def choose_sim(self, request: Request, engines: Sequence[SimEngine],
                   views: Sequence[ReplicaView]) -> list[ReplicaView]:
        """Every replica in ``views``, the chosen one first (the simulator's oracle hook)."""
        by_name = {e.name: e for e in engines}
        bound = self.bound(len(views))
        placed = self.placed
        hashes = request.kv_hashes

        def rank(v: ReplicaView) -> tuple[bool, int, int, str]:
            count = placed.get(v.name, 0)
            fits = count + 1 <= bound
            return (not fits, -by_name[v.name].pool.match(hashes) if fits else 0, count, v.name)

        order = sorted(views, key=rank)
        placed[order[0].name] = placed.get(order[0].name, 0) + 1
        return order


class TTFTReference(_Oracle):
    """The greedy time-to-first-token oracle: each request to the replica where it starts first.

    Like the bounded reference it reads the simulated replicas, but it ranks
    them by the time to first token the request would have there, exactly as
    the simulator will give it if nothing else arrives: the rest of the prefill
    under way, then one prefill step of everything waiting there and of this
    request's own uncached tokens (each read from that replica's KV pool now).
    Bounded, it chooses among the replicas under the same cap as the bounded
    reference; unbounded, among all. It answers one question for the benchmark:
    on a workload where an unbounded policy has a lower TTFT p95 than kvgate's,
    is the bound what costs it? If the bounded oracle, which knows every queue
    and every pool, cannot reach that p95 either while the unbounded one can,
    no greedy router that keeps the bound can. (Greedy, like the other: it
    does not plan, so it is not a proof over every bounded policy.)
    """

    def __init__(self, clock: Callable[[], float], bounded: bool = True, epsilon: float = 0.25) -> None:
        super().__init__(epsilon)
        self.clock = clock  # simulated time
        self.name = TTFT_BOUNDED if bounded else TTFT_UNBOUNDED
        self.bounded = bounded
        # The time to first token it expected of each request it placed, in order.
        self.predicted: list[float] = []

    def choose_sim(self, request: Request, engines: Sequence[SimEngine],
                   views: Sequence[ReplicaView]) -> list[ReplicaView]:
        by_name, loads, bound = self._fleet(engines, views)
        hashes = list(request.kv_hashes)
        size = engines[0].block_size if engines else 16
        now = self.clock()

        def ttft(e: SimEngine) -> float:
            rest = max(0.0, e.prefill_end - now) if e.prefill else 0.0
            ahead = sum(j.req.prompt_tokens - e.pool.match(list(j.req.kv_hashes)) * size for j in e.waiting)
            own = request.prompt_tokens - e.pool.match(hashes) * size
            return rest + e.timing.prefill_time(ahead + own)

        # Each eligible replica's figure, once; the others go last, least loaded first.
        times = {v.name: ttft(by_name[v.name]) for v in views if not self.bounded or loads[v.name] + 1 <= bound}
        order = sorted(views, key=lambda v: (v.name not in times, times.get(v.name, 0.0), loads[v.name], v.name))
        self.predicted.append(times[order[0].name])
        return order
