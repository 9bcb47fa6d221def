"""Routing end to end: the same workload through a real kvgate over HTTP to ``vllm_sim`` processes.

The discrete-event benchmark (``bench/routing.py``) compares policies in one
process; this one checks that the real gateway does what the simulation says.
For each policy it starts a fresh kvgate process (replicas' KV pools reset),
replays the workload through kvgate's HTTP API with streaming requests, and
reads the fleet's prefix-cache hit ratio from the replicas' own
``vllm:prefix_cache_hits_total`` / ``_queries_total`` counters, next to the
ratio from ``usage.prompt_tokens_details.cached_tokens`` and TTFT measured
by the client.

    python -m bench.routing_e2e                       # shared-prefix + mtbench, 4 replicas
    python -m bench.routing_e2e --workloads mtbench --requests 300
    python -m bench.routing_e2e --instances 3         # 3 kvgate processes, each request to a random one

With ``--instances N`` every policy runs as N kvgate processes (clients spread
over them at random, as a Service does), and ``prefix_affinity+shared`` is
added: the same with ``routing.share_index`` through a Redis (``--redis-url``,
else a private ``redis-server`` started for the run).

The real SGLang model gateway runs over the same replicas as rows
``smg:cache_aware``, ``smg:round_robin`` and ``smg:prefix_hash`` (``bench.smg``;
``pip install smg``, in the ``bench`` extra; left out with a note if it is
not installed), and vLLM's own router as ``vllm-router:cache_aware``,
``vllm-router:round_robin`` and ``vllm-router:consistent_hash``
(``bench.vllm_router``; ``pip install vllm-router``, likewise):

    python -m bench.routing_e2e --workloads heavy_orgs heavy_orgs_burst \
        --policies round_robin least_load prefix_affinity smg:cache_aware smg:round_robin \
        vllm-router:cache_aware

With ``--precise`` the replicas tokenize with a real tokenizer directory (the
MiniLM one ``kvgate demo --precise`` builds) and publish KV events in vLLM's
wire format, and a ``prefix_affinity precise`` row runs kvgate with that
directory for the model and every replica's ``kv_events``/``kv_events_replay``,
beside ``prefix_affinity`` without them on the same replicas (approximate:
no token ids, so the events go unread). Before such a
row replays anything, every instance must report each replica precise in its
``kvgate_kv_events_precise`` gauge:

    python -m bench.routing_e2e --precise --policies prefix_affinity --instances 4

A ``ttft precise`` row (with ``--precise``, named in ``--policies``) runs the default policy on
the same events, and with ``--instances N`` also ``ttft precise+shared``: its instances sharing
block facts through the Redis as well.

``heavy_orgs`` is the generated suite's ``heavy4-closed8`` family (as many
heavy organisations as replicas, 8 closed-loop clients, a few hundred
requests), ``heavy_orgs_burst`` its ``heavy4-burst16`` (16 clients in bursts
of 1 s every 3 s), ``orgs_layered`` its ``layered-4orgs-closed8``
(organisation-layered prompts, 4 organisations on 4 replicas, 8 clients);
Any other family of the suite runs by its own name, on its own number of
replicas (``chat-closed32`` on 8), so the real peers can be set beside kvgate
on families nothing was tuned on. An open-loop family keeps its Poisson
arrivals, rescaled to its own load on these replicas' timing (``at_load``);
``--requests`` sets its length, and ``--concurrency`` (default 64) caps the
requests outstanding, so set it above what the slowest router queues:

    python -m bench.routing_e2e --workloads layered-8orgs-closed8 layered-16orgs-closed8 --seeds 2 3 \
        --policies round_robin least_load prefix_affinity ttft smg:cache_aware vllm-router:cache_aware

``--seeds`` picks the draws, each a run of its own (``family/sN`` in the
table). ``--clients N`` (and ``--burst ON OFF``) replays
any workload closed loop instead. Besides hit ratio (the replicas' counters
and ``cached_tokens``), TTFT p50 and p95, the table shows max/mean
per-replica request counts over the run (each replica's own count of the
requests it served), for kvgate and the peers alike.

Pools under pressure: every replica's KV pool (``vllm_sim --kv-blocks``) is
sized from each workload as in the simulated benchmarks
(``bench.pools.pool_size``: the fleet's pools hold ``--pool-ratio``, default
2, times the reused working set, floored so a replica can run its share of
the largest requests, their output capped at the ``max_tokens`` this client
sends); the replicas are restarted at that size before the workload's first
policy, kvgate's and the peers' alike. ``--kv-tokens`` or ``--kv-blocks``
overrides it. The working set is counted on the workload's own token ids:
with ``--precise`` the replicas tokenize with MiniLM instead, so it is an
estimate there.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import orjson

from bench.chaos_fleet import (
    RedisProc, Sim, _kill, free_port, kvgate_config, metric_sum, parse_metrics, start_kvgate, start_sims)
from bench.pools import DEFAULT_RATIO, PoolSize, pool_size
from bench.precise_fleet import PRECISE, precise_routing, replica_entries, start_event_sims, tokenizer_dir
from bench.routing import calibrate, ideal_hit_ratio
from bench.routing_replay import Usage, replay, summarise
from bench.routing_sim import SimSettings
from bench.smg import SMG_POLICIES, smg_binary, start_smg
from bench.vllm_router import VLLM_ROUTER_POLICIES, start_vllm_router, vllm_router_binary
from bench.workloads import ClosedLoop, Request, Workload
from bench.workloads.generated import FAMILIES, Family
from gateway.proxy.pool import parse_vllm_metrics
from gateway.routing_sync import STREAM
from vllm_sim.timing import TimingModel

ROOT = Path(__file__).resolve().parent.parent
BLOCK_SIZE = 16  # vllm_sim's default --block-size, which the replicas run with
POLICIES = ["round_robin", "least_load", "consistent_hash", "prefix_affinity", "ttft",
            *(f"smg:{p}" for p in SMG_POLICIES), *(f"vllm-router:{p}" for p in VLLM_ROUTER_POLICIES)]
PEERS = {"smg": (start_smg, smg_binary), "vllm-router": (start_vllm_router, vllm_router_binary)}
WORKLOADS = ["shared_prefix", "mtbench", "unique", "heavy_orgs", "heavy_orgs_burst", "orgs_layered"]
GENERATED = {"heavy_orgs": "heavy4-closed8", "heavy_orgs_burst": "heavy4-burst16",
             "orgs_layered": "layered-4orgs-closed8"}
# The client caps every request's max_tokens at this (replicas decode fast, the run stays short).
MAX_TOKENS = 32
# The replicas' timing and seats (their pools are sized per workload: ``workload_pool``).
SIM_FLAGS = {"prefill_s_per_token": 0.00005, "decode_base_s": 0.005, "max_num_seqs": 16}


def family_of(name: str) -> Family | None:
    """The generated suite's family a workload name stands for (an alias above or a family's own name)."""
    return next((f for f in FAMILIES if f.name == GENERATED.get(name, name)), None)


def replicas_for(name: str) -> int:
    """The replicas a workload runs on: a generated family's own, else 4 (the routing benchmark's fleet)."""
    family = family_of(name)
    return family.replicas if family is not None else 4


def build(name: str, args: argparse.Namespace, seed: int = 1) -> Workload:
    family = family_of(name)
    if family is not None:
        from bench.workloads.generated import build as generated

        workload = generated(family, seed, args.requests)
        if family.closed_loop is None:
            at_load(workload, family.replicas, family.load)
        return workload
    if name == "shared_prefix":
        from bench.workloads.shared_prefix import build as shared

        return shared(groups=16, per_group=max(1, args.requests // 16), system_tokens=1024, question_tokens=64,
                      output_tokens=16, rate=args.rate)
    if name == "unique":
        from bench.workloads.unique import build as unique

        return unique(n_requests=args.requests, rate=args.rate)
    from bench.workloads.mtbench import build as mtbench

    return mtbench(Path(args.data), rate=args.rate / 4, think_s=0.5, limit=args.requests // 3)


def at_load(workload: Workload, replicas: int, load: float) -> float:
    """Rescale an open-loop family's arrivals to ``load`` of these replicas, as the suite does for its own.

    ``bench.routing.calibrate`` (engine work at the ideal hit ratio keeps ``load`` of the fleet
    busy) on the timing the replicas here run with (``SIM_FLAGS``), each answer capped at the
    ``MAX_TOKENS`` this client asks for: the same load as in the suite, on faster replicas and
    shorter answers. Returns the arrival rate (requests per second)."""
    capped = Workload(workload.name, [replace(r, output_tokens=min(r.output_tokens, MAX_TOKENS))
                                      for r in workload.requests], workload.description)
    rate = calibrate(capped, ideal_hit_ratio(workload), SimSettings(replicas=replicas, timing=TimingModel(**SIM_FLAGS)),
                     load)
    for r, c in zip(workload.requests, capped.requests):
        r.arrival = c.arrival
    return rate


SHARED = "prefix_affinity+shared"
# ttft's instances sharing block facts through the Redis (routing.share_index; routing.gossip).
TTFT_SHARED = "ttft+shared"
# ttft in precise mode (token ids and KV events, with --precise), alone or sharing block facts.
TTFT_PRECISE = "ttft precise"
TTFT_PRECISE_SHARED = "ttft precise+shared"
# The rows that read the replicas' KV events; each row whose instances can share facts (a Redis),
# and its twin that does (added with --instances N).
PRECISE_ROWS = (PRECISE, TTFT_PRECISE, TTFT_PRECISE_SHARED)
SHARED_TWINS = {"prefix_affinity": SHARED, "ttft": TTFT_SHARED, TTFT_PRECISE: TTFT_PRECISE_SHARED}
SHARED_ROWS = tuple(SHARED_TWINS.values())


def request_body(req: Request, model: str) -> dict[str, Any]:
    """The body this benchmark streams for ``req``: usage included, ``max_tokens`` capped at ``MAX_TOKENS``."""
    body = {**req.body(), "model": model, "stream": True, "stream_options": {"include_usage": True}}
    body["max_tokens"] = max(1, min(int(body.get("max_tokens") or req.output_tokens or 16), MAX_TOKENS))
    return body


def request_path(req: Request) -> str:
    return "/v1/chat/completions" if req.endpoint == "chat" else "/v1/completions"


async def stream_request(client: httpx.AsyncClient, url: str, req: Request, body: dict[str, Any]) -> Usage:
    """POST ``body`` (streamed) to ``url``; time to first event, gaps between text chunks, the text, usage."""
    t0 = time.perf_counter()
    ttft = last = None
    itls: list[float] = []
    text: list[str] = []
    usage: dict[str, Any] = {}
    async with client.stream("POST", url + request_path(req), content=orjson.dumps(body),
                             headers={"content-type": "application/json", **req.headers}) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"status {resp.status_code}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            if ttft is None:
                ttft = now - t0
            obj = orjson.loads(line[6:])
            if obj.get("error"):
                raise RuntimeError(f"error event: {obj['error']}")
            if obj.get("usage"):
                usage = obj["usage"]
            piece = "".join(str((c.get("delta") or {}).get("content") or c.get("text") or "")
                            for c in obj.get("choices") or () if c.get("index", 0) == 0)
            if piece:
                if last is not None:
                    itls.append(now - last)
                last = now
                text.append(piece)
    details = usage.get("prompt_tokens_details") or {}
    return Usage(int(usage.get("prompt_tokens", 0)), details.get("cached_tokens"), ttft, itls, "".join(text))


async def _send_factory(gws: list[Any], model: str, seed: int = 7) -> Any:
    client = httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=256))
    pick = random.Random(seed)

    async def send(req: Request) -> Usage:
        gw = gws[pick.randrange(len(gws))]  # a Service spreads clients over the instances
        return await stream_request(client, gw.url, req, request_body(req, model))

    return client, send


def fleet_ratio(urls: list[str]) -> float:
    """The replicas' prefix-cache hit ratio, from their own ``vllm:prefix_cache_*`` counters."""
    hits = queries = 0.0
    for url in urls:
        m = parse_vllm_metrics(httpx.get(url + "/metrics", timeout=5).text)
        hits += m.get("prefix_hits", 0.0)
        queries += m.get("prefix_queries", 0.0)
    return hits / queries if queries else 0.0


def workload_pool(workload: Workload, args: argparse.Namespace) -> PoolSize:
    """Each replica's KV pool for ``workload`` (``bench.pools.pool_size``; ``--kv-tokens``/``--kv-blocks`` override)."""
    loop = ClosedLoop.of(args.clients, args.burst) or workload.closed_loop
    override = args.kv_tokens or args.kv_blocks * BLOCK_SIZE
    return pool_size(workload, args.replicas, args.pool_ratio, clients=loop.clients if loop else 0,
                     kv_tokens=override, block_size=BLOCK_SIZE, max_output=MAX_TOKENS)


def resize(sims: list[Sim], blocks: int) -> None:
    """Restart the replicas whose pool is not ``blocks`` blocks with that pool (same ports), in parallel."""
    stale = [s for s in sims if s.flags.get("kv_blocks") != blocks]
    for s in stale:
        s.flags["kv_blocks"] = blocks
    if stale:
        with ThreadPoolExecutor(len(stale)) as pool:
            list(pool.map(Sim.restart, stale))


def reset(sims: list[Any]) -> None:
    """A cold fleet for every policy: KV pools and counters cleared."""
    for s in sims:
        httpx.post(s.url + "/sim/reset", timeout=5).raise_for_status()


def request_counts(sims: list[Any]) -> list[int]:
    """Requests each replica's engine took since the last reset (its own count)."""
    return [int(httpx.get(s.url + "/sim/stats", timeout=5).json()["engine_requests"]) for s in sims]


def max_over_mean(counts: list[int]) -> float:
    mean = sum(counts) / len(counts) if counts else 0.0
    return max(counts) / mean if mean else float("nan")


def _start_gateways(policy: str, sims: list[Any], workdir: Path, args: argparse.Namespace,
                    redis_url: str | None, gws: list[Any]) -> None:
    """Start ``args.instances`` gateways into ``gws`` (the caller kills whatever started, on failure too)."""
    peer, _, peer_policy = policy.partition(":")
    if peer in PEERS:
        for _ in range(args.instances):
            gws.append(PEERS[peer][0](peer_policy, [s.url for s in sims], workdir))
        return
    routing: dict[str, Any] = {"policy": policy.partition("+")[0].partition(" ")[0]}
    extra: dict[str, Any] = {}
    if policy in PRECISE_ROWS:
        routing = precise_routing(args.tokenizer, policy=routing["policy"])
        extra = {"replicas": replica_entries(sims)}
    if policy in SHARED_ROWS:
        routing["share_index"] = True
        extra["redis_url"] = redis_url
    for i in range(args.instances):
        cfg = kvgate_config(free_port(), sims, routing=routing,
                            pool={"health_interval_s": 1.0, "metrics_interval_s": 1.0}, **extra)
        (workdir / str(i)).mkdir(exist_ok=True)
        gws.append(start_kvgate(workdir / str(i), cfg))
    if policy in PRECISE_ROWS:
        for gw in gws:
            _wait_precise(gw.url, len(sims))


def _wait_precise(url: str, replicas: int, timeout: float = 60.0) -> None:
    """Until this instance routes every replica on its events (subscribed and synced through replay)."""
    deadline = time.monotonic() + timeout
    while True:
        metrics = parse_metrics(httpx.get(url + "/metrics", timeout=5).text)
        if metric_sum(metrics, "kvgate_kv_events_precise") >= replicas:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}: not every replica precise after {timeout} s")
        time.sleep(0.1)


async def run_policy(policy: str, workload: Workload, sims: list[Any], workdir: Path,
                     args: argparse.Namespace, redis_url: str | None = None) -> dict[str, Any]:
    gws: list[Any] = []
    try:
        _start_gateways(policy, sims, workdir, args, redis_url, gws)
        client, send = await _send_factory(gws, "sim-model")
        t0 = time.perf_counter()
        results = await replay(workload, send, speed=args.speed, max_concurrency=args.concurrency,
                               closed_loop=ClosedLoop.of(args.clients, args.burst))
        wall = time.perf_counter() - t0
        await client.aclose()
        summary: dict[str, Any] = dict(summarise(results))
        counts = request_counts(sims)
        summary.update(policy=policy, fleet_hit_ratio=fleet_ratio([s.url for s in sims]), wall_s=wall,
                       requests_per_replica=counts, max_over_mean_requests=max_over_mean(counts))
        if redis_url and policy in SHARED_ROWS:
            summary["facts_stream"] = facts_stream(redis_url)
        return summary
    finally:
        for gw in gws:
            _kill(gw.proc)


HEADER = (f"{'workload':<32}{'policy':<28}{'fleet hit (replica /metrics)':>30}{'hit (cached_tokens)':>21}"
          f"{'ttft p50':>10}{'ttft p95':>10}{'req max/mean':>14}  {'requests per replica':<22}{'errors':>7}")


def facts_stream(url: str) -> dict[str, int]:
    """What the routing facts keep in the Redis (``gateway.routing_sync``: a capped stream per fleet),
    read at the end of a run; the streams are deleted after, so the next row starts empty."""
    import redis

    r = redis.Redis.from_url(url)
    try:
        keys = list(r.scan_iter(match=f"{STREAM}*"))
        out = {"entries": sum(int(r.xlen(k)) for k in keys),
               "bytes": sum(int(r.memory_usage(k, samples=0) or 0) for k in keys)}
        if keys:
            r.delete(*keys)
        return out
    finally:
        r.close()


def _row(name: str, r: dict[str, Any]) -> str:
    counts = "/".join(str(c) for c in r["requests_per_replica"])
    return (f"{name:<32}{r['policy']:<28}{r['fleet_hit_ratio']:>30.3f}{r['hit_ratio']:>21.3f}"
            f"{r['ttft_p50_s'] * 1000:>8.0f}ms{r['ttft_p95_s'] * 1000:>8.0f}ms{r['max_over_mean_requests']:>14.2f}"
            f"  {counts:<22}{r['errors']:>7}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=str(ROOT.parent / "shared" / "data"))
    p.add_argument("--workloads", nargs="+", default=["shared_prefix", "mtbench"],
                   choices=WORKLOADS + [f.name for f in FAMILIES],
                   help="the names above, or any family of the generated suite (bench.routing_suite)")
    p.add_argument("--policies", nargs="+", default=POLICIES)
    p.add_argument("--seeds", "--seed", dest="seeds", type=int, nargs="+", default=[1],
                   help="the draws of the generated workloads (each a run of its own; the others ignore it)")
    p.add_argument("--clients", type=int, default=0,
                   help="replay closed loop: this many clients, each sending its next request when the last completes")
    p.add_argument("--burst", type=float, nargs=2, metavar=("ON_S", "OFF_S"), default=None,
                   help="with --clients: send only during ON_S of every ON_S + OFF_S seconds")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out", help="routing_e2e.json goes here")
    p.add_argument("--replicas", type=int, default=0,
                   help="replicas (default: a generated family's own, else 4; one count for every workload of a run)")
    p.add_argument("--requests", type=int, default=320)
    p.add_argument("--rate", type=float, default=40.0, help="arrivals per second (before --speed)")
    p.add_argument("--speed", type=float, default=1.0)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--pool-ratio", type=float, default=DEFAULT_RATIO,
                   help="the fleet's KV pools hold this many times the reused working set (meant for 1.5-3)")
    p.add_argument("--kv-tokens", type=int, default=0, help="KV pool per replica in tokens (overrides --pool-ratio)")
    p.add_argument("--kv-blocks", type=int, default=0,
                   help="KV pool per replica in 16-token blocks (overrides --pool-ratio; --kv-tokens wins)")
    p.add_argument("--instances", type=int, default=1, help="kvgate processes (requests spread at random)")
    p.add_argument("--redis-url", default=None,
                   help=f"Redis for {', '.join(SHARED_ROWS)} (default: a private redis-server)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="each replica's token budget a step (vLLM's flag, 2048 by default on most GPUs): "
                        "long prompts chunked over steps; default: whole prompts, as the published runs")
    p.add_argument("--precise", action="store_true",
                   help=f"replicas with a real tokenizer and KV events, and a '{PRECISE}' row beside 'prefix_affinity'")
    args = p.parse_args(argv)
    counts = {replicas_for(w) for w in args.workloads}
    if not args.replicas and len(counts) > 1:
        p.error(f"these workloads run on different fleets ({sorted(counts)} replicas): run them separately")
    args.replicas = args.replicas or counts.pop()
    if args.precise:
        args.policies += [x for x in ("prefix_affinity", PRECISE) if x not in args.policies]
    elif set(PRECISE_ROWS) & set(args.policies):
        p.error(f"the rows {', '.join(PRECISE_ROWS)} need --precise (replicas that publish KV events)")
    for peer, (_, binary) in PEERS.items():
        if binary() is None and any(x.startswith(peer + ":") for x in args.policies):
            print(f"{peer} not installed (pip install {peer}, the bench extra): its rows are left out", flush=True)
            args.policies = [x for x in args.policies if not x.startswith(peer + ":")]
    redis: RedisProc | None = None
    for plain, shared in SHARED_TWINS.items():
        if args.instances > 1 and plain in args.policies and shared not in args.policies:
            args.policies.append(shared)
    if set(SHARED_ROWS) & set(args.policies) and args.redis_url is None:
        redis = RedisProc().start()
        args.redis_url = redis.url
    # One run per generated workload and seed ("family/sN"); the others once.
    workloads = {(f"{name}/s{seed}" if family_of(name) else name): build(name, args, seed)
                 for name in args.workloads for seed in (args.seeds if family_of(name) else args.seeds[:1])}
    pools = {name: workload_pool(w, args) for name, w in workloads.items()}
    flags = {"kv_blocks": next(iter(pools.values())).blocks, **SIM_FLAGS}
    if args.max_num_batched_tokens:
        flags["max_num_batched_tokens"] = args.max_num_batched_tokens
    names = [f"r{i + 1}" for i in range(args.replicas)]
    args.tokenizer = tokenizer_dir() if args.precise else None
    sims = start_event_sims(names, flags, args.tokenizer) if args.precise else start_sims(names, flags)
    workdir = Path(tempfile.mkdtemp(prefix="kvgate-route-e2e-"))
    out: list[dict[str, Any]] = []
    try:
        for name, workload in workloads.items():
            pool = pools[name]
            resize(sims, pool.blocks)
            print(f"\n{name}: {pool.describe()}\n{HEADER}", flush=True)
            for policy in args.policies:
                reset(sims)
                r = asyncio.run(run_policy(policy, workload, sims, workdir, args, args.redis_url))
                print(_row(name, r), flush=True)
                if "facts_stream" in r:
                    print(f"{'':<32}{'':<28}routing facts in Redis at the end: {r['facts_stream']['entries']} "
                          f"entries, {r['facts_stream']['bytes'] / 1e6:.1f} MB", flush=True)
                out.append({"workload": name, "description": workload.description, "pool_tokens": pool.kv_tokens,
                            "working_set_tokens": pool.working_set, **r})
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "routing_e2e.json").write_text(json.dumps(out, indent=1))
    finally:
        for s in sims:
            s.kill()
        if redis is not None:
            redis.kill()
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
