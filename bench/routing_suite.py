"""The generated routing suite: workloads nothing is tuned on, every policy, min / median / max over seeds.

    .venv/bin/python -m bench.routing_suite            # 12 families x 3 seeds
    .venv/bin/python -m bench.routing_suite --quick    # 2 seeds, runs capped at 20 s simulated (20-30 s on 2 cores)
    .venv/bin/python -m bench.routing_suite --families heavy4-closed8 --seeds 1 2 3 4 5 6
    .venv/bin/python -m bench.routing_suite --pool-ratio 3     # roomier pools (default 2: see bench.pools)
    .venv/bin/python -m bench.routing_suite --policies round_robin prefix_affinity ttft --instances 4
    .venv/bin/python -m bench.routing_suite --seats   # kvgate told each replica's max_num_seqs (max_in_flight)

For reporting only. ``bench.routing``'s workloads (twins, MT-bench, Mooncake,
shared prefix, unique) are the ones routing is tuned on; this suite is drawn
from ``bench/workloads/generated.py`` (randomised layer sizes, organisations
per replica including exactly as many heavy organisations as replicas,
Poisson open loop at several loads, closed loop at fixed concurrency and in
bursts, runs from 5 s to 10 min of simulated time, and organisation-layered
prompts with 1, 2, 4 and 8 organisations per replica) and must not be tuned on:
a change to ``routing/`` is judged by it, not fitted to it. If a family here
shows a weakness worth fixing, reproduce it as a tuning workload first.

Pools under pressure: every replica's KV pool is sized from the (family,
seed)'s own requests (``bench.pools.pool_size``): the fleet's pools together
hold ``--pool-ratio`` (default 2) times the reused working set, floored so a
replica can run its share of the largest requests at once; ``--kv-tokens``
overrides it. Each family's header gives the pool and the working set.

Each (family, seed) is built once and replayed through every policy on the
same simulated fleet (``bench.routing_sim``), the omniscient references
(``bench.routing_reference``) included: ``run_bounded_reference``, the
hit-ratio yardstick (greedy longest cached prefix, each replica within
ceil(1.3 x mean) of the requests placed over the run), and the TTFT oracles,
bounded and not, the latency yardsticks. The earlier in-flight
``bounded_reference`` is left out by default (it spreads a burst as a bounded
router does, so it understates the reuse available); ``--policies`` can add
it back. Per family, each cell is min / median / max over seeds of:

* ``hit``: the fleet's prefix-cache hit ratio (tokens), absolute, so a
  policy's can be read beside round robin's and ``sglang_cache_aware``'s;
* ``%ref``: that as a share of ``run_bounded_reference``'s;
* ``TTFT p50`` and ``TTFT p95``;
* ``KV wait`` (shown only where some run had any, as with a small ``--kv-tokens``):
  of the requests at or past the TTFT p90, the mean time queued while their
  replica's next request could not get KV blocks for its prompt and output
  (its running requests held them). Prefill does not explain that part of a wait;
* ``req m/m``: max/mean per-replica request counts over the run;
* ``idle`` (shown only where some run left a replica unused): replicas that
  served no request over the whole run. A router that leaves replicas idle
  while the others queue for their seats loses the tail (max/mean hides it);
  one that leaves them idle with the lowest p95 had no need of them;
* ``if/bound``: the max over routing decisions of the chosen replica's
  in-flight (this request included) over ceil(1.25 x mean in-flight);
  above 1.00 the bounded-loads cap was broken at least once;

and ``p95 best``: on how many seeds the policy's TTFT p95 was the lowest of
the real policies (the references excluded, the multi-instance rows counted),
within ``--tie`` (5%) of it. Numbers also go to ``bench/out/routing_suite.json``.

Scale-out (``--instances N``, default 1: off): each policy of
``bench.routing.MULTI`` named in ``--policies`` (``prefix_affinity``,
``ttft``, ``sglang_cache_aware``, ``llm-d``) also runs as N independent
gateway instances sharing nothing, each request going to one at random, as
``bench.routing`` runs them; its row, ``"{policy} xN"``, sits below the
single instance's, with one more cell, ``x1 share``: per seed, its hit ratio
over the single instance's (what splitting the traffic over instances that
each learn only their own share costs). With ``--kv-events``, kvgate's instances
read the replicas' KV events (precise mode), and share nothing else. With
``--share-index``, kvgate's policies (``bench.routing.SHARED``) also run as N
instances with ``routing.share_index`` on, their facts (``ttft``'s block
facts) reaching the others ``bench.routing.SHARE_DELAY_S`` later: row
``"{policy} xN, shared index"``, below the row sharing nothing.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

from .pools import DEFAULT_RATIO, pool_size
from .routing import MULTI, POLICIES, SHARE_DELAY_S, SHARED, calibrate, ideal_hit_ratio, shared_label
from .routing_reference import REFERENCE, RUN_REFERENCE, TTFT_BOUNDED, TTFT_UNBOUNDED
from .routing_sim import SimSettings, simulate
from .routing_stats import RunStats
from .workloads import Workload
from .workloads.generated import FAMILIES, Family, build

ROOT = Path(__file__).resolve().parent.parent
SUITE_POLICIES = ["round_robin", "least_load", "consistent_hash", "sglang_cache_aware", "llm-d", "kubeai_chwbl",
                  "prefix_affinity", "ttft", RUN_REFERENCE, TTFT_BOUNDED, TTFT_UNBOUNDED]
# Oracles reading the simulated replicas: yardsticks, never counted among the policies.
REFERENCES = (RUN_REFERENCE, REFERENCE, TTFT_BOUNDED, TTFT_UNBOUNDED)
QUICK_SECONDS = 20.0
MIN_REQUESTS, MAX_REQUESTS = 40, 40_000
_PROBE = 150  # requests built to estimate a family's request rate before sizing the run


def requests_for(w: Workload, family: Family, settings: SimSettings, seconds: float) -> int:
    """How many requests of ``w``'s shape make a run of about ``seconds`` of simulated time.

    Open loop: the calibrated arrival rate times the length. Closed loop: each
    client sends one request per service time (prefill of the uncached part at
    the ideal hit ratio, plus its decode at a batch of clients per replica),
    during the bursts' duty cycle only. An estimate: the suite reports the
    real simulated length.
    """
    ideal = ideal_hit_ratio(w)
    loop = family.closed_loop
    if loop is None:
        rate = calibrate(w, ideal, settings, family.load)
        n = seconds * rate
    else:
        t = settings.timing
        batch = max(1, loop.clients // family.replicas)
        service = statistics.mean(t.prefill_time(int(r.prompt_tokens * (1 - ideal)))
                                  + r.output_tokens * t.decode_step_time(batch) for r in w.requests)
        duty = loop.on_s / (loop.on_s + loop.off_s) if loop.on_s is not None else 1.0
        n = seconds * loop.clients / service * duty
    return max(MIN_REQUESTS, min(MAX_REQUESTS, int(n)))


def run_one(job: tuple[str, int, float, tuple[str, ...]], kv_tokens: int = 0,
            kv_events: bool = False, pool_ratio: float = DEFAULT_RATIO, instances: int = 1,
            seats: bool = False, share_index: bool = False) -> dict[str, Any]:
    """One (family, seed): build it once, replay it through every policy.

    Each replica's KV pool: ``pool_ratio`` x the run's reused working set /
    replicas, floored (``bench.pools.pool_size``), or ``kv_tokens`` if given;
    ``kv_events``: the replicas publish KV events, so kvgate's policy runs in
    precise mode. ``instances`` > 1: each policy of ``bench.routing.MULTI``
    also runs as that many independent gateway instances (row ``"{policy} xN"``,
    with ``of_single``, its hit ratio over the single instance's); with ``share_index``,
    each of ``bench.routing.SHARED`` also with its facts shared (``shared_label``)."""
    name, seed, seconds, policies = job
    family = next(f for f in FAMILIES if f.name == name)
    settings = SimSettings(replicas=family.replicas, seed=seed, kv_events=kv_events, seats_known=seats)
    started, cpu = time.perf_counter(), time.process_time()
    n = requests_for(build(family, seed, _PROBE), family, settings, seconds)
    w = build(family, seed, n)
    pool = pool_size(w, family.replicas, pool_ratio, clients=family.clients, kv_tokens=kv_tokens,
                     block_size=settings.block_size)
    settings.kv_tokens = pool.kv_tokens
    ideal = ideal_hit_ratio(w)
    if family.closed_loop is None:
        calibrate(w, ideal, settings, family.load)
    reference = simulate(w, POLICIES[RUN_REFERENCE], settings)
    rows: dict[str, dict[str, float]] = {}
    for policy in policies:
        s = reference if policy == RUN_REFERENCE else simulate(w, POLICIES[policy], settings)
        rows[policy] = _row(s, reference.hit_ratio, ideal)
        if policy in MULTI and instances > 1:
            # No agreement measurement (as routing.py has): the suite does not report it, and it asks every instance.
            multi = _row(simulate(w, POLICIES[policy], replace(settings, instances=instances)), reference.hit_ratio,
                         ideal, instances)
            # Paired on the seed: the same requests, the same fleet, only the instance count differs.
            multi["of_single"] = multi["hit_ratio"] / s.hit_ratio if s.hit_ratio else float("nan")
            rows[multi_label(policy, instances)] = multi
        if policy in SHARED and instances > 1 and share_index:
            shared = _row(simulate(w, SHARED[policy], replace(settings, instances=instances, share_s=SHARE_DELAY_S)),
                          reference.hit_ratio, ideal, instances)
            shared["of_single"] = shared["hit_ratio"] / s.hit_ratio if s.hit_ratio else float("nan")
            rows[shared_label(policy, instances)] = shared
    print(f"  {name} seed {seed}: {n} requests, {reference.makespan:.0f} s simulated, "
          f"{time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    return {"family": name, "seed": seed, "requests": n, "description": w.description, "ideal": ideal,
            "reference": reference.hit_ratio, "pool_tokens": pool.kv_tokens, "working_set_tokens": pool.working_set,
            "pool_floor_tokens": pool.floor, "pool_ratio": pool.ratio, "pool_overridden": pool.overridden,
            "rows": rows, "cpu_s": time.process_time() - cpu}


def _row(s: RunStats, reference_hit: float, ideal: float, instances: int = 1) -> dict[str, float]:
    """One policy's figures on one (family, seed), as the table and the JSON carry them."""
    return {
        "hit_ratio": s.hit_ratio, "of_reference": s.hit_ratio / reference_hit if reference_hit else 1.0,
        "of_ideal": s.hit_ratio / ideal if ideal else 1.0, "ttft_p50_s": s.ttft(0.5), "ttft_p95_s": s.ttft(0.95),
        "max_over_mean_requests": s.max_over_mean_requests, "max_in_flight_over_bound": s.max_bound_ratio,
        "decisions_over_bound": s.over_bound, "max_over_mean_load": s.max_over_mean_load,
        "sim_s": s.makespan, "max_in_flight": s.max_in_flight, "wall_s": s.wall_s,
        "kv_wait_tail_s": s.kv_wait_tail(), "idle_replicas": s.idle_replicas, "instances": instances,
    }


def multi_label(policy: str, instances: int) -> str:
    """The row of ``policy`` run as ``instances`` gateway instances sharing nothing (bench.routing's name)."""
    return f"{policy} x{instances}"


def table_rows(policies: Sequence[str], instances: int, share_index: bool = False) -> list[str]:
    """The table's rows in order: each multi-instance row right below its single instance's, to be read beside it
    (the one sharing facts below the one sharing nothing)."""
    rows: list[str] = []
    for p in policies:
        rows += [p, multi_label(p, instances)] if p in MULTI and instances > 1 else [p]
        if p in SHARED and instances > 1 and share_index:
            rows.append(shared_label(p, instances))
    return rows


def spread(xs: Sequence[float]) -> tuple[float, float, float]:
    """min, median, max (NaNs left out; all NaN: NaN)."""
    ok = [x for x in xs if x == x]
    if not ok:
        return (float("nan"),) * 3  # type: ignore[return-value]
    return min(ok), statistics.median(ok), max(ok)


def best_p95(runs: list[dict[str, Any]], policy: str, tie: float) -> int:
    """Seeds on which ``policy``'s TTFT p95 is within ``tie`` of the lowest real policy's."""
    wins = 0
    for run in runs:
        real = [r["ttft_p95_s"] for p, r in run["rows"].items() if p not in REFERENCES]
        wins += run["rows"][policy]["ttft_p95_s"] <= min(real) * (1 + tie)
    return wins


def _cell(xs: Sequence[float], fmt) -> str:
    lo, mid, hi = spread(xs)
    return "-" if mid != mid else f"{fmt(lo)} / {fmt(mid)} / {fmt(hi)}"


def _ms(x: float) -> str:
    return f"{x * 1000:.0f}ms" if x < 1 else f"{x:.2f}s"


def format_family(family: Family, runs: list[dict[str, Any]], policies: Sequence[str], tie: float) -> str:
    lines = [f"\n## {family.name}: {family.describe()}"]
    sim = spread([r["rows"][policies[0]]["sim_s"] for r in runs])
    seeds = ", ".join(str(r["seed"]) for r in runs)
    requests = _cell([r["requests"] for r in runs], lambda v: f"{v:.0f}")
    lines.append(f"seeds {seeds}; requests {requests}; simulated {sim[0]:.0f}-{sim[2]:.0f} s; "
                 f"run-bounded reference hit {_cell([r['reference'] for r in runs], _f3)}; "
                 f"ideal {_cell([r['ideal'] for r in runs], _f3)}  (cells: min / median / max over seeds)")
    how = ("--kv-tokens" if runs[0]["pool_overridden"]
           else f"{runs[0]['pool_ratio']:g} x working set / {family.replicas} replicas, floored")
    lines.append(f"KV pool per replica {_cell([r['pool_tokens'] for r in runs], _tokens)} tokens ({how}); "
                 f"reused working set {_cell([r['working_set_tokens'] for r in runs], _tokens)} tokens; "
                 f"floor {_cell([r['pool_floor_tokens'] for r in runs], _tokens)}")
    # Waiting for KV blocks happens only where pools are small for the prompts (--kv-tokens):
    # the column is shown when some run of the family did.
    kv_wait = any(r["rows"][p].get("kv_wait_tail_s", 0.0) > 0 for r in runs for p in policies)
    # Replicas left without a request: shown when some run left one.
    idle = any(r["rows"][p].get("idle_replicas", 0) for r in runs for p in policies)
    # The scale-out figure belongs to the multi-instance rows only (--instances): no column without them.
    scale_out = any("of_single" in r["rows"][p] for r in runs for p in policies)
    header = ["policy", "hit", "%ref", *(["x1 share"] if scale_out else []), "TTFT p50", "TTFT p95",
              *(["KV wait"] if kv_wait else []), "req m/m", *(["idle"] if idle else []), "if/bound",
              "p95 best"]
    table = [header]
    for p in policies:
        rows = [r["rows"][p] for r in runs]
        table.append([
            p, _cell([x["hit_ratio"] for x in rows], _f3), _cell([x["of_reference"] for x in rows], _f2),
            *([_cell([x.get("of_single", float("nan")) for x in rows], _f2)] if scale_out else []),
            _cell([x["ttft_p50_s"] for x in rows], _ms), _cell([x["ttft_p95_s"] for x in rows], _ms),
            *([_cell([x["kv_wait_tail_s"] for x in rows], _ms)] if kv_wait else []),
            _cell([x["max_over_mean_requests"] for x in rows], lambda v: f"{v:.2f}"),
            *([_cell([x.get("idle_replicas", 0) for x in rows], lambda v: f"{v:.0f}")] if idle else []),
            _cell([x["max_in_flight_over_bound"] for x in rows], lambda v: f"{v:.2f}"),
            "-" if p in REFERENCES else f"{best_p95(runs, p, tie)}/{len(runs)}",
        ])
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    for k, r in enumerate(table):
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _f2(x: float) -> str:
    return f"{x:.2f}"


def _f3(x: float) -> str:
    return f"{x:.3f}"


def _tokens(x: float) -> str:
    return f"{x / 1000:.0f}K" if x >= 10_000 else f"{x:,.0f}"


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench.routing_suite", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=f"2 seeds, runs capped at {QUICK_SECONDS:g} s simulated")
    p.add_argument("--families", nargs="+", default=[f.name for f in FAMILIES], choices=[f.name for f in FAMILIES])
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="default 1 2 3 (--quick: 1 2)")
    p.add_argument("--policies", nargs="+", default=SUITE_POLICIES, choices=list(POLICIES))
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="worker processes")
    p.add_argument("--tie", type=float, default=0.05, help="TTFT p95 within this share of the best counts as a tie")
    p.add_argument("--pool-ratio", type=float, default=DEFAULT_RATIO,
                   help="the fleet's KV pools hold this many times the reused working set (meant for 1.5-3)")
    p.add_argument("--kv-tokens", type=int, default=0,
                   help="each replica's KV pool in tokens (overrides --pool-ratio)")
    p.add_argument("--seats", action="store_true",
                   help="kvgate is told each replica's max_num_seqs (its max_in_flight): ttft prices a seat's wait")
    p.add_argument("--kv-events", action="store_true",
                   help="replicas publish KV events: prefix_affinity runs in precise mode")
    p.add_argument("--instances", type=int, default=1,
                   help=f"also run {', '.join(MULTI)} as this many gateway instances sharing nothing "
                        "(rows 'policy xN'; default 1: no such rows)")
    p.add_argument("--share-index", action="store_true",
                   help=f"with --instances, also run {', '.join(SHARED)} as that many instances sharing their "
                        "facts (routing.share_index), delivered as through Redis")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    args = p.parse_args(argv)
    if args.instances < 1:
        p.error("--instances must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    seeds = args.seeds or ([1, 2] if args.quick else [1, 2, 3])
    policies = list(dict.fromkeys([*args.policies, RUN_REFERENCE]))
    families = [f for f in FAMILIES if f.name in args.families]
    jobs = [(f.name, seed, min(f.seconds, QUICK_SECONDS) if args.quick else f.seconds, tuple(policies))
            for f in sorted(families, key=lambda f: -f.seconds) for seed in seeds]
    started = time.perf_counter()
    one = functools.partial(run_one, kv_tokens=args.kv_tokens, kv_events=args.kv_events, pool_ratio=args.pool_ratio,
                            instances=args.instances, seats=args.seats, share_index=args.share_index)
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as pool:
            results = list(pool.map(one, jobs))
    else:
        results = [one(job) for job in jobs]
    print("generated suite (reporting only: routing is not tuned on it); "
          "run_bounded_reference (the %ref yardstick) = greedy longest cached prefix, each replica within "
          "ceil(1.3 x mean) of the requests placed so far; "
          "ttft_oracle = greedy least time to first token read from the replicas, under ceil(1.25 x mean "
          "in-flight) (_unbounded: no cap)")
    if args.kv_tokens:
        print(f"every replica's KV pool: {args.kv_tokens:,} tokens (--kv-tokens)")
    else:
        print(f"every replica's KV pool: {args.pool_ratio:g} x the reused working set / replicas, floored "
              "(bench.pools; per family below)")
    if args.kv_events:
        print("replicas publish KV events: prefix_affinity runs in precise mode (--kv-events)")
    if args.seats:
        print("kvgate is told each replica's max_num_seqs as its max_in_flight (--seats)")
    rows = table_rows(policies, args.instances, args.share_index)
    if len(rows) > len(policies):
        print(f"policy x{args.instances} = {args.instances} gateway instances sharing nothing, each request to one "
              "at random; x1 share = its hit over the single instance's, per seed (--instances)")
        if args.share_index:
            print(f"policy x{args.instances}, shared index = the same with routing.share_index: each fact reaches "
                  f"the other instances {SHARE_DELAY_S * 1e3:.0f} ms later (--share-index)")
    for f in families:
        print(format_family(f, [r for r in results if r["family"] == f.name], rows, args.tie))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "routing_suite.json").write_text(json.dumps(results, indent=1))
    # CPU time too: on a shared machine the wall clock says more about the neighbours than about the suite.
    cpu = sum(r["cpu_s"] for r in results)
    print(f"\n({time.perf_counter() - started:.0f} s wall, {cpu:.0f} s CPU in {args.jobs} processes; "
          f"{args.out / 'routing_suite.json'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
