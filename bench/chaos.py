"""Chaos run: real replicas, Redis and kvgate on loopback, faults injected under load, every answer checked.

Four vllm_sim replicas, one private Redis and one kvgate process; an asyncio
load generator (httpx) sends a mix of streaming and non-streaming chat
requests, some repeated so the semantic cache answers them. Each scenario
injects one fault for a few seconds of load; every response is judged
against the one right answer (``bench.chaos_check``):

    ok      complete and correct
    clean   an OpenAI-shaped HTTP error, or a correct prefix then exactly one error event
    lost    no usable ending (must be 0)
    wrong   served text that is not the answer or its prefix, or an invented ending (must be 0)

    python -m bench.chaos                                   # all scenarios, ~3 minutes on 2 cores
    python -m bench.chaos --quick                           # shorter and lighter
    python -m bench.chaos --scenarios baseline garbage_sse --duration 4 --concurrency 16
    python -m bench.chaos --pd                              # the P/D fleet and scenarios (bench.chaos_pd)

Exits 1 when any request was lost or wrong. Timeouts are small on purpose
(first_byte_s 1, stall_s 1) so slow-upstream faults trip them within seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import httpx
import orjson

from bench.chaos_check import Expected, Verdict, expected_answer, judge_stream, judge_unary
from bench.chaos_faults import (STREAMING, flap_r3, kill_busiest, kill_r2, redis_back_later, redis_down, redis_hang,
                                redis_restart, restart_r2_later, set_faults)
from bench.chaos_fleet import MODEL, Fleet, parse_metrics, start_fleet
from bench.chaos_report import format_details, format_table

API_KEY = "sk-kvg-chaos-run-key-0000000000000000"
SIM_FLAGS = {"decode_base_s": 0.02, "decode_s_per_seq": 0.0005, "max_num_seqs": 64}
GATEWAY = {
    "redis_timeout_s": 0.25,
    "semantic_cache": {"enabled": True, "embedder": "hash", "probe_interval_s": 0.5},
    # A real limit checked in Redis on every request, high enough never to refuse one.
    "tenants": [{"name": "chaos", "api_keys": [API_KEY], "requests_per_minute": 10_000_000}],
    "timeouts": {"connect_s": 1.0, "first_byte_s": 1.0, "stall_s": 1.0, "non_stream_s": 5.0},
    # Slow active health checks: a replica that just died must be found by requests (refused
    # connections, retries, passive ejection), not by a check that happened to run first.
    "pool": {"health_interval_s": 5.0, "metrics_interval_s": 0.5, "eject_base_s": 2.0, "eject_max_s": 6.0},
    # Routing facts published and tailed through the same Redis: its faults must cost
    # the sharing only.
    "routing": {"share_index": True},
}
DEADLINE_S = 20.0  # no answer by then: lost
_PROBE = {"model": MODEL, "messages": [{"role": "user", "content": "settle probe"}], "max_tokens": 1}

_VOCAB = (
    "amber basalt cedar delta ember fjord garnet harbor indigo juniper kelp lagoon marble nectar "
    "obsidian prairie quartz rapids sierra tundra umber valley willow xenon yarrow zephyr anchor "
    "beacon canyon dune estuary falcon glacier heron island jasper kestrel lantern meadow nimbus "
    "orchard pebble quiver ridge summit thicket upland vortex wharf yonder zenith acorn bramble "
    "cobalt drizzle egret fern grove hollow ivy jetty knoll lichen moss nettle oak pine quail reef "
    "sage thistle urchin vine wren yew zinc alder birch clover daisy elm fox gale hazel iris"
).split()
# Many applications' system prompts: prefix-affinity routing homes each on one replica, and with
# this many every replica is home to several, so a fault on any one replica meets traffic at once.
_SYSTEMS = tuple(f"You are assistant #{i} of a chaos test of an LLM gateway; answer {style} in plain words."
                 for i, style in enumerate(("tersely", "briefly", "calmly", "plainly", "kindly", "dryly") * 4))


# -- workload ---------------------------------------------------------------------------------------
class Workload:
    """Seeded chat requests: mostly unique prompts, some repeated (cache hits), streams and not."""

    def __init__(self, seed: int = 0, *, popular: int = 8, p_repeat: float = 0.3, p_stream: float = 0.6,
                 p_usage: float = 0.3, p_no_limit: float = 0.1, p_n2: float = 0.05) -> None:
        self.rng = random.Random(seed)
        self.seed = seed
        self.counter = 0
        self.p = {"repeat": p_repeat, "stream": p_stream, "usage": p_usage, "no_limit": p_no_limit, "n2": p_n2}
        self.popular = [self._unique(cacheable=True) for _ in range(popular)]
        self._memo: dict[bytes, Expected] = {}

    def _unique(self, *, cacheable: bool = False) -> dict[str, Any]:
        rng = self.rng
        self.counter += 1
        words = " ".join(rng.sample(_VOCAB, rng.randint(6, 12)))
        messages: list[dict[str, Any]] = [{"role": "system", "content": rng.choice(_SYSTEMS)}]
        if rng.random() < 0.2:
            messages += [{"role": "user", "content": f"Earlier question {self.counter}: {rng.choice(_VOCAB)}?"},
                         {"role": "assistant", "content": " ".join(rng.sample(_VOCAB, 5))}]
        messages.append({"role": "user", "content": f"Question {self.seed}-{self.counter}: {words}?"})
        body: dict[str, Any] = {"model": MODEL, "messages": messages}
        # Repeated prompts end by themselves ("stop"): the cache refuses "length" cut-offs.
        if not cacheable and rng.random() >= self.p["no_limit"]:
            body["max_tokens"] = rng.randint(6, 24)
        if not cacheable and rng.random() < self.p["n2"]:
            body["n"] = 2
        return body

    def next(self) -> tuple[dict[str, Any], Expected]:
        rng = self.rng
        base = rng.choice(self.popular) if rng.random() < self.p["repeat"] else self._unique()
        body = dict(base)
        if rng.random() < self.p["stream"]:
            body["stream"] = True
            if rng.random() < self.p["usage"]:
                body["stream_options"] = {"include_usage": True}
        key = orjson.dumps([base["messages"], base.get("max_tokens"), base.get("n")])
        exp = self._memo.get(key)
        if exp is None:
            exp = expected_answer(body)
            if base in self.popular:
                self._memo[key] = exp
        return body, exp


# -- one request ------------------------------------------------------------------------------------


@dataclass(slots=True)
class Result:
    verdict: Verdict
    latency_s: float
    stream: bool
    cache: str = ""
    repro: str | None = None  # for lost and wrong: what was sent and what came back


async def send(client: httpx.AsyncClient, url: str, body: dict[str, Any], exp: Expected,
               deadline_s: float = DEADLINE_S) -> Result:
    stream = bool(body.get("stream"))
    raw = bytearray()
    status, ctype, cache, terr = 0, "", "", None
    started = time.perf_counter()
    verdict: Verdict | None = None
    try:
        async with asyncio.timeout(deadline_s):
            async with client.stream("POST", url, content=orjson.dumps(body),
                                     headers={"authorization": f"Bearer {API_KEY}",
                                              "content-type": "application/json"}) as resp:
                status = resp.status_code
                ctype = resp.headers.get("content-type", "")
                cache = resp.headers.get("x-kvgate-cache", "")
                replica = resp.headers.get("x-kvgate-replica", "") if stream and status == 200 else ""
                counted = False
                try:
                    async for chunk in resp.aiter_raw():
                        raw += chunk
                        if replica and not counted and raw.count(b"data: ") >= 2:
                            STREAMING[replica] += 1  # past its first event: a token has come
                            counted = True
                finally:
                    if counted:
                        STREAMING[replica] -= 1
    except TimeoutError:
        verdict = Verdict("lost", "no response within the deadline")
    except httpx.HTTPError as e:
        terr = type(e).__name__
    elapsed = time.perf_counter() - started
    if verdict is None and status == 0:
        verdict = Verdict("lost", f"transport: {terr}")
    if verdict is None:
        usage = bool((body.get("stream_options") or {}).get("include_usage"))
        verdict = (judge_stream(exp, status, ctype, bytes(raw), include_usage=usage, transport_error=terr)
                   if stream else judge_unary(exp, status, bytes(raw), transport_error=terr))
    repro = None
    if verdict.kind in ("lost", "wrong"):
        repro = (f"{verdict.detail}: POST {url} {orjson.dumps(body).decode()} -> status {status} "
                 f"content-type {ctype!r}, body {bytes(raw)[:600]!r}; expected {exp.texts!r} ({exp.finish_reason})")
    return Result(verdict, elapsed, stream, cache, repro)


# -- tallies ----------------------------------------------------------------------------------------
@dataclass
class Tally:
    scenario: str
    results: list[Result] = field(default_factory=list)
    retries: float = 0.0
    ejections: float = 0.0
    notes: list[str] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)  # what the fault script observed
    settle_s: float = 0.0
    deltas: dict[str, float] = field(default_factory=dict)  # kvgate's /metrics series, after less before
    unexercised: str | None = None  # the scenario's ``exercised`` verdict: why the fault was not hit

    def delta(self, name: str, **labels: str) -> float:
        """How much the series ``name`` with these labels (any others) grew during the load."""
        want = [f'{k}="{v}"' for k, v in labels.items()]
        return sum(v for k, v in self.deltas.items()
                   if (k == name or k.startswith(name + "{")) and all(w in k for w in want))

    def count(self, kind: str) -> int:
        return sum(1 for r in self.results if r.verdict.kind == kind)

    @property
    def sent(self) -> int:
        return len(self.results)

    @property
    def ok(self) -> int:
        return self.count("ok")

    @property
    def clean(self) -> int:
        return self.count("clean")

    @property
    def lost(self) -> int:
        return self.count("lost")

    @property
    def wrong(self) -> int:
        return self.count("wrong")

    @property
    def cache_hits(self) -> int:
        return sum(1 for r in self.results if r.cache == "hit" and r.verdict.kind == "ok")

    def details(self) -> Counter[str]:
        return Counter(f"{r.verdict.kind}: {r.verdict.detail}" for r in self.results if r.verdict.kind != "ok")

    def detail_count(self, text: str) -> int:
        return sum(1 for r in self.results if text in r.verdict.detail)

    def latency_ms(self, q: float) -> float | None:
        xs = sorted(r.latency_s for r in self.results if r.verdict.kind == "ok")
        if not xs:
            return None
        return 1000 * xs[min(len(xs) - 1, int(q * len(xs)))]

    def repros(self, limit: int = 5) -> list[str]:
        return [r.repro for r in self.results if r.repro][:limit]


# -- scenarios --------------------------------------------------------------------------------------
@dataclass
class Ctx:
    """What a scenario's fault script may touch: the fleet, a control client, the clock, notes."""

    fleet: Fleet
    control: httpx.AsyncClient
    duration: float
    tally: Tally
    t0: float = 0.0

    async def at(self, seconds: float) -> None:
        """Sleep until ``seconds`` after the load started."""
        await asyncio.sleep(max(0.0, self.t0 + seconds - time.monotonic()))

    async def faults(self, name: str, **faults: Any) -> None:
        r = await self.control.post(self.fleet.sim(name).url + "/sim/faults", json=faults)
        r.raise_for_status()

    async def metrics(self) -> dict[str, float]:
        r = await self.control.get(self.fleet.gateway.url + "/metrics")
        return parse_metrics(r.text)

    async def note_readiness(self, when: str) -> None:
        r = await self.control.get(self.fleet.gateway.url + "/readyz")
        degraded = r.json().get("degraded") or []
        self.tally.facts.setdefault("degraded", []).extend(degraded)
        self.tally.notes.append(f"/readyz {when}: {r.status_code} degraded={degraded}")

    async def note_redis_keys(self, when: str) -> None:
        assert self.fleet.redis is not None
        keys = await asyncio.to_thread(self.fleet.redis.dbsize)
        self.tally.facts["redis_keys"] = keys
        self.tally.notes.append(f"Redis holds {keys} keys {when}")


Script = Callable[[Ctx], Awaitable[None]]


async def _nothing(ctx: Ctx) -> None:
    return None


@dataclass(frozen=True)
class Scenario:
    name: str
    what: str
    setup: Script = _nothing  # before the load starts
    act: Script = _nothing  # alongside the load, from t0
    undo: Script = _nothing  # once the load has ended, before the metrics are read
    # Returns why the fault was not exercised, or None when it was.
    exercised: Callable[[Tally], str | None] = lambda t: None


def _need(cond: bool, why: str) -> str | None:
    return None if cond else why


def _all_ok(t: Tally) -> str | None:
    return _need(t.ok == t.sent, "requests failed though only Redis was faulty")


def _redis_outage(t: Tally) -> str | None:
    seen = any("semantic cache" in d for d in t.facts.get("degraded", []))
    return _all_ok(t) or _need(seen, "/readyz never reported the cache store degraded")


def _redis_back(t: Tally) -> str | None:
    return _all_ok(t) or _need(t.facts.get("redis_keys", 0) > 0, "nothing written to the restarted Redis")


def _clean(t: Tally) -> str | None:
    return _need(t.clean > 0, "no clean error: the fault never reached a client")


SCENARIOS: list[Scenario] = [
    Scenario("baseline", "no fault", exercised=lambda t: _need(t.ok == t.sent and t.cache_hits > 0,
                                                                "errors, or no cache hit")),
    Scenario("replica_refused", "r2 SIGKILLed while idle (connection refused), restarted at 60%",
             setup=kill_r2, act=restart_r2_later, exercised=lambda t: _need(t.retries > 0, "no retry")),
    Scenario("replica_killed_midstream", "the busiest replica SIGKILLed with streams open, restarted at 60%",
             act=kill_busiest,
             exercised=lambda t: _need(t.detail_count("error event after tokens") > 0, "no stream cut mid-way")),
    Scenario("flapping_replica", "r3 error_rate toggles 1.0 / 0.0 every 0.5 s", act=flap_r3, exercised=_clean),
    Scenario("redis_refused", "Redis killed before the load, back at 60%", setup=redis_down,
             act=redis_back_later, exercised=_redis_outage),
    Scenario("redis_hung", "Redis SIGSTOPped for up to 3 s, then SIGCONT", act=redis_hang,
             exercised=_redis_outage),
    Scenario("redis_restarted", "Redis killed and started again (empty) at 30%", act=redis_restart,
             exercised=_redis_back),
    Scenario("slow_first_token", "r1 holds every request 6 s before its first token",
             setup=set_faults(r1={"stall_before_first_token_s": 6.0}), exercised=_clean),
    Scenario("stall_mid_stream", "r1 stalls 2 s after 3 tokens",
             setup=set_faults(r1={"stall_mid_stream_s": 2.0, "stall_after_tokens": 3}),
             exercised=lambda t: _need(t.detail_count("error event after tokens") > 0, "no mid-stream error")),
    Scenario("garbage_sse", "r1 sends a malformed SSE event after the first token (unary: half a body)",
             setup=set_faults(r1={"garbage": True}), exercised=_clean),
    # Every such answer is retried on another replica within the budget, so the fault shows as
    # retries; past the budget, as clean errors.
    Scenario("html_200", "r1 answers 200 text/html", setup=set_faults(r1={"html_200": True}),
             exercised=lambda t: _need(t.retries > 0 or t.clean > 0, "no retry and no clean error")),
    Scenario("half_fleet_failing", "r1 and r2 answer 500 to everything",
             setup=set_faults(r1={"error_rate": 1.0}, r2={"error_rate": 1.0}),
             exercised=lambda t: _need(t.clean > 0 and t.ok > 0, "no errors or no successes")),
]
BY_NAME = {s.name: s for s in SCENARIOS}


# -- running ----------------------------------------------------------------------------------------
async def run_load(client: httpx.AsyncClient, url: str, workload: Workload, *, duration: float,
                   concurrency: int) -> list[Result]:
    """Closed loop: ``concurrency`` workers send back to back; none starts a request after ``duration``."""
    results: list[Result] = []
    stop_at = time.monotonic() + duration

    async def worker() -> None:
        while time.monotonic() < stop_at:
            body, exp = workload.next()
            results.append(await send(client, url, body, exp))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


async def settle(fleet: Fleet, control: httpx.AsyncClient, timeout: float = 20.0) -> tuple[float, str | None]:
    """Undo every fault and wait until kvgate reports nothing degraded. Returns (seconds, problem)."""
    started = time.monotonic()
    redis = fleet.redis
    if redis is not None:
        redis.resume()
        if not redis.alive:
            await asyncio.to_thread(redis.start)
    dead = [s for s in fleet.sims if not s.alive]
    await asyncio.gather(*(asyncio.to_thread(s.start) for s in dead))
    for s in fleet.sims:
        (await control.post(s.url + "/sim/faults", json={})).raise_for_status()
    body: dict[str, Any] = {}
    while time.monotonic() - started < timeout:
        r = await control.get(fleet.gateway.url + "/readyz")
        body = r.json()
        if r.status_code == 200 and not body.get("degraded"):
            return time.monotonic() - started, None
        # A trickle of traffic: breakers (rate limiter) probe Redis only when a request comes.
        await control.post(fleet.gateway.url + "/v1/chat/completions", json=_PROBE,
                           headers={"authorization": f"Bearer {API_KEY}"})
        await asyncio.sleep(0.25)
    return time.monotonic() - started, f"kvgate still degraded after {timeout:.0f} s: {body.get('degraded')}"


async def run_scenario(fleet: Fleet, scenario: Scenario, workload: Workload, client: httpx.AsyncClient,
                       control: httpx.AsyncClient, *, duration: float, concurrency: int) -> Tally:
    tally = Tally(scenario.name)
    tally.settle_s, problem = await settle(fleet, control)
    if problem:
        tally.notes.append(problem)
    ctx = Ctx(fleet, control, duration, tally)
    before = await ctx.metrics()
    await scenario.setup(ctx)
    ctx.t0 = time.monotonic()
    url = fleet.gateway.url + "/v1/chat/completions"
    results, _ = await asyncio.gather(run_load(client, url, workload, duration=duration, concurrency=concurrency),
                                      scenario.act(ctx))
    tally.results = results
    await scenario.undo(ctx)
    after = await ctx.metrics()
    tally.deltas = {k: v - before.get(k, 0.0) for k, v in after.items()}
    tally.retries = tally.delta("kvgate_retries_total")
    tally.ejections = tally.delta("kvgate_ejections_total")
    tally.unexercised = scenario.exercised(tally)
    if fleet.gateway.proc.poll() is not None:
        tally.notes.append(f"kvgate exited with {fleet.gateway.proc.returncode}:\n{fleet.gateway.log_tail()}")
    return tally


async def run_chaos(fleet: Fleet, scenarios: list[Scenario], *, duration: float, concurrency: int,
                    seed: int = 0, on_tally: Callable[[Tally], None] | None = None) -> list[Tally]:
    """Run ``scenarios`` one after the other against a started fleet."""
    workload = Workload(seed)
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    timeout = httpx.Timeout(DEADLINE_S + 5)
    tallies = []
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client, \
            httpx.AsyncClient(timeout=10, trust_env=False) as control:
        for scenario in scenarios:
            tally = await run_scenario(fleet, scenario, workload, client, control, duration=duration,
                                       concurrency=concurrency)
            tallies.append(tally)
            if on_tally is not None:
                on_tally(tally)
            if fleet.gateway.proc.poll() is not None:
                break
    return tallies


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=None, help="seconds of load per scenario (default 6)")
    parser.add_argument("--concurrency", type=int, default=None, help="concurrent clients (default 32)")
    parser.add_argument("--scenarios", nargs="+", metavar="NAME", help="run only these")
    parser.add_argument("--quick", action="store_true", help="3 s per scenario, 12 clients")
    parser.add_argument("--pd", action="store_true",
                        help="a P/D fleet (2 prefill, 2 decode replicas) and its scenarios (bench.chaos_pd)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    duration = args.duration or (3.0 if args.quick else 6.0)
    concurrency = args.concurrency or (12 if args.quick else 32)
    if args.pd:
        from bench import chaos_pd  # imported here: it builds on this module

        by_name, everything, start = chaos_pd.BY_NAME, chaos_pd.SCENARIOS, chaos_pd.start_pd_fleet
    else:
        by_name, everything = BY_NAME, SCENARIOS
        start = lambda: start_fleet(replicas=4, sim_flags=SIM_FLAGS, gateway=GATEWAY)  # noqa: E731
    unknown = sorted(set(args.scenarios or ()) - set(by_name))
    if unknown:
        parser.error(f"unknown scenarios {unknown}; {'--pd ' if args.pd else ''}choices: {sorted(by_name)}")
    scenarios = [by_name[n] for n in args.scenarios] if args.scenarios else everything
    started = time.monotonic()
    fleet = start()
    try:
        print(f"fleet up in {time.monotonic() - started:.1f} s: kvgate {fleet.gateway.url}, "
              f"replicas {[s.url for s in fleet.sims]}, redis {fleet.redis.url if fleet.redis else '-'}",
              file=sys.stderr)

        def progress(t: Tally) -> None:
            print(f"  {t.scenario}: sent {t.sent} ok {t.ok} clean {t.clean} lost {t.lost} wrong {t.wrong}",
                  file=sys.stderr)

        tallies = asyncio.run(run_chaos(fleet, scenarios, duration=duration, concurrency=concurrency,
                                        seed=args.seed, on_tally=progress))
    finally:
        fleet.close()
    print(f"\nchaos: {duration:g} s per scenario, {concurrency} concurrent clients, "
          f"{time.monotonic() - started:.0f} s in all\n")
    print(format_table(tallies))
    details = format_details(tallies)
    if details:
        print("\n" + details)
    bad = sum(t.lost + t.wrong for t in tallies)
    if bad:
        print(f"\nFAIL: {bad} request(s) lost or wrong", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
