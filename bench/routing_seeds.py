"""The twin workload over many seeds: one seed's TTFT p95 moves by a second or more.

    .venv/bin/python -m bench.routing_seeds                      # 8 seeds, kvgate vs SGLang (about 4 min on 2 cores)
    .venv/bin/python -m bench.routing_seeds --seeds 4 --policies prefix_affinity consistent_hash

Which twins a seed makes hot, and when they arrive, decides much of the tail
of ``bench.routing``'s twin row. This replays the same layout under seeds
1..N through each policy (one gateway instance, the same simulated fleet and
load as ``bench.routing``) and prints hit ratio, TTFT p95 and max/mean load
per seed, then the means: the comparison one seed cannot settle.
"""

from __future__ import annotations

import argparse
import os
import statistics
from concurrent.futures import ProcessPoolExecutor

from .routing import POLICIES, calibrate, ideal_hit_ratio
from .routing_sim import SimSettings, simulate
from .workloads import twin


def _run(job: tuple[str, int, int, float]) -> tuple[float, float, float]:
    policy, seed, requests, load = job
    w = twin.build(n_requests=requests, rate=1.0, seed=seed)
    settings = SimSettings()
    calibrate(w, ideal_hit_ratio(w), settings, load)
    stats = simulate(w, POLICIES[policy], settings)
    return stats.hit_ratio, stats.ttft(0.95), stats.max_over_mean_load


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.routing_seeds", description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=8)
    p.add_argument("--policies", nargs="+", default=["prefix_affinity", "sglang_cache_aware"], choices=list(POLICIES))
    p.add_argument("--requests", type=int, default=3600, help="twin requests per seed (as bench.routing)")
    p.add_argument("--load", type=float, default=0.7)
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = p.parse_args(argv)
    seeds = list(range(1, args.seeds + 1))
    jobs = [(policy, seed, args.requests, args.load) for policy in args.policies for seed in seeds]
    with ProcessPoolExecutor(args.jobs) as pool:
        results = dict(zip(jobs, pool.map(_run, jobs)))
    print(f"twins, {args.requests} requests per seed; each cell: hit / TTFT p95 / max-mean")
    print("seed  " + "".join(f"{policy:>26}" for policy in args.policies))
    for seed in seeds:
        cells = (results[(policy, seed, args.requests, args.load)] for policy in args.policies)
        print(f"{seed:>4}  " + "".join(f"{f'{h:.3f} / {p95:5.2f}s / {mm:.2f}':>26}" for h, p95, mm in cells))
    means = []
    for policy in args.policies:
        rows = [results[(policy, seed, args.requests, args.load)] for seed in seeds]
        means.append(f"{statistics.mean(r[0] for r in rows):.4f} / {statistics.mean(r[1] for r in rows):5.2f}s / "
                     f"{max(r[2] for r in rows):.2f}")
    print("mean  " + "".join(f"{m:>26}" for m in means) + "   (max/mean: the worst seed)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
