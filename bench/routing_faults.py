"""Precise routing under faults of its event streams: the dip and the recovery, window by window.

Real processes on loopback: ``vllm_sim`` replicas that tokenize with the
MiniLM tokenizer directory and publish KV events in vLLM's wire format
(``bench.precise_fleet``), one kvgate in precise mode in front of them
(``prefix_affinity``, the default when these figures were taken; the tokenizer for the model, every replica's
``kv_events``/``kv_events_replay``), and a workload of multi-turn chat
conversations over a few shared system prompts, each turn sent a short think
time after the last one's answer (an agent loop), so that where each turn
goes depends on what kvgate knows the replicas hold.

Each scenario replays the same request stream through a fresh kvgate and
replicas reset to cold, and injects its fault ``--fault-at`` seconds in:

* ``none``: no fault, the baseline for every window;
* ``restart``: replica r2 stopped (SIGTERM, as a rolling restart does) and
  started again on the same HTTP, PUB and replay ports: empty cache, event
  sequence from 0;
* ``crash``: the same with SIGKILL (its streams in flight break: those client
  errors are the replica's, counted apart);
* ``cut``: r2's PUB socket loses every batch for ``--cut-s`` (5 s; the
  simulator's ``kv_events_drop`` fault), then publishes again: kvgate sees the
  sequence jump and fills the gap through the replay socket;
* ``late``: every replica sends each batch ``--late-s`` (0.5 s) after its
  step ended (the ``kv_events_delay_s`` fault) for ``--late-for`` seconds.

Every ``--window`` seconds (2) it reads the replicas' own
``vllm:prefix_cache_hits_total`` / ``_queries_total`` (a restarted replica's
counters start again from 0: counted from there) and ``GET /admin/routing``.
Per window it prints the requests started and the client errors; the fleet
hit ratio from those counters and from ``usage.prompt_tokens_details.cached_tokens``;
r2's requests and its own hit ratio; "moved", the follow-up turns sent to
another replica than the turn before them (whose context was cached there:
each one is a prefill the index did not save, unless the load bound chose
it, which the baseline shows); r2's mode as sampled every 0.25 s (P precise,
a approximate), its stream's gaps, gaps replayed, resets and reconnects, the
events it delivered in the window and the blocks kvgate's index holds for it.
Then the fleet hit ratio of every scenario side by side, and each scenario
before, during and after its fault.

    python -m bench.routing_faults                              # all five, 336 requests each, 6 minutes
    python -m bench.routing_faults --scenarios none cut --rate 1 --duration 20

Figures depend on the machine's load: report ``uptime`` beside them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable

import httpx
import orjson

from bench.chaos_fleet import MODEL, Sim, _kill, free_port, kvgate_config, start_kvgate
from bench.precise_fleet import precise_routing, replica_entries, start_event_sims, tokenizer_dir
from bench.routing_replay import Result, Usage, replay
from bench.workloads import Request, Workload
from bench.workloads.text import TextBank
from gateway.proxy.pool import parse_vllm_metrics

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = ["none", "restart", "crash", "cut", "late"]
VICTIM = "r2"
ADMIN_TOKEN = "routing-faults-bench"  # a throwaway token for a loopback-only admin port


# -- the workload --------------------------------------------------------------------------------
def conversations(*, duration_s: float, rate: float, turns: int, systems: int, system_tokens: int,
                  user_tokens: int, answer_tokens: int, think_s: tuple[float, float], seed: int) -> Workload:
    """Conversations starting as a Poisson process for ``duration_s``; each turn follows the last's answer."""
    rng, bank = random.Random(seed), TextBank(seed)
    requests: list[Request] = []
    t, conv = 0.0, 0
    while (t := t + rng.expovariate(rate)) < duration_s:
        messages: list[dict[str, str]] = [
            {"role": "system", "content": bank.paragraph(f"sys:{conv % systems}", system_tokens)}]
        prev: int | None = None
        for turn in range(turns):
            messages = [*messages, {"role": "user", "content": bank.paragraph(f"u:{conv}:{turn}", user_tokens)}]
            body = {"model": MODEL, "messages": messages, "max_tokens": 8}
            rid = len(requests)
            requests.append(Request(rid=rid, endpoint="chat", model=MODEL, namespace="app",
                                    build=lambda b=body: b, prompt_tokens=0, output_tokens=8, kv_hashes=(),
                                    arrival=t if prev is None else rng.uniform(*think_s), after=prev, prev=prev))
            # The next turn carries this one's answer in its history, as a client does.
            messages = [*messages, {"role": "assistant", "content": bank.paragraph(f"a:{conv}:{turn}", answer_tokens)}]
            prev = rid
        conv += 1
    return Workload("conversations", requests, f"{conv} conversations of {turns} turns over {systems} system "
                    f"prompts ({system_tokens} tokens), {rate:g}/s for {duration_s:g} s, think {think_s} s")


# -- faults --------------------------------------------------------------------------------------
async def set_faults(client: httpx.AsyncClient, sims: list[Sim], **faults: Any) -> None:
    for s in sims:
        (await client.post(s.url + "/sim/faults", json=faults, timeout=5)).raise_for_status()


def _stop(sim: Sim, sig: signal.Signals) -> None:
    assert sim.proc is not None
    sim.proc.send_signal(sig)
    sim.proc.wait(15)
    sim.proc = None


async def inject(name: str, sims: list[Sim], client: httpx.AsyncClient, args: argparse.Namespace,
                 mark: Callable[[str], None]) -> None:
    """Sleep until ``--fault-at``, then apply the scenario's fault (and undo it, where it ends)."""
    await asyncio.sleep(args.fault_at)
    victim = next(s for s in sims if s.name == VICTIM)
    if name in ("restart", "crash"):
        mark(f"{VICTIM} stopped ({'SIGTERM' if name == 'restart' else 'SIGKILL'})")
        await asyncio.to_thread(_stop, victim, signal.SIGTERM if name == "restart" else signal.SIGKILL)
        await asyncio.to_thread(victim.start)  # same flags: same HTTP, PUB and replay ports
        mark(f"{VICTIM} up again")
    elif name == "cut":
        mark(f"{VICTIM} stream cut")
        await set_faults(client, [victim], kv_events_drop=True)
        await asyncio.sleep(args.cut_s)
        await set_faults(client, [victim])
        mark(f"{VICTIM} stream back")
    elif name == "late":
        mark(f"events {args.late_s:g} s late")
        await set_faults(client, sims, kv_events_delay_s=args.late_s)
        await asyncio.sleep(args.late_for)
        await set_faults(client, sims)
        mark("events on time")


# -- observation ---------------------------------------------------------------------------------
@dataclass
class Sampler:
    """Reads the replicas' counters and kvgate's /admin/routing every window, the victim's mode more often."""

    sims: list[Sim]
    admin_url: str
    window_s: float
    client: httpx.AsyncClient
    t0: float = field(default_factory=time.perf_counter)
    windows: list[dict[str, Any]] = field(default_factory=list)
    modes: list[tuple[float, str]] = field(default_factory=list)
    events: list[tuple[float, str]] = field(default_factory=list)
    _last: dict[str, tuple[int, float, float]] = field(default_factory=dict)

    def mark(self, what: str) -> None:
        self.events.append((time.perf_counter() - self.t0, what))

    async def _routing(self) -> dict[str, Any] | None:
        try:
            r = await self.client.get(self.admin_url + "/admin/routing", timeout=5,
                                      headers={"authorization": f"Bearer {ADMIN_TOKEN}"})
            return r.json() if r.status_code == 200 else None
        except httpx.HTTPError:
            return None

    async def _counters(self) -> dict[str, tuple[float, float]]:
        """Each replica's hits and queries (tokens) since the last call; a restarted one's from its 0."""
        out: dict[str, tuple[float, float]] = {}
        for s in self.sims:
            pid = s.proc.pid if s.proc is not None else -1
            try:
                m = parse_vllm_metrics((await self.client.get(s.url + "/metrics", timeout=5)).text)
            except httpx.HTTPError:
                continue  # down: its counts so far stay as last read
            h, q = m.get("prefix_hits", 0.0), m.get("prefix_queries", 0.0)
            lpid, lh, lq = self._last.get(s.name, (pid, 0.0, 0.0))
            if pid != lpid:  # another process on the same port: its counters started from 0
                lh = lq = 0.0
            out[s.name] = (h - lh, q - lq)
            self._last[s.name] = (pid, h, q)
        return out

    async def run(self, stop: asyncio.Event) -> None:
        await self._counters()  # the zero point
        next_window = self.window_s
        while not stop.is_set():
            await asyncio.sleep(0.25)
            now = time.perf_counter() - self.t0
            routing = await self._routing()
            row = (routing or {}).get("kv_events", {}).get("replicas", {}).get(VICTIM)
            self.modes.append((now, "?" if row is None else row["mode"]))
            if now >= next_window:
                counts = await self._counters()
                self.windows.append({"end_s": next_window, "counters": counts,
                                     "victim": {**{k: row.get(k) for k in ("mode", "state", "gaps", "gaps_replayed",
                                                                           "resets", "reconnects", "events_received")},
                                                "blocks": (row.get("index") or {}).get("blocks")} if row else None,
                                     "precise_decisions": (routing or {}).get("precise_decisions")})
                next_window += self.window_s


def _ratio(hits: float, queries: float) -> float | None:
    return hits / queries if queries else None


def timeline(workload: Workload, results: list[Result], replicas: dict[int, str], sampler: Sampler,
             window_s: float) -> list[dict[str, Any]]:
    """Per window: requests started, client errors, hit ratios (fleet and victim), moved turns, the victim's modes.

    A follow-up turn is "moved" when it went to another replica than the turn before it: its
    context was cached there, so each move is a prefill the index did not save (or the load
    bound chose, which the baseline shows).
    """
    prev = {r.rid: r.prev for r in workload.requests}
    rows = []
    received = None
    for w in sampler.windows:
        lo, hi = w["end_s"] - window_s, w["end_s"]
        started = [r for r in results if lo <= r.started < hi]
        ok = [r.usage for r in started if r.usage is not None]
        prompt = sum(u.prompt_tokens for u in ok)
        cached = sum(u.cached_tokens or 0 for u in ok)
        follow = [r for r in started if not r.error and prev[r.rid] is not None and prev[r.rid] in replicas]
        moved = sum(1 for r in follow if replicas.get(r.rid) != replicas[prev[r.rid]])  # type: ignore[index]
        modes = "".join("P" if m == "precise" else "a" if m == "approximate" else "?"
                        for t, m in sampler.modes if lo <= t < hi)
        counts = w["counters"]
        hits, queries = sum(h for h, _ in counts.values()), sum(q for _, q in counts.values())
        errors = [r for r in started if r.error]
        total = (w["victim"] or {}).get("events_received")
        events = None if total is None or received is None else total - received
        received = total if total is not None else received
        rows.append({"events": events, "from_s": lo, "to_s": hi, "requests": len(started), "errors": len(errors),
                     "errors_on_victim": sum(1 for r in errors if _on_victim(r, replicas)),
                     "hit_replicas": _ratio(hits, queries), "hit_cached_tokens": _ratio(cached, prompt),
                     "victim_requests": sum(1 for r in started if replicas.get(r.rid) == VICTIM),
                     "hit_victim": _ratio(*counts[VICTIM]) if VICTIM in counts else None,
                     "follow_ups": len(follow), "moved": moved, "victim_modes": modes,
                     "victim": w["victim"], "precise_decisions": w["precise_decisions"]})
    return rows


def phases(workload: Workload, results: list[Result], replicas: dict[int, str], marks: list[tuple[float, str]],
           args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Before the fault, during it (to one window past its end, the relearning), and after: by request start."""
    start = marks[0][0] if marks else args.fault_at
    end = (marks[-1][0] if len(marks) > 1 else start + args.cut_s) + args.window
    prev = {r.rid: r.prev for r in workload.requests}
    out = {}
    for name, lo, hi in (("before", 0.0, start), ("during", start, end), ("after", end, float("inf"))):
        rs = [r for r in results if lo <= r.started < hi]
        ok = [r.usage for r in rs if r.usage is not None]
        follow = [r for r in rs if not r.error and prev[r.rid] is not None and prev[r.rid] in replicas]
        moved = sum(1 for r in follow if replicas.get(r.rid) != replicas[prev[r.rid]])  # type: ignore[index]
        out[name] = {"from_s": lo, "to_s": hi, "requests": len(rs), "errors": sum(1 for r in rs if r.error),
                     "hit": _ratio(sum(u.cached_tokens or 0 for u in ok), sum(u.prompt_tokens for u in ok)),
                     "moved": moved, "follow_ups": len(follow)}
    return out


def _on_victim(r: Result, replicas: dict[int, str]) -> bool:
    # kvgate's own error (a 502 before any byte) carries no replica header; its message names it.
    return replicas.get(r.rid) == VICTIM or f"replica {VICTIM} " in (r.error or "")


# -- one scenario --------------------------------------------------------------------------------
async def _sender(url: str, client: httpx.AsyncClient,
                  replicas: dict[int, str]) -> Callable[[Request], Awaitable[Usage]]:
    async def send(req: Request) -> Usage:
        body = {**req.body(), "stream": True, "stream_options": {"include_usage": True}}
        t0, ttft, usage = time.perf_counter(), None, {}
        async with client.stream("POST", url + "/v1/chat/completions", content=orjson.dumps(body),
                                 headers={"content-type": "application/json"}) as resp:
            replicas[req.rid] = resp.headers.get("x-kvgate-replica", "?")
            if resp.status_code != 200:
                raise RuntimeError(f"status {resp.status_code}: {(await resp.aread())[:200]!r}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                obj = orjson.loads(line[6:])
                if "error" in obj:
                    raise RuntimeError(f"error event: {line[:200]}")
                usage = obj.get("usage") or usage
        details = usage.get("prompt_tokens_details") or {}
        return Usage(int(usage.get("prompt_tokens", 0)), details.get("cached_tokens"), ttft)

    return send


def _reset(sims: list[Sim]) -> None:
    for s in sims:
        httpx.post(s.url + "/sim/faults", json={}, timeout=5).raise_for_status()
        httpx.post(s.url + "/sim/reset", timeout=5).raise_for_status()


def _wait_precise(admin_url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        r = httpx.get(admin_url + "/admin/routing", timeout=5, headers={"authorization": f"Bearer {ADMIN_TOKEN}"})
        rows = r.json().get("kv_events", {}).get("replicas", {}) if r.status_code == 200 else {}
        if rows and all(x["mode"] == "precise" for x in rows.values()):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"not every replica precise after {timeout} s: {rows}")
        time.sleep(0.1)


async def _drive(name: str, workload: Workload, sims: list[Sim], gw_url: str, admin_url: str,
                 args: argparse.Namespace) -> dict[str, Any]:
    replicas: dict[int, str] = {}
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=256)) as client, \
            httpx.AsyncClient(timeout=10) as control:
        sampler = Sampler(sims, admin_url, args.window, control)
        stop = asyncio.Event()
        watch = asyncio.create_task(sampler.run(stop))
        fault = asyncio.create_task(inject(name, sims, control, args, sampler.mark))
        send = await _sender(gw_url, client, replicas)
        results = await replay(workload, send)
        await fault
        stop.set()
        await watch
        final = await sampler._routing()
    rows = timeline(workload, results, replicas, sampler, args.window)
    errors = [r for r in results if r.error]
    return {"scenario": name, "requests": len(results), "errors": len(errors),
            "errors_on_victim": sum(1 for r in errors if _on_victim(r, replicas)),
            "error_samples": sorted({r.error or "" for r in errors})[:5], "marks": sampler.events,
            "timeline": rows, "phases": phases(workload, results, replicas, sampler.events, args),
            "victim_final": (final or {}).get("kv_events", {}).get("replicas", {}).get(VICTIM)}


def run_scenario(name: str, workload: Workload, sims: list[Sim], tokenizer: str, workdir: Path,
                 args: argparse.Namespace) -> dict[str, Any]:
    _reset(sims)
    admin_port = free_port()
    cfg = kvgate_config(free_port(), sims, replicas=replica_entries(sims),
                        routing=precise_routing(tokenizer, kv_events={"stale_s": args.stale_s}),
                        admin={"host": "127.0.0.1", "port": admin_port, "token": ADMIN_TOKEN},
                        pool={"health_interval_s": 1.0, "metrics_interval_s": 1.0})
    (workdir / name).mkdir(exist_ok=True)
    gw = start_kvgate(workdir / name, cfg, timeout=180)  # its tokenizer loads in seconds, minutes on a busy box
    admin_url = f"http://127.0.0.1:{admin_port}"
    try:
        _wait_precise(admin_url)
        return asyncio.run(_drive(name, workload, sims, gw.url, admin_url, args))
    finally:
        _kill(gw.proc)


# -- report --------------------------------------------------------------------------------------
def _pct(x: float | None) -> str:
    return "  -  " if x is None else f"{x:.3f}"


def print_scenario(r: dict[str, Any]) -> None:
    marks = "; ".join(f"{t:.1f} s {what}" for t, what in r["marks"])
    print(f"\n== {r['scenario']}: {r['requests']} requests, {r['errors']} client errors "
          f"({r['errors_on_victim']} on {VICTIM}){'; ' + marks if marks else ''}")
    for e in r["error_samples"]:
        print(f"   error: {e[:160]}")
    print(f"{'window':>12}{'requests':>9}{'errors':>7}{'hit fleet':>11}{'(cached_tokens)':>16}"
          f"{VICTIM + ' req':>8}{VICTIM + ' hit':>8}{'moved':>9}  {VICTIM + ' mode':<12}{'gaps':>5}{'replayed':>9}"
          f"{'resets':>7}{'reconnects':>11}{'events':>8}{'blocks':>8}")
    for w in r["timeline"]:
        v = w["victim"] or {}
        moved = f"{w['moved']}/{w['follow_ups']}"
        print(f"{w['from_s']:>5.0f}-{w['to_s']:<4.0f} s{w['requests']:>9}{w['errors']:>7}"
              f"{_pct(w['hit_replicas']):>11}{_pct(w['hit_cached_tokens']):>16}{w['victim_requests']:>8}"
              f"{_pct(w['hit_victim']):>8}{moved:>9}  {w['victim_modes']:<12}{v.get('gaps', '-'):>5}"
              f"{v.get('gaps_replayed', '-'):>9}{v.get('resets', '-'):>7}{v.get('reconnects', '-'):>11}"
              f"{'-' if w['events'] is None else w['events']:>8}{v.get('blocks', '-'):>8}")


def print_across(out: list[dict[str, Any]]) -> None:
    """Fleet hit ratio (replicas' counters) per window, scenarios side by side; '*' where r2 was not precise."""
    print("\nfleet hit ratio per window (replicas' own counters); * = r2 approximate at some sample in the window")
    print(f"{'window':>12}" + "".join(f"{r['scenario']:>10}" for r in out))
    for i in range(max(len(r["timeline"]) for r in out)):
        cells, label = [], ""
        for r in out:
            if i >= len(r["timeline"]):
                cells.append(f"{'':>10}")
                continue
            w = r["timeline"][i]
            label = f"{w['from_s']:>5.0f}-{w['to_s']:<4.0f} s"
            flag = "*" if "a" in w["victim_modes"] or "?" in w["victim_modes"] else " "
            cells.append(f"{_pct(w['hit_replicas']):>9}{flag}")
        print(f"{label:>12}" + "".join(cells))
    print(f"{'errors':>12}" + "".join(f"{r['errors']:>10}" for r in out))
    print("\nby phase (request start; 'during' runs one window past the fault's end): hit ratio (cached_tokens) / "
          "follow-up turns moved to another replica")
    print(f"{'scenario':<10}{'before':>18}{'during':>24}{'after':>18}{'errors':>8}  "
          f"{VICTIM} at the end: gaps / replayed / resets / reconnects")
    for r in out:
        ph, v = r["phases"], r["victim_final"] or {}
        cells = [f"{_pct(ph[k]['hit'])} {ph[k]['moved']}/{ph[k]['follow_ups']}" for k in ("before", "during", "after")]
        span = f"({ph['during']['from_s']:.0f}-{ph['during']['to_s']:.0f} s)"
        counters = " / ".join(str(v.get(k, "-")) for k in ("gaps", "gaps_replayed", "resets", "reconnects"))
        print(f"{r['scenario']:<10}{cells[0]:>18}{span:>11}{cells[1]:>13}{cells[2]:>18}{r['errors']:>8}  {counters}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenarios", nargs="+", default=SCENARIOS, choices=SCENARIOS)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--duration", type=float, default=40.0, help="conversations start during this many seconds")
    p.add_argument("--rate", type=float, default=1.5, help="conversations started per second")
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--systems", type=int, default=16, help="distinct system prompts")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--window", type=float, default=2.0, help="seconds per timeline row")
    p.add_argument("--fault-at", type=float, default=8.0)
    p.add_argument("--cut-s", type=float, default=5.0)
    p.add_argument("--late-s", type=float, default=0.5)
    p.add_argument("--late-for", type=float, default=10.0)
    p.add_argument("--stale-s", type=float, default=5.0, help="kvgate's routing.kv_events.stale_s")
    p.add_argument("--kv-blocks", type=int, default=1024, help="KV pool per replica (16-token blocks)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    args = p.parse_args(argv)
    workload = conversations(duration_s=args.duration, rate=args.rate, turns=args.turns, systems=args.systems,
                             system_tokens=256, user_tokens=64, answer_tokens=96, think_s=(0.05, 0.3),
                             seed=args.seed)
    tokenizer = tokenizer_dir()
    print(f"workload: {workload.description}, {len(workload.requests)} requests per scenario; "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    sims = start_event_sims([f"r{i + 1}" for i in range(args.replicas)], {
        "kv_blocks": args.kv_blocks, "prefill_s_per_token": 0.00005, "decode_base_s": 0.005,
        "max_num_seqs": 16}, tokenizer)
    workdir = Path(tempfile.mkdtemp(prefix="kvgate-route-faults-"))
    out: list[dict[str, Any]] = []
    try:
        for name in args.scenarios:
            r = run_scenario(name, workload, sims, tokenizer, workdir, args)
            print_scenario(r)
            out.append(r)
        print_across(out)
        print(f"load average at the end {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "routing_faults.json").write_text(json.dumps(out, indent=1))
    finally:
        for s in sims:
            s.kill()
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
