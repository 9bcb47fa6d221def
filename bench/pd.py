"""P/D disaggregation end to end: one workload through each router over prefill and decode ``vllm_sim`` processes.

Four simulator processes speak vLLM's NIXL P/D protocol (``vllm_sim.pd``): two with
``--role prefill`` and two with ``--role decode``, each decode pulling the prompt KV
it lacks from a prefill at ``--kv-transfer-s-per-token``. Each *row* starts a router
over them (``ROWS``), replays the workload through it closed loop with streaming
requests (``bench.routing_e2e``'s client and workloads), and prints:

* TTFT p50 and p95 and inter-token latency p99, as the client measured them;
* the prefill hit ratio, from the prefill replicas' own ``vllm:prefix_cache_*``
  counters (the replicas that prefilled, for the ``direct`` row);
* the requests each replica's engine took (prefills, then decodes), the prompt tokens
  the decodes pulled, and those they prefilled themselves (a row that keeps some
  requests local, or a pull that failed and was recomputed);
* errors, and wrong answers: each answer compared with what a plain ``--role both``
  simulator answers to the same body (the simulator's replies are deterministic; a
  decode that read expired KV answers otherwise, as vLLM would).

Rows:

* ``vllm-router``: vLLM's router, ``--vllm-pd-disaggregation --prefill P1 --prefill P2
  --decode D1 --decode D2 --policy round_robin`` (``bench.vllm_router``;
  ``--vllm-router-policy`` picks another policy);
* ``direct``: no P/D, the same requests round robin to two ``--role both`` replicas.

A row is one function from the fleet to a ``Route`` (the URLs clients send to, the
replicas whose counters the row reads, and how to stop what it started); adding
kvgate's rows is one such function registered with ``add_row`` (a kvgate config
whose replicas carry their roles: ``fleet.prefill`` and ``fleet.decode`` are the
simulators, ``bench.chaos_fleet.start_kvgate`` runs kvgate).

Pools under pressure as in ``bench.routing_e2e``: every replica's pool is
``bench.pools.pool_size`` for the workload over two replicas (``--pool-ratio``),
and ``/sim/reset`` clears every pool and counter before each row.

    python -m bench.pd                                   # orgs_layered, 160 requests, both rows
    python -m bench.pd --workload heavy_orgs --requests 300 --rows vllm-router
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx

from bench.chaos_fleet import Sim, _kill, free_port
from bench.pools import DEFAULT_RATIO, pool_size
from bench.routing_e2e import (
    BLOCK_SIZE, MAX_TOKENS, build, fleet_ratio, request_body, request_counts, reset, stream_request)
from bench.routing_replay import Result, Usage, replay, summarise
from bench.vllm_router import VLLM_ROUTER_POLICIES, start_vllm_router_pd, vllm_router_binary
from bench.workloads import ClosedLoop, Request, Workload

__all__ = ["Fleet", "Route", "ROWS", "add_row", "main", "run"]

ROOT = Path(__file__).resolve().parent.parent
MODEL = "sim-model"
WORKLOADS = ["orgs_layered", "heavy_orgs", "heavy_orgs_burst", "shared_prefix", "mtbench", "unique"]
# The routing benchmarks' replica speeds (bench.routing_e2e), and a transfer ten times
# cheaper per token than prefill (NIXL moves KV at tens of GB/s).
SIM_FLAGS = {"prefill_s_per_token": 0.00005, "decode_base_s": 0.005, "max_num_seqs": 16}
TRANSFER_S_PER_TOKEN = 0.000005


@dataclass
class Fleet:
    """The simulators every row shares: P/D roles, plain ones for ``direct``, and the answer key."""

    prefill: list[Sim]
    decode: list[Sim]
    both: list[Sim]
    reference: Sim

    @property
    def serving(self) -> list[Sim]:
        return [*self.prefill, *self.decode, *self.both]


@dataclass
class Route:
    """What a row started: where clients send, which replicas it used, how to stop it."""

    urls: list[str]
    # Replicas whose prefix-cache counters give the row's prefill hit ratio, then the decodes.
    prefill: list[Sim]
    decode: list[Sim] = field(default_factory=list)
    stop: Callable[[], None] = lambda: None


RowStarter = Callable[[Fleet, Path, argparse.Namespace], Route]


def _vllm_router(fleet: Fleet, workdir: Path, args: argparse.Namespace) -> Route:
    router = start_vllm_router_pd([s.url for s in fleet.prefill], [s.url for s in fleet.decode], workdir,
                                  policy=args.vllm_router_policy)
    return Route([router.url], fleet.prefill, fleet.decode, lambda: _kill(router.proc))


def _direct(fleet: Fleet, workdir: Path, args: argparse.Namespace) -> Route:
    return Route([s.url for s in fleet.both], fleet.both)


ROWS: dict[str, RowStarter] = {"vllm-router": _vllm_router, "direct": _direct}


def add_row(name: str, start: RowStarter) -> None:
    """Register a row: ``start(fleet, workdir, args)`` returns a started ``Route`` (kvgate's rows go here)."""
    ROWS[name] = start


def start_fleet(blocks: int, transfer_s_per_token: float, time_scale: float, *, plain: bool = True) -> Fleet:
    """2 prefill and 2 decode replicas at ``blocks`` KV blocks each, 2 plain ones (``plain``: for the
    ``direct`` row), and the reference (no sleeping, a pool that never evicts)."""
    flags = {**SIM_FLAGS, "kv_blocks": blocks, "time_scale": time_scale}
    pd_flags = {**flags, "kv_transfer_s_per_token": transfer_s_per_token}
    pd_sims = [Sim("p1", free_port(), {**pd_flags, "role": "prefill"}),
               Sim("p2", free_port(), {**pd_flags, "role": "prefill"}),
               Sim("d1", free_port(), {**pd_flags, "role": "decode"}),
               Sim("d2", free_port(), {**pd_flags, "role": "decode"})]
    both = [Sim("b1", free_port(), dict(flags)), Sim("b2", free_port(), dict(flags))] if plain else []
    reference = Sim("ref", free_port(), {"time_scale": 0, "kv_blocks": 1 << 16})
    sims = [*pd_sims, *both, reference]
    for s in sims:
        s.startup_timeout = 60.0  # seven interpreters importing at once on a busy machine
    try:
        with ThreadPoolExecutor(len(sims)) as pool:
            list(pool.map(Sim.start, sims))
    except Exception:
        for s in sims:
            s.kill()
        raise
    return Fleet(pd_sims[0:2], pd_sims[2:4], both, reference)


async def _answers(fleet: Fleet, workload: Workload, bodies: dict[int, dict[str, Any]]) -> dict[int, str]:
    """What a plain replica answers to each body: the right answers."""
    by_rid = {r.rid: r for r in workload.requests}
    gate = asyncio.Semaphore(16)
    async with httpx.AsyncClient(timeout=60) as client:
        async def one(rid: int) -> tuple[int, str]:
            async with gate:
                usage = await stream_request(client, fleet.reference.url, by_rid[rid], bodies[rid])
            return rid, usage.text or ""

        return dict(await asyncio.gather(*(one(rid) for rid in bodies)))


def _q(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(p * len(values)))] if values else float("nan")


def _decode_tokens(sims: list[Sim]) -> tuple[int, int]:
    """Prompt tokens the decode replicas pulled, and those they computed."""
    stats = [httpx.get(s.url + "/sim/stats", timeout=5).json() for s in sims]
    return (sum(int(st["kv_transfer"]["transfer_tokens"]) for st in stats),
            sum(int(st["prefill_computed_tokens_sum"]) for st in stats))


async def run_row(name: str, fleet: Fleet, workload: Workload, bodies: dict[int, dict[str, Any]],
                  workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    reset(fleet.serving)
    route = ROWS[name](fleet, workdir, args)
    try:
        client = httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=256))
        turn = itertools.count()

        async def send(req: Request) -> Usage:
            url = route.urls[next(turn) % len(route.urls)]  # round robin over the entry points
            return await stream_request(client, url, req, bodies[req.rid])

        t0 = time.perf_counter()
        results = await replay(workload, send, closed_loop=ClosedLoop.of(args.clients) or workload.closed_loop)
        wall = time.perf_counter() - t0
        await client.aclose()
    finally:
        route.stop()
    return _summary(name, results, route, wall)


def _summary(name: str, results: list[Result], route: Route, wall: float) -> dict[str, Any]:
    ok = [r for r in results if r.usage is not None]
    itls = [gap for r in ok for gap in (r.usage.itl_s if r.usage else [])]
    pulled, computed = _decode_tokens(route.decode)
    return {**summarise(results), "row": name, "wall_s": wall, "itl_p99_s": _q(itls, 0.99),
            "prefill_hit_ratio": fleet_ratio([s.url for s in route.prefill]),
            "prefill_requests": request_counts(route.prefill), "decode_requests": request_counts(route.decode),
            "pulled_tokens": pulled, "decode_computed_tokens": computed,
            "texts": {r.rid: r.usage.text for r in ok if r.usage is not None}}


HEADER = (f"{'row':<24}{'ttft p50':>10}{'ttft p95':>10}{'itl p99':>10}{'prefill hit':>13}{'%ref':>6}"
          f"  {'prefill reqs':<14}{'decode reqs':<14}{'pulled tok':>11}{'D computed':>11}{'errors':>8}{'wrong':>7}"
          f"{'wall':>7}")


def _line(r: dict[str, Any]) -> str:
    def ms(s: float) -> str:
        return f"{s * 1000:>8.0f}ms"

    # A row that prefilled nothing remotely has no prefill hit ratio to show.
    of_ref = f"{r['of_reference']:>6.0%}" if r["reference_hit_ratio"] else f"{'-':>6}"  # nothing to reuse
    hit = f"{r['prefill_hit_ratio']:>13.3f}{of_ref}" if sum(r["prefill_requests"]) else f"{'-':>13}{'-':>6}"
    return (f"{r['row']:<24}{ms(r['ttft_p50_s'])}{ms(r['ttft_p95_s'])}{ms(r['itl_p99_s'])}"
            f"{hit}  {'/'.join(map(str, r['prefill_requests'])):<14}"
            f"{'/'.join(map(str, r['decode_requests'])) or '-':<14}"
            f"{r['pulled_tokens']:>11}{r['decode_computed_tokens']:>11}"
            f"{r['errors']:>8}{r['wrong']:>7}{r['wall_s']:>6.1f}s")


def reference_hit_ratio(workload: Workload, kv_tokens: int, loop: ClosedLoop | None) -> float:
    """The hit-ratio yardstick for the prefill pick: the run-bounded reference (``bench.routing_reference``:
    greedy longest cached prefix, each replica within 1.3x the mean placed so far) over two replicas
    of the prefill pools' size, in the routing benchmarks' virtual-time fleet simulator."""
    from bench.routing_reference import RunBoundedReference
    from bench.routing_sim import SimSettings, simulate

    settings = SimSettings(replicas=2, kv_tokens=kv_tokens, block_size=BLOCK_SIZE, closed_loop=loop)
    return simulate(workload, lambda clock: RunBoundedReference(), settings).hit_ratio


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every row of ``args.rows`` over one fleet; prints the table, returns one dict per row."""
    workload = build(args.workload, argparse.Namespace(seed=args.seed, requests=args.requests, rate=40.0,
                                                       data=str(ROOT.parent / "shared" / "data")))
    loop = ClosedLoop.of(args.clients) or workload.closed_loop
    pool = pool_size(workload, 2, args.pool_ratio, clients=loop.clients if loop else 0,
                     kv_tokens=args.kv_tokens, block_size=BLOCK_SIZE, max_output=MAX_TOKENS)
    bodies = {r.rid: request_body(r, MODEL) for r in workload.requests}
    fleet = start_fleet(pool.blocks, args.kv_transfer_s_per_token, args.time_scale, plain="direct" in args.rows)
    workdir = Path(tempfile.mkdtemp(prefix="kvgate-pd-"))
    out: list[dict[str, Any]] = []
    try:
        right = asyncio.run(_answers(fleet, workload, bodies))
        reference = reference_hit_ratio(workload, pool.kv_tokens, loop)
        print(f"\n{args.workload}: {len(bodies)} requests; {pool.describe()}; run-bounded reference's hit ratio "
              f"over two such pools {reference:.3f} (%ref)\n{HEADER}", flush=True)
        for name in args.rows:
            r = asyncio.run(run_row(name, fleet, workload, bodies, workdir, args))
            if name == "vllm-router" and args.vllm_router_policy != "round_robin":
                r["row"] = f"{name}:{args.vllm_router_policy}"
            texts = r.pop("texts")
            r["wrong"] = sum(1 for rid, text in texts.items() if text != right[rid])
            r["reference_hit_ratio"] = reference
            r["of_reference"] = r["prefill_hit_ratio"] / reference if reference else float("nan")
            print(_line(r), flush=True)
            out.append({"workload": args.workload, **r})
    finally:
        for s in [*fleet.serving, fleet.reference]:
            s.kill()
        shutil.rmtree(workdir, ignore_errors=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "pd.json").write_text(json.dumps(out, indent=1))
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="orgs_layered", choices=WORKLOADS)
    p.add_argument("--requests", type=int, default=160)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--clients", type=int, default=0, help="closed-loop clients (default: the workload's own)")
    p.add_argument("--rows", nargs="+", default=list(ROWS), help=f"of {', '.join(ROWS)} (and rows added by add_row)")
    p.add_argument("--pool-ratio", type=float, default=DEFAULT_RATIO)
    p.add_argument("--kv-tokens", type=int, default=0, help="KV pool per replica in tokens (overrides --pool-ratio)")
    p.add_argument("--kv-transfer-s-per-token", type=float, default=TRANSFER_S_PER_TOKEN)
    p.add_argument("--time-scale", type=float, default=0.5,
                   help="the replicas' --time-scale (0.5: a row of 160 requests in about 15 s)")
    p.add_argument("--vllm-router-policy", default="round_robin", choices=VLLM_ROUTER_POLICIES,
                   help="the vllm-router row's --policy (prefill and decode alike)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out", help="pd.json goes here")
    args = p.parse_args(argv)
    unknown = [r for r in args.rows if r not in ROWS]
    if unknown:
        p.error(f"unknown rows: {', '.join(unknown)}")
    if "vllm-router" in args.rows and vllm_router_binary() is None:
        print("vllm-router not installed (pip install vllm-router, the bench extra): its row is left out", flush=True)
        args.rows = [r for r in args.rows if r != "vllm-router"]
    return args


def main(argv: list[str] | None = None) -> int:
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
