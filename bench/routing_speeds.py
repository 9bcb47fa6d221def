"""Heterogeneous replicas: one at half prefill speed, what each policy learns and gives it.

    .venv/bin/python -m bench.routing_speeds                 # 2 generated families x 2 seeds
    .venv/bin/python -m bench.routing_speeds --slow 0.25     # replica r0 at a quarter of the speed

Replica ``r0`` prefills at ``--slow`` times the others' speed
(``SimSettings.speeds``); pools are sized from each workload as in the suite
(``bench.pools``). For each policy the table shows the rate each replica
reported (``routing.rates``: the prefill histograms' ratio, what ``ttft``
learns), r0's share of the prompt tokens the fleet computed against a fast
replica's, the fleet's hit ratio and TTFT p50/p95. A policy that knows the
replicas' speeds gives the slow one less cold work; one that counts requests
or queues alone gives it its share, and its queue sets the tail.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace

from .pools import DEFAULT_RATIO, pool_size
from .routing import POLICIES
from .routing_sim import SimSettings, simulate
from .workloads.generated import FAMILIES, build

FAMILY_NAMES = ("heavy4-closed8", "layered-8orgs-closed8")
POLICY_NAMES = ("round_robin", "least_load", "sglang_cache_aware", "prefix_affinity", "ttft")


def run(family_name: str, seed: int, slow: float, policies: tuple[str, ...], requests: int) -> list[str]:
    family = next(f for f in FAMILIES if f.name == family_name)
    w = build(family, seed, requests)
    speeds = (slow,) + (1.0,) * (family.replicas - 1)
    settings = SimSettings(replicas=family.replicas, seed=seed, speeds=speeds)
    pool = pool_size(w, family.replicas, DEFAULT_RATIO, clients=family.clients, block_size=settings.block_size)
    settings = replace(settings, kv_tokens=pool.kv_tokens)
    rows = [f"## {family_name}, seed {seed}: {len(w.requests)} requests, r0 at {slow:g}x; {pool.describe()}",
            f"{'policy':20} {'rate r0':>8} {'rate fast':>9} {'r0/fast rate':>12} {'r0/fast tokens':>14} "
            f"{'hit':>6} {'p50':>7} {'p95':>7}"]
    for name in policies:
        s = simulate(w, POLICIES[name], settings)
        rates = s.prefill_rates
        fast_rate = statistics.mean(r for r in rates[1:] if r) if any(rates[1:]) else 0.0
        computed = s.computed_per_replica
        fast_tokens = statistics.mean(computed[1:]) if computed[1:] else 0.0
        slow_rate = rates[0] or 0.0
        rows.append(f"{name:20} {slow_rate:8.0f} {fast_rate:9.0f} {slow_rate / fast_rate if fast_rate else 0:12.2f} "
                    f"{computed[0] / fast_tokens if fast_tokens else 0:14.2f} {s.hit_ratio:6.3f} "
                    f"{s.ttft(0.5) * 1000:5.0f}ms {s.ttft(0.95) * 1000:5.0f}ms")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.routing_speeds", description=__doc__.split("\n\n")[0])
    p.add_argument("--slow", type=float, default=0.5, help="r0's prefill speed over the others'")
    p.add_argument("--families", nargs="+", default=list(FAMILY_NAMES), choices=[f.name for f in FAMILIES])
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2])
    p.add_argument("--policies", nargs="+", default=list(POLICY_NAMES), choices=list(POLICIES))
    p.add_argument("--requests", type=int, default=1200)
    args = p.parse_args(argv)
    started = time.perf_counter()
    for family in args.families:
        for seed in args.seeds:
            print("\n".join(run(family, seed, args.slow, tuple(args.policies), args.requests)) + "\n", flush=True)
    print(f"({time.perf_counter() - started:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
