"""Routing benchmark: every workload through every policy over a simulated vLLM fleet.

    .venv/bin/python -m bench.routing            # full run (a few minutes on 2 cores)
    .venv/bin/python -m bench.routing --quick    # smoke test (seconds)
    .venv/bin/python -m bench.routing --clients 8 --burst 1 2   # closed loop: 8 clients, in bursts
    .venv/bin/python -m bench.routing --seats    # kvgate told each replica's max_num_seqs (max_in_flight)

These are the workloads kvgate is tuned on. ``bench.routing_suite`` runs a
generated suite (``bench/workloads/generated.py``) that nothing is tuned on,
for reporting only.

One process, discrete-event (``bench.routing_sim``): N replicas with the
simulator's own KV pool and timing model, KV pools under pressure, sized from
each workload (``bench.pools.pool_size``: the fleet's pools together hold
``--pool-ratio``, default 2, times the reused working set, floored so a
replica can run its share of the largest requests at once; ``--kv-tokens``
overrides it, ``--large-kv`` gives caches that never evict; each workload's
header gives the pool and the working set), and arrival rates set so the
fleet is under real load: for each workload the rate is chosen so that the
engine work at the *ideal* hit ratio would keep ``--load`` of the fleet busy
(a policy reusing less than ideal is busier than that, possibly overloaded).

The workloads: digital twins, MT-bench, Mooncake, shared prefix, unique
prompts, and ``orgs_layered``, organisation-layered prompts (global > org >
agent > tools > person > retrieved tail, 3 organisations per replica, skewed
traffic, a closed loop of 2 clients per replica; ``bench/workloads/generated.py``
with its own seed and sizes, none of the suite's families).

Printed per workload: fleet prefix-cache hit ratio (tokens), that as a
fraction of the ideal (one infinite cache replaying the same requests) and
of the run-level bounded omniscient reference (``bench.routing_reference``,
``run_bounded_reference``: greedy longest cached prefix, reading the simulated
pools, each replica within ceil(1.3 x mean) of the requests placed over the
run; the in-flight ``bounded_reference`` runs only when named in
``--policies``), TTFT p50/p95, output throughput, max/mean time-averaged
replica load, max/mean per-replica request counts over the run, the max over
routing decisions of in-flight / that cap, the
share of follow-up turns sent to the replica that served the previous turn,
agreement between independent gateway instances, how far the policy's belief
of what the chosen replica held missed the cached tokens it reported
(``belief``, a share of the prompt; ``ttft`` keeps one), and the mean routing
cost per request. Also: key movement when one of 8 replicas leaves. A PNG goes to
``bench/out/routing.png`` and the numbers to ``bench/out/routing.json``.

Workload replay is separate from the simulator: ``bench.routing_replay``
drives the same requests through any async ``send(request) -> usage``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

from routing import RoutingSettings
from routing.consistent_hash import ConsistentHash
from routing.keys import PrefixKeyer
from routing.least_load import LeastLoad
from routing.membership import key_movement
from routing.prefix_affinity import PrefixAffinity
from routing.round_robin import RoundRobin
from routing.ttft_affinity import TTFTAffinity
from routing.base import RouteRequest

from .routing_baselines import KubeAICHWBL, LLMDPrecise, LLMDScorers, SGLangCacheAware, SGLangEventDriven
from .pools import DEFAULT_RATIO, pool_size
from .routing_reference import (
    REFERENCE, RUN_REFERENCE, TTFT_BOUNDED, TTFT_UNBOUNDED, BoundedReference, RunBoundedReference, TTFTReference)
from .routing_report import Row, WorkloadReport, format_table, plot, write_json
from .routing_sim import PolicyFactory, SimSettings, simulate
from .workloads import ClosedLoop, Workload, generated, mooncake, mtbench, shared_prefix, twin, unique

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DATA = ROOT.parent / "shared" / "data"

# ``--set hot_fraction=0.5``: kvgate's own settings under test, for tuning runs.
PA_SETTINGS = RoutingSettings()
POLICIES: dict[str, PolicyFactory] = {
    "round_robin": lambda clock: RoundRobin(),
    "least_load": lambda clock: LeastLoad(),
    "consistent_hash": lambda clock: ConsistentHash(RoutingSettings()),
    "sglang_cache_aware": lambda clock: SGLangCacheAware(),
    "llm-d": lambda clock: LLMDScorers(),
    "kubeai_chwbl": lambda clock: KubeAICHWBL(),
    "prefix_affinity": lambda clock: PrefixAffinity(PA_SETTINGS, clock),
    "ttft": lambda clock: TTFTAffinity(PA_SETTINGS, clock),
    RUN_REFERENCE: lambda clock: RunBoundedReference(),
    REFERENCE: lambda clock: BoundedReference(),
    TTFT_BOUNDED: lambda clock: TTFTReference(clock),
    TTFT_UNBOUNDED: lambda clock: TTFTReference(clock, bounded=False),
}
# References that read the simulated replicas, not routers: off unless asked for
# (run_bounded_reference, the %ref yardstick, always runs).
ORACLES = (REFERENCE, TTFT_BOUNDED, TTFT_UNBOUNDED)
# A fact published to a Redis stream reaches the other instances' blocking reads
# about this much later (a loopback round trip and the publisher's batching).
SHARE_DELAY_S = 0.05
# kvgate's policies with routing.share_index on: their facts (ttft's block facts, prefix_affinity's
# key facts: routing.gossip) reach the other instances SHARE_DELAY_S later.
# (PA_SETTINGS read when an instance is made: ``--set`` replaces it.)
SHARED: dict[str, PolicyFactory] = {
    "prefix_affinity": lambda clock: PrefixAffinity(PA_SETTINGS.model_copy(update={"share_index": True}), clock),
    "ttft": lambda clock: TTFTAffinity(PA_SETTINGS.model_copy(update={"share_index": True}), clock),
}


def shared_label(policy: str, instances: int) -> str:
    """The row of ``policy`` run as ``instances`` gateway instances sharing their facts."""
    return f"{policy} x{instances}, shared index"


# Policies also run as several independent gateway instances (no shared state).
MULTI = ("sglang_cache_aware", "llm-d", "prefix_affinity", "ttft")
# Precise mode (issue 16): policies reading the replicas' KV events, with no other shared state.
PRECISE: dict[str, PolicyFactory] = {
    "prefix_affinity precise": lambda clock: PrefixAffinity(PA_SETTINGS, clock),
    "ttft precise": lambda clock: TTFTAffinity(PA_SETTINGS, clock),
    "llm-d precise": lambda clock: LLMDPrecise(),
    "sglang event-driven": lambda clock: SGLangEventDriven(),
}


def layered_tuning(replicas: int) -> generated.Family:
    """The tuning set's organisation-layered workload: 3 organisations per replica, 2 clients per replica.

    The generated suite's layered families have 1, 2, 4 and 8 organisations
    per replica on 4 replicas, drawn from seeds 1-3; this one has its own
    family name (so its own draw), organisation count and seed.
    """
    return generated.Family("tuning-layered", replicas=replicas, seconds=0, clients=2 * replicas, output=(8, 64),
                            orgs_per_replica=3)


def build_workloads(args: argparse.Namespace) -> list[Workload]:
    q = args.quick
    makers = {
        "twin": lambda: twin.build(n_requests=120 if q else args.twin_requests, rate=1.0, seed=args.twin_seed),
        "mtbench": lambda: mtbench.build(args.data, rate=1.0, limit=60 if q else None),
        "mooncake": lambda: mooncake.build(args.data, minutes=1.0 if q else args.mooncake_minutes),
        "shared_prefix": lambda: shared_prefix.build(groups=16 if q else 64, per_group=8 if q else 48, rate=1.0),
        "unique": lambda: unique.build(n_requests=150 if q else 1500, rate=1.0),
        "orgs_layered": lambda: _named(generated.build(layered_tuning(args.replicas), args.layered_seed,
                                                       160 if q else args.layered_requests), "orgs_layered"),
    }
    return [makers[name]() for name in args.workloads]


def _named(w: Workload, name: str) -> Workload:
    w.name = name
    return w


def ideal_hit_ratio(w: Workload, block: int = 16) -> float:
    """Hit ratio of one infinite cache replaying the requests in order (vLLM's reuse rule)."""
    seen: set[bytes] = set()
    hit = total = 0
    for r in w.requests:
        m = 0
        for h in r.kv_hashes:
            if h not in seen:
                break
            m += 1
        hit += min(m, max(0, (r.prompt_tokens - 1) // block)) * block
        total += r.prompt_tokens
        seen.update(r.kv_hashes)
    return hit / total if total else 0.0


def calibrate(w: Workload, ideal: float, settings: SimSettings, load: float) -> float:
    """Scale arrivals so engine work at the ideal hit ratio keeps ``load`` of the fleet busy.

    Work per request: prefill of its share of uncached tokens, plus its share
    of decode steps at a batch of 32. Absolute arrivals are rescaled (for the
    trace: time compression); closed-loop think times are left alone.
    """
    t = settings.timing
    n = len(w.requests)
    prefill = sum(t.prefill_time(int(r.prompt_tokens * (1 - ideal))) for r in w.requests) / n
    decode = sum(r.output_tokens for r in w.requests) / n * t.decode_step_time(32) / 32
    rate = load * settings.replicas / (prefill + decode)
    starts = sorted(r.arrival for r in w.requests if r.after is None)
    if len(starts) < 2:
        return rate
    per_start = n / len(starts)  # requests per conversation (1 for open-loop workloads)
    current = (len(starts) - 1) / (starts[-1] - starts[0]) * per_start
    factor = current / rate
    for r in w.requests:
        if r.after is None:
            r.arrival = (r.arrival - starts[0]) * factor
    return rate


def movement_note(w: Workload, replicas: int) -> str:
    """Key movement when one of ``replicas`` leaves: over random keys, and over this workload's requests."""
    rng = random.Random(replicas)
    names = [f"r{i}" for i in range(replicas)]
    keys = [rng.getrandbits(64) for _ in range(20_000)]
    worst = max(key_movement(keys, names, [n for n in names if n != gone]) for gone in names)
    keyer = PrefixKeyer(RoutingSettings())
    routed = [keyer.key_for(RouteRequest(r.endpoint, r.model, r.namespace, r.body()), replicas).key
              for r in w.requests]
    worst_requests = max(key_movement(routed, names, [n for n in names if n != gone]) for gone in names)
    back = key_movement(routed, names, list(reversed(names)))
    return (f"membership: removing one of {replicas} replicas moves at most {worst:.1%} of 20,000 keys "
            f"(bound {1 / replicas + 0.05:.1%}) and {worst_requests:.1%} of this workload's requests "
            f"({len(set(routed))} distinct keys); adding it back restores all ({back:.0%} differ)")


def hash_cost_ms() -> float:
    """The issue's bound on hashing: a 100K-character prompt, well under 1 ms."""
    from routing.hashing import chain_hashes, prefix_seed, render

    text = ("lorem ipsum dolor sit amet " * 4000)[:100_000]
    body = {"messages": [{"role": "system", "content": text}, {"role": "user", "content": "hi"}]}
    seed, best = prefix_seed("m", "ns"), float("inf")
    for _ in range(20):
        started = time.perf_counter()
        chain_hashes(render("chat", body).data, seed, 64, 4096)
        best = min(best, time.perf_counter() - started)
    return best * 1e3


def run_workload(w: Workload, args: argparse.Namespace) -> WorkloadReport:
    loop = ClosedLoop.of(args.clients, args.burst)
    clients = (loop or w.closed_loop).clients if (loop or w.closed_loop) else 0
    pool = pool_size(w, args.replicas, args.pool_ratio, clients=clients, kv_tokens=args.kv_tokens)
    base = SimSettings(replicas=args.replicas, kv_tokens=pool.kv_tokens, seed=args.seed, closed_loop=loop,
                       seats_known=args.seats)
    if args.large_kv:
        base = replace(base, kv_tokens=1 << 40)
    ideal = ideal_hit_ratio(w)
    rate = calibrate(w, ideal, base, args.load)
    rep = WorkloadReport(w.name, w.description, ideal, rate)
    rep.pool = "KV pools never evict (--large-kv)" if args.large_kv else pool.describe()
    rep.pool_tokens, rep.working_set = base.kv_tokens, pool.working_set
    if base.closed_loop is not None:
        rep.description += f"; {base.closed_loop.label()}"
    reference = simulate(w, POLICIES[RUN_REFERENCE], base)
    rep.reference = reference.hit_ratio
    for name in dict.fromkeys([*args.policies, RUN_REFERENCE]):
        stats = reference if name == RUN_REFERENCE else simulate(w, POLICIES[name], base)
        rep.rows.append(Row(name, stats, ideal, rep.reference))
        _progress(w.name, name, stats)
    for name in (p for p in MULTI if p in args.policies and args.instances > 1):
        stats = simulate(w, POLICIES[name], replace(base, instances=args.instances,
                                                     agreement=name == "prefix_affinity"))
        rep.rows.append(Row(f"{name} x{args.instances}", stats, ideal, rep.reference))
        _progress(w.name, f"{name} x{args.instances}", stats)
    for name in (p for p in SHARED if p in args.policies and args.instances > 1):
        # The same instances sharing what they learn through Redis (routing.share_index).
        stats = simulate(w, SHARED[name], replace(base, instances=args.instances, agreement=name == "prefix_affinity",
                                                  share_s=SHARE_DELAY_S))
        rep.rows.append(Row(shared_label(name, args.instances), stats, ideal, rep.reference))
        _progress(w.name, f"{name} x{args.instances} shared index", stats)
    for label in args.precise:
        for n in args.precise_instances if label in ("prefix_affinity precise", "ttft precise") \
                else [max(args.precise_instances)]:
            # Only kvgate's policy is compared with the single-instance figure; the peers run at the largest count.
            stats = simulate(w, PRECISE[label], replace(base, instances=n, kv_events=True, agreement=n > 1))
            rep.rows.append(Row(f"{label} x{n}", stats, ideal, rep.reference))
            _progress(w.name, f"{label} x{n}", stats)
    if "prefix_affinity" in args.policies and not args.large_kv:
        stats = simulate(w, POLICIES["prefix_affinity"], replace(base, kv_tokens=1 << 40))
        rep.rows.append(Row("prefix_affinity, large KV", stats, ideal, rep.reference))
        _progress(w.name, "prefix_affinity large KV", stats)
    rep.notes.append(movement_note(w, 8))
    return rep


def _progress(workload: str, label: str, stats) -> None:
    print(f"  [{workload}] {label}: hit {stats.hit_ratio:.3f}, p95 {stats.ttft(0.95):.2f}s "
          f"({stats.wall_s:.1f}s)", file=sys.stderr, flush=True)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench.routing", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="shared data folder (default ../shared/data)")
    p.add_argument("--quick", action="store_true", help="small workloads: a smoke test in seconds")
    p.add_argument("--workloads", nargs="+",
                   default=["twin", "mtbench", "mooncake", "shared_prefix", "unique", "orgs_layered"])
    p.add_argument("--policies", nargs="+", default=[p for p in POLICIES if p not in ORACLES], choices=list(POLICIES))
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--instances", type=int, default=4, help="gateway instances for the multi-instance rows")
    p.add_argument("--precise", nargs="*", default=list(PRECISE), choices=list(PRECISE),
                   help="precise-mode policies (KV events) to run; none: skip")
    p.add_argument("--precise-instances", type=int, nargs="+", default=[1, 4, 8],
                   help="instance counts for prefix_affinity's precise rows (the peers run at the largest)")
    p.add_argument("--load", type=float, default=0.7, help="fleet utilisation at the ideal hit ratio")
    p.add_argument("--clients", type=int, default=0,
                   help="closed loop: this many clients, each sending its next request when the last completes")
    p.add_argument("--burst", type=float, nargs=2, metavar=("ON_S", "OFF_S"), default=None,
                   help="with --clients: send only during ON_S of every ON_S + OFF_S seconds")
    p.add_argument("--pool-ratio", type=float, default=DEFAULT_RATIO,
                   help="the fleet's KV pools hold this many times the reused working set (meant for 1.5-3)")
    p.add_argument("--kv-tokens", type=int, default=0,
                   help="KV pool per replica in tokens (overrides --pool-ratio)")
    p.add_argument("--large-kv", action="store_true", help="KV pools large enough never to evict")
    p.add_argument("--seats", action="store_true",
                   help="kvgate is told each replica's max_num_seqs (its max_in_flight): ttft prices a seat's wait")
    p.add_argument("--mooncake-minutes", type=float, default=10.0, help="trace prefix to replay")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--twin-requests", type=int, default=3600,
                   help="twin requests (360 twins): fewer leave the cold start to dominate (1200: ~3 per twin)")
    p.add_argument("--layered-requests", type=int, default=1600, help="orgs_layered requests")
    p.add_argument("--layered-seed", type=int, default=11, help="orgs_layered's draw (the suite uses 1-3)")
    p.add_argument("--twin-seed", type=int, default=1,
                   help="the twin layout's seed (which twins are hot, arrivals); its p95 moves by seconds")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a routing setting of prefix_affinity (repeatable)")
    return p.parse_args(argv)


def _value(text: str) -> object:
    """A ``--set`` value: JSON (0.25, null, true) where it parses, else the text itself."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    global PA_SETTINGS
    PA_SETTINGS = RoutingSettings.model_validate({k: _value(v) for k, v in (kv.split("=", 1) for kv in args.set)})
    started = time.perf_counter()
    reports = []
    for name in args.workloads:
        print(f"building {name} ...", file=sys.stderr, flush=True)
        (w,) = build_workloads(argparse.Namespace(**{**vars(args), "workloads": [name]}))
        reports.append(run_workload(w, args))
        del w
    if args.seats:
        print("kvgate is told each replica's max_num_seqs as its max_in_flight (--seats)")
    print(format_table(reports))
    print(f"\nhashing a 100K-character prompt (render + chained xxh3 blocks): {hash_cost_ms():.2f} ms (best of 20)")
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(reports, args.out / "routing.json")
    if not args.no_plot:
        plot(reports, args.out / "routing.png")
    print(f"\n({time.perf_counter() - started:.0f}s; plot {args.out / 'routing.png'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
