"""The savings estimate checked over real processes: kvgate's ``/admin/savings`` against a real round-robin replay.

    .venv/bin/python -m bench.savings_e2e                          # the routing benchmark's workloads, --quick sizes
    .venv/bin/python -m bench.savings_e2e --workloads mtbench --concurrency 4

``bench.savings`` checks the estimator inside the virtual-time simulator; this
checks the gateway as deployed. Per workload of the routing benchmark (the
list and sizes ``bench.savings`` takes, ``--quick`` sizes unless ``--full``),
on the fleet ``bench.routing_e2e`` starts (``vllm_sim`` processes with its
timing and seats, each pool sized from the workload by ``bench.pools``):

1. cold replicas, and a kvgate process with the default routing policy: the
   workload is replayed through it; kvgate's ``GET /admin/savings`` gives its
   estimate of what round robin would have computed and what the fleet did
   compute (prompt - cached, as the replicas reported), and the replicas' own
   counters give the latter again (``vllm:prompt_tokens_total`` -
   ``vllm:prefix_cache_hits_total``);
2. cold replicas again (``/sim/reset``: pools and counters cleared), a kvgate
   process with ``routing.policy: round_robin``, the same requests in the same
   order with the same concurrency: the prefill the replicas computed is the
   real round-robin counterfactual.

What differs between the two runs, and between the shadow and the real round
robin: requests are sent as fast as ``--concurrency`` allows (closed-loop
workloads by their own clients), in the workload's order, so which request a
free slot takes next is the same, but completion order is not (it follows
where each request went), and so neither is the order of the requests sent
when slots free. Both round robins deal requests to replicas in the order
kvgate routes them; the shadow updates its pools in the order answers complete,
the replicas theirs as they schedule. The timelines differ too: under round
robin each request meets other running requests in the pools than under the
default policy (``docs/savings.md``, what the estimator cannot see).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.chaos_fleet import (
    HOST, Sim, _kill, free_port, kvgate_config, metric_sum, parse_metrics, start_kvgate, start_sims)
from bench.routing_e2e import SIM_FLAGS, _send_factory, reset, resize, workload_pool
from bench.routing_replay import replay
from bench.savings import parser, workload
from bench.workloads import Workload
from routing import RoutingSettings

ADMIN_TOKEN = "savings-e2e"


@dataclass
class Run:
    """One replay through one kvgate: what the replicas computed, and kvgate's ``/admin/savings``."""

    computed: int  # prompt - prefix-cache hits, summed over the replicas' own counters
    errors: int
    savings: dict[str, Any]


def fleet_computed(sims: list[Sim]) -> int:
    """Prefill tokens the replicas computed since their last reset, by their own counters."""
    total = 0.0
    for s in sims:
        m = parse_metrics(httpx.get(s.url + "/metrics", timeout=5).text)
        total += metric_sum(m, "vllm:prompt_tokens_total") - metric_sum(m, "vllm:prefix_cache_hits_total")
    return round(total)


def _admin(url: str, path: str) -> Any:
    r = httpx.get(url + path, headers={"authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=10)
    r.raise_for_status()
    return r.json()


def _wait_pools(admin: str, timeout: float = 30.0) -> None:
    """Until kvgate has read every replica's pool size: before it, the shadow cannot size its LRUs,
    and once it can it restarts them at the rate the pools allow (what it held would be lost)."""
    deadline = time.monotonic() + timeout
    while not all(r["kv_tokens"] for r in _admin(admin, "/admin/replicas")["replicas"]):
        if time.monotonic() > deadline:
            raise RuntimeError(f"kvgate did not read the replicas' pools in {timeout} s")
        time.sleep(0.1)


def run(policy: str, w: Workload, sims: list[Sim], workdir: Path, args: argparse.Namespace) -> Run:
    """Cold replicas, a fresh kvgate routing by ``policy``, the workload replayed through it."""
    reset(sims)
    admin_port = free_port()
    config = kvgate_config(free_port(), sims, routing={"policy": policy},
                           admin={"host": HOST, "port": admin_port, "token": ADMIN_TOKEN},
                           pool={"health_interval_s": 1.0, "metrics_interval_s": 1.0})
    (workdir / policy).mkdir(exist_ok=True)
    gw = start_kvgate(workdir / policy, config)
    admin = f"http://{HOST}:{admin_port}"
    try:
        _wait_pools(admin)

        async def drive() -> int:
            client, send = await _send_factory([gw], "sim-model")
            try:
                results = await replay(w, send, speed=args.speed, max_concurrency=args.concurrency)
            finally:
                await client.aclose()
            return sum(1 for r in results if r.error)

        errors = asyncio.run(drive())
        return Run(fleet_computed(sims), errors, _admin(admin, "/admin/savings"))
    finally:
        _kill(gw.proc)


@dataclass
class Check:
    workload: str
    requests: int
    estimate: float  # kvgate's estimate of round robin's computed tokens
    real_rr: int  # what the replicas computed under round robin
    actual: int  # what the fleet computed under the default policy, by kvgate's ledger
    actual_replicas: int  # the same by the replicas' counters
    errors: int
    shadow: dict[str, Any]
    pool_blocks: int

    @property
    def error(self) -> float:
        return (self.estimate - self.real_rr) / self.real_rr if self.real_rr else float("nan")


def check(w: Workload, blocks: int, sims: list[Sim], workdir: Path, args: argparse.Namespace) -> Check:
    """Both runs of ``w`` on ``sims`` (restarted with pools of ``blocks`` first, when theirs differ)."""
    resize(sims, blocks)
    ours = run(RoutingSettings().policy, w, sims, workdir, args)  # the default policy
    rr = run("round_robin", w, sims, workdir, args)
    totals = ours.savings["totals"]["prefill"]
    return Check(w.name, len(w.requests), totals["rr_computed_tokens"], rr.computed, totals["computed_tokens"],
                 ours.computed, ours.errors + rr.errors, ours.savings["shadow"], blocks)


HEADER = ("| workload | requests | R | RR computed, estimated | RR computed, real | error | computed (kvgate) | "
          "computed (replicas) | saved, est. | saved, real | shadows per replica | correction | CPU per request | "
          "errors |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def row(c: Check) -> str:
    s = c.shadow
    n = max(1, len(s["entries"]))
    entries = (sum(s["entries"].values()) + sum(s["mirror_entries"].values())) / n
    return (f"| {c.workload} | {c.requests} | 1/{1 / s['sample_rate']:g} | {c.estimate:,.0f} | {c.real_rr:,} | "
            f"{c.error:+.1%} | {c.actual:,} | {c.actual_replicas:,} | {1 - c.actual / c.estimate:.1%} | "
            f"{1 - c.actual_replicas / c.real_rr:.1%} | {s['memory_bytes'] / n / 1024:,.0f} KiB ({entries:,.0f} "
            f"entries; pool {c.pool_blocks:,} blocks) | {s['correction']:.4f} | {s['cpu_us_per_request']:.0f} us | "
            f"{c.errors} |")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = parser("bench.savings_e2e", __doc__)
    p.add_argument("--full", action="store_true", help="the routing benchmark's full sizes (hours here)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at most (open-loop workloads)")
    p.add_argument("--speed", type=float, default=1e6,
                   help="divides arrivals and think times (default: as fast as --concurrency allows)")
    # bench.routing_e2e's fleet: 4 replicas, pools at twice the reused working set (its sizing flags).
    p.set_defaults(replicas=4, clients=0, burst=None, kv_tokens=0, kv_blocks=0)
    args = p.parse_args(argv)
    args.quick = not args.full
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    workloads = [workload(name, args) for name in args.workloads]
    pools = [workload_pool(w, args) for w in workloads]
    # twin's prompts (34K tokens) and mooncake's longest (120K) are past the simulator's default context.
    longest = max(r.prompt_tokens for w in workloads for r in w.requests)
    flags = {"kv_blocks": pools[0].blocks, "max_model_len": max(32768, 2 * longest), **SIM_FLAGS}
    sims = start_sims([f"r{i + 1}" for i in range(args.replicas)], flags)
    print(f"{args.replicas} vllm_sim replicas; pools {args.pool_ratio:g} x the reused working set; "
          f"concurrency {args.concurrency}; {'full' if args.full else 'quick'} sizes")
    print(HEADER, flush=True)
    try:
        with tempfile.TemporaryDirectory(prefix="kvgate-savings-e2e-") as workdir:
            for w, pool in zip(workloads, pools):
                print(row(check(w, pool.blocks, sims, Path(workdir), args)), flush=True)
    finally:
        for s in sims:
            s.kill()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
