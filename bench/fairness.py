"""A noisy tenant on a saturated fleet (issue 28): does a quiet tenant keep its time to first token?

Real processes over loopback: simulated replicas with few sequence slots and a decode step long enough
to saturate them, one kvgate in front, two tenants of equal weight sending closed loops of streamed
chat requests. The other tenant first sends exactly its share of the fleet's slots, then ten times
that. The quiet tenant asks for less than its share throughout.

Each scenario runs twice, side by side: with kvgate's fair queue (the default once tenants are
configured) and without it (every request passed straight on to the replicas' first-come queues,
kvgate before issue 28). The figure that matters is the quiet tenant's TTFT p95 while the other floods
over its p95 while the other sends its share: 1.0 means the flood cost it nothing.

    python -m bench.fairness                      # both scenarios, both modes
    python -m bench.fairness --duration 10 --scenarios equal

Scenarios:
  equal  both tenants `standard`, weight 1; replicas schedule first-come (vLLM's default).
  batch  the quiet tenant `interactive`, the other `batch`; replicas run
         `--scheduling-policy priority`, so the class reaches vLLM too.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.chaos_fleet import HOST, MODEL, _kill, free_port, kvgate_config, parse_metrics, start_kvgate, start_sims
from bench.loadgen import Conn, build_request, percentile

QUIET_KEY, NOISY_KEY = "sk-quiet-bench", "sk-noisy-bench"


@dataclass(frozen=True)
class Scenario:
    name: str
    quiet_class: str
    noisy_class: str
    scheduling_policy: str


SCENARIOS = {
    "equal": Scenario("equal", "standard", "standard", "fcfs"),
    "batch": Scenario("batch", "interactive", "batch", "priority"),
}


@dataclass
class Phase:
    ttft: dict[str, list[float]]
    done: dict[str, int]
    statuses: dict[str, dict[int, int]]
    seconds: float
    seats: str = ""  # the seats kvgate had learned when the phase ended


def tenants(s: Scenario) -> list[dict[str, Any]]:
    base = {"semantic_cache": False, "prompt_hygiene": False, "weight": 1}
    return [{**base, "name": "quiet", "api_keys": [QUIET_KEY], "priority": s.quiet_class},
            {**base, "name": "noisy", "api_keys": [NOISY_KEY], "priority": s.noisy_class}]


ADMIN_TOKEN = "bench-admin"


def gateway_sections(s: Scenario, fair: bool, admin_port: int, last_step: bool = True) -> dict[str, Any]:
    """The only difference between the modes is the queue switch (the admin API is read for the
    seats kvgate learned); ``last_step``: ``pool.hand_on_at_last_step`` (on by default)."""
    return {"tenants": tenants(s), "pool": {"fair_queue": fair, "hand_on_at_last_step": last_step},
            "admin": {"enabled": True, "host": HOST, "port": admin_port, "token": ADMIN_TOKEN}}


def learned_seats(admin_port: int) -> str:
    """Each replica's seats as kvgate learned them (capacity; its admission limit for this instance)."""
    try:
        status = httpx.get(f"http://{HOST}:{admin_port}/admin/status",
                           headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return "?"
    return " ".join(f"{r['name']}={r.get('capacity') if r.get('capacity') is not None else '-'}"
                    for r in status.get("replicas", []))


def replica_settings(s: Scenario) -> dict[str, Any]:
    return {"scheduling_policy": s.scheduling_policy}


def chat(seq: itertools.count, tenant: str, max_tokens: int) -> bytes:
    # A unique prompt each time: nothing here is about cache hits.
    return json.dumps({"model": MODEL, "stream": True, "max_tokens": max_tokens,
                       "messages": [{"role": "user", "content": f"{tenant} request {next(seq)}: say something"}]}
                      ).encode()


async def closed_loop(port: int, key: str, tenant: str, clients: int, stop_at: float, measure_from: float,
                      phase: Phase, max_tokens: int, seq: itertools.count, think_s: float = 0.0,
                      seed: int = 0) -> None:
    """``clients`` users, each sending its next request when the last ends, after a pause drawn from
    an exponential of mean ``think_s`` (0: none)."""
    headers = {"Authorization": f"Bearer {key}"}

    async def client(rng: random.Random) -> None:
        conn = Conn(HOST, port)
        try:
            while True:
                if think_s:
                    await asyncio.sleep(rng.expovariate(1 / think_s))
                if (t0 := time.perf_counter()) >= stop_at:
                    break
                raw = build_request(HOST, port, "/v1/chat/completions", chat(seq, tenant, max_tokens), headers)
                try:
                    status, ttfb, _ = await conn.post(raw)
                except (OSError, asyncio.IncompleteReadError, ValueError):
                    conn.close()
                    status, ttfb = -1, 0.0
                if t0 < measure_from:
                    continue
                counts = phase.statuses.setdefault(tenant, {})
                counts[status] = counts.get(status, 0) + 1
                if status == 200:
                    phase.ttft.setdefault(tenant, []).append(ttfb)
                    phase.done[tenant] = phase.done.get(tenant, 0) + 1
                elif status == 429:
                    await asyncio.sleep(0.05)  # a client that honours back-pressure, briefly
        finally:
            conn.close()

    await asyncio.gather(*(client(random.Random(seed * 1000 + i)) for i in range(clients)))


async def run_phase(port: int, quiet: int, noisy: int, duration: float, warmup: float, max_tokens: int,
                    think_s: float = 0.0) -> Phase:
    phase = Phase({}, {}, {}, duration)
    start = time.perf_counter()
    measure_from, stop_at = start + warmup, start + warmup + duration
    seq = itertools.count()
    await asyncio.gather(
        closed_loop(port, QUIET_KEY, "quiet", quiet, stop_at, measure_from, phase, max_tokens, seq, think_s, 1),
        closed_loop(port, NOISY_KEY, "noisy", noisy, stop_at, measure_from, phase, max_tokens, seq))
    return phase


def queue_figures(url: str) -> dict[str, float]:
    try:
        text = httpx.get(url + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return {}
    return {k: v for k, v in parse_metrics(text).items() if "queue" in k}


def run_mode(s: Scenario, fair: bool, args: argparse.Namespace) -> dict[str, Phase]:
    workdir = Path(tempfile.mkdtemp(prefix="kvgate-fairness-"))
    flags = {"max_num_seqs": args.slots, "decode_base_s": args.decode_ms / 1000, "decode_s_per_seq": 0.0,
             "scheduling_policy": s.scheduling_policy}
    sims = start_sims([f"r{i + 1}" for i in range(args.replicas)], flags)
    gw = None
    try:
        admin_port = free_port()
        config = kvgate_config(free_port(), sims, **gateway_sections(s, fair, admin_port, args.hand_on_at_last_step))
        for r in config["replicas"]:
            r.update(replica_settings(s))
        gw = start_kvgate(workdir, config)
        share = args.replicas * args.slots // 2  # two tenants of equal weight
        phases = {}
        for name, noisy in (("share", share), ("flood", share * args.flood)):
            phases[name] = asyncio.run(run_phase(gw.port, args.quiet, noisy, args.duration, args.warmup,
                                                 args.max_tokens, args.think_ms / 1000))
            phases[name].seats = learned_seats(admin_port)
        return phases
    finally:
        if gw is not None:
            _kill(gw.proc)
        for sim in sims:
            sim.kill()
        shutil.rmtree(workdir, ignore_errors=True)


def _ms(v: float) -> str:
    return "-" if v != v else (f"{v * 1000:.0f}" if v < 10 else f"{v:.1f}s")


def row(s: Scenario, fair: bool, phases: dict[str, Phase]) -> str:
    share, flood = phases["share"], phases["flood"]
    q_share, q_flood = share.ttft.get("quiet", []), flood.ttft.get("quiet", [])
    p95_share, p95_flood = percentile(q_share, 95), percentile(q_flood, 95)
    ratio = p95_flood / p95_share if q_share and q_flood else float("nan")
    thr = {k: sum(p.done.values()) / p.seconds for k, p in phases.items()}
    refused = sum(n for t in flood.statuses.values() for st, n in t.items() if st != 200)
    return (f"| {s.name} | {'fair queue' if fair else 'first-come'} | {_ms(percentile(q_share, 50))} / "
            f"{_ms(p95_share)} | {_ms(percentile(q_flood, 50))} / {_ms(p95_flood)} | **{ratio:.2f}** | "
            f"{thr['share']:.1f} | {thr['flood']:.1f} | {flood.done.get('quiet', 0) / flood.seconds:.1f} | "
            f"{refused} | {flood.seats} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenarios", nargs="+", choices=sorted(SCENARIOS), default=["equal", "batch"])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--slots", type=int, default=4, help="each replica's --max-num-seqs")
    p.add_argument("--decode-ms", type=float, default=10.0, help="one decode step")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--quiet", type=int, default=2, help="the quiet tenant's clients (below its share)")
    p.add_argument("--think-ms", type=float, default=20.0,
                   help="the quiet tenant's users pause this long on average (exponential) between an "
                        "answer and their next question, so their arrivals fall anywhere in a replica's "
                        "step; the other tenant's clients never pause")
    p.add_argument("--flood", type=int, default=10, help="the flood, in multiples of the other's share")
    p.add_argument("--no-hand-on-at-last-step", dest="hand_on_at_last_step", action="store_false",
                   help="pool.hand_on_at_last_step: false (every slot handed on when its stream ends; on by "
                        "default: a slot handed on at an answer's last decode step)")
    p.add_argument("--duration", type=float, default=15.0, help="seconds measured per phase")
    p.add_argument("--warmup", type=float, default=5.0,
                   help="seconds before each phase is measured: kvgate learns the replicas' seats from the "
                        "first queue they show")
    args = p.parse_args(argv)
    print(f"# {args.replicas} replicas x {args.slots} slots, {args.decode_ms:g} ms a decoded token, "
          f"{args.max_tokens} tokens an answer; quiet {args.quiet} clients pausing {args.think_ms:g} ms on "
          f"average; the other its share "
          f"({args.replicas * args.slots // 2}), then {args.flood}x; {args.duration:g} s a phase", flush=True)
    lines = []
    for name in args.scenarios:
        s = SCENARIOS[name]
        for fair in (False, True):
            lines.append(row(s, fair, run_mode(s, fair, args)))
            print(lines[-1], flush=True)
    print()
    print("| scenario | mode | quiet TTFT p50 / p95 (ms), other at its share | quiet p50 / p95, other flooding "
          "| p95 ratio | req/s at share | req/s flooding | quiet req/s flooding | not 200 while flooding "
          "| seats learned |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
