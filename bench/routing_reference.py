"""The bounded omniscient reference: what a router that could read every KV pool would reach.

It is not a router anyone could deploy: it reads the simulated replicas
themselves (``bench.routing_sim`` hands it the engines), exactly what each KV
pool holds and exactly how many requests each replica has in flight. Among the
replicas whose in-flight, this request included, stays within the
bounded-loads cap ``ceil((1+eps) x mean in-flight)`` (``load_bound``, the mean
counting this request; eps 0.25 as kvgate's bound), it picks the one whose pool
holds the longest prefix of the request's KV blocks; ties go to the least
loaded, then to the name. The least-loaded replica always fits under the cap,
so there is always a candidate.

Greedy, not optimal: it does not plan ahead, so a real policy can beat it on a
workload where spreading a hot prefix early pays later. Its hit ratio is the
yardstick the benchmarks divide by ("share of the bounded reference"): the
reuse that is available at that load bound, request by request, to a router
that knows everything the replicas know.
"""

from __future__ import annotations

from typing import Sequence

from routing.base import ReplicaView, RouteFeedback, RouteRequest

from .routing_sim import SimEngine, load_bound
from .workloads import Request

__all__ = ["BoundedReference", "REFERENCE"]

REFERENCE = "bounded_reference"


class BoundedReference:
    name = REFERENCE

    def __init__(self, epsilon: float = 0.25) -> None:
        self.epsilon = epsilon

    def choose_sim(self, request: Request, engines: Sequence[SimEngine],
                   views: Sequence[ReplicaView]) -> list[ReplicaView]:
        """Every replica in ``views``, the chosen one first (the simulator's oracle hook)."""
        by_name = {e.name: e for e in engines}
        loads = {v.name: by_name[v.name].load() for v in views}
        bound = load_bound(sum(e.load() for e in engines) + 1, len(engines), self.epsilon)
        hashes = request.kv_hashes

        def rank(v: ReplicaView) -> tuple[int, int, int, str]:
            fits = loads[v.name] + 1 <= bound
            return (not fits, -by_name[v.name].pool.match(hashes) if fits else 0, loads[v.name], v.name)

        return sorted(views, key=rank)

    def prefer(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
        raise TypeError("the bounded reference reads the simulated replicas: run it through bench.routing_sim")

    def observe(self, request: RouteRequest, feedback: RouteFeedback) -> None:
        return None
