"""The savings estimate checked: the shadow's round-robin figure against an exact replay.

    .venv/bin/python -m bench.savings             # the routing benchmark's workloads (a few minutes)
    .venv/bin/python -m bench.savings --quick     # small workloads (seconds)
    .venv/bin/python -m bench.savings --rates 0.25 0.0625 0.015625   # the error against memory

For every workload of ``bench.routing`` (same sizes, pools and arrival rates),
on the virtual-time fleet (``bench.routing_sim``): the default policy
(``routing.policy``'s default, ``ttft``) serves it with the savings ledger attached
(``routing.savings``, fed exactly as the gateway feeds it: after each answer,
with the request's routing blocks and the replica's reported usage), which
estimates what round robin would have computed. Then the same requests are
replayed through ``round_robin`` on the same simulated fleet: the prompt
tokens it really computed (prompt - cached, summed) is the exact
counterfactual. Printed: both, the error, the shadow's memory per replica and
its CPU per request (the ledger's own time: block sampling, shadow lookups,
accounting).

``--blocks tokens`` feeds the shadow token-block keys (precise mode, when the
gateway knows the token ids) instead of routing blocks (the default, when it
does not).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import Sequence

from routing import RoutingSettings, make_policy
from routing.base import ReplicaView, RouteFeedback, RouteRequest, RoutingPolicy
from routing.round_robin import RoundRobin
from routing.savings import SavingsLedger

from .pools import DEFAULT_RATIO, pool_size
from .routing import DEFAULT_DATA, build_workloads, calibrate, ideal_hit_ratio
from .routing_sim import SimSettings, SimView, simulate
from .workloads import Workload


class Attached:
    """The default policy with the ledger fed as the gateway feeds it (after each answer)."""

    def __init__(self, policy: RoutingPolicy, ledger: SavingsLedger, calls: list) -> None:  # type: ignore[type-arg]
        self.policy, self.ledger, self.calls = policy, ledger, calls
        self.name = policy.name
        self.fleet: Sequence[ReplicaView] = ()

    def prefer(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
        self.fleet = replicas
        self.ledger.place(request, replicas)  # as the gateway places it: when routed
        return self.policy.prefer(request, replicas)

    def observe(self, request: RouteRequest, feedback: RouteFeedback) -> None:
        self.policy.observe(request, feedback)
        # What the replicas looked like then (the views change as the run goes on), for the CPU replay.
        fleet = [SimView(v.name, prefill_rate=v.prefill_rate, kv_tokens=v.kv_tokens) for v in self.fleet]
        call = (request, request.namespace, feedback.replica, fleet, feedback.prompt_tokens or 0,
                feedback.cached_tokens or 0)
        self.calls.append(call)
        self.ledger.served(*call)


def cpu_us(calls: list, entries: int, rate: float) -> tuple[float, float]:  # type: ignore[type-arg]
    """The ledger's own CPU per request, replayed alone over the run's calls (timed inside the run,
    the simulator's garbage collections land in it), and the replay's round-robin estimate."""
    ledger = SavingsLedger(RoutingSettings(), entries=entries, rate=rate or None)
    for call in calls:
        ledger.served(*call)
    return ledger.cpu_s / max(1, len(calls)) * 1e6, ledger.totals().rr_computed_tokens


def run(w: Workload, rate: float, entries: int, base: SimSettings,
        tokens: bool) -> tuple[float, int, SavingsLedger, float, float]:
    ledger = SavingsLedger(RoutingSettings(), entries=entries, rate=rate or None)
    calls: list = []  # type: ignore[type-arg]

    def make(clock):  # type: ignore[no-untyped-def]
        return Attached(make_policy(RoutingSettings(), clock=clock), ledger, calls)

    # With KV events on, the simulator gives every request token ids (stand-ins, equal exactly as
    # far as the engine's blocks are), so the shadow is fed token-block keys as in precise mode.
    stats = simulate(w, make, replace(base, kv_events=True) if tokens else base)
    estimate = ledger.totals().rr_computed_tokens
    rr = simulate(w, lambda clock: RoundRobin(), base)
    exact = rr.prompt_tokens - rr.cached_tokens
    us, again = cpu_us(calls, entries, rate)
    assert abs(again - estimate) < 1e-6 * max(1.0, estimate), (again, estimate)  # the replay is the run's
    return estimate, exact, ledger, stats.prompt_tokens - stats.cached_tokens, us


def parser(prog: str = "bench.savings", doc: str = __doc__) -> argparse.ArgumentParser:
    """The options (``bench.savings_e2e`` adds its own to them)."""
    p = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    p.add_argument("--data", default=DEFAULT_DATA)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--workloads", nargs="+",
                   default=["twin", "mtbench", "mooncake", "shared_prefix", "unique", "orgs_layered"])
    p.add_argument("--rates", type=float, nargs="+", default=[0],
                   help="shadow sample rates R (0: the rate --entries allows, as the gateway chooses it)")
    p.add_argument("--entries", type=int, default=8192, help="sampled blocks a replica's shadow may keep")
    p.add_argument("--blocks", choices=["routing", "tokens"], default="routing")
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--load", type=float, default=0.7)
    p.add_argument("--pool-ratio", type=float, default=DEFAULT_RATIO)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--mooncake-minutes", type=float, default=10.0)
    p.add_argument("--twin-requests", type=int, default=3600)
    p.add_argument("--twin-seed", type=int, default=1)
    p.add_argument("--layered-requests", type=int, default=1600)
    p.add_argument("--layered-seed", type=int, default=11)
    return p


def parse(argv: list[str] | None) -> argparse.Namespace:
    return parser().parse_args(argv)


def workload(name: str, args: argparse.Namespace) -> Workload:
    """The routing benchmark's workload ``name`` at the sizes ``args`` give."""
    print(f"building {name} ...", file=sys.stderr, flush=True)
    (w,) = build_workloads(argparse.Namespace(**{**vars(args), "workloads": [name], "kv_tokens": 0}))
    return w


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    print(f"blocks: {args.blocks}; {args.replicas} replicas; pools {args.pool_ratio:g} x the reused working set")
    print("| workload | R | RR computed, estimated | RR computed, exact | error | saved (est.) | "
          "shadows per replica | correction | CPU per request |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.workloads:
        w = workload(name, args)
        clients = w.closed_loop.clients if w.closed_loop else 0
        pool = pool_size(w, args.replicas, args.pool_ratio, clients=clients)
        base = SimSettings(replicas=args.replicas, kv_tokens=pool.kv_tokens, seed=args.seed)
        calibrate(w, ideal_hit_ratio(w), base, args.load)
        for rate in args.rates:
            estimate, exact, ledger, actual, us = run(w, rate, args.entries, base, args.blocks == "tokens")
            error = (estimate - exact) / exact if exact else float("nan")
            rr, mirror = ledger.rr.entries(), ledger.mirror.entries()
            n = max(1, len(rr))
            # Both shadows (round robin's and the mirror) and the worth table, per replica.
            per_replica = ledger.to_dict()["shadow"]["memory_bytes"] / n  # type: ignore[index]
            entries = (sum(rr.values()) + sum(mirror.values())) / n
            print(f"| {w.name} | 1/{1 / ledger.rr.rate:g} | {estimate:,.0f} | {exact:,} | {error:+.1%} | "
                  f"{1 - actual / estimate:.1%} | {per_replica / 1024:,.0f} KiB ({entries:,.0f} entries; pool "
                  f"{pool.blocks:,} blocks) | {ledger.correction:.4f} | {us:.0f} us |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
