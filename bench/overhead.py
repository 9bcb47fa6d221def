"""kvgate's own overhead: the same load sent directly to a fast upstream and through kvgate.

Side by side in one run. The upstream is a canned vLLM-shaped server that does
no work (``bench.fast_upstream``), so every microsecond of difference is the
gateway's. Upstream, each kvgate and this load generator run in their own
processes; every kvgate compared is started before the first measurement and
they are measured in turn, cell by cell.

    python -m bench.overhead                 # concurrency 1, 32, 256; unary and streaming; 5 s per cell
    python -m bench.overhead --duration 10 --concurrency 1 64
    python -m bench.overhead --workers 1 2   # requests/s at concurrency 256, one kvgate worker and two
    python -m bench.overhead --endpoints chat responses --modes stream
                                             # the Responses API's stream beside chat's, same 8 tokens
    python -m bench.overhead --endpoints chat messages --modes stream
                                             # Anthropic's Messages stream beside chat's, same 8 tokens
    python -m bench.overhead --policy round_robin prefix_affinity --prompt-tokens 4096 --repeat 3
                                             # what routing adds, per policy, at concurrency 1:
                                             # a 200-word and a ~4K-token system prompt, a short user turn
    python -m bench.overhead --policy round_robin prefix_affinity --prompt-tokens 4096 --repeat 3 --pin
                                             # the same with kvgate on a core of its own (see --pin)
    python -m bench.overhead --policy round_robin prefix_affinity --prompt-tokens 4096 --repeat 3 --pin --interpreted
                                             # and beside them prefix_affinity with routing interpreted
    python -m bench.overhead --policy round_robin ttft ttft+redis --prompt-tokens 4096 --repeat 3 --pin
                                             # ttft given a redis_url (--redis-url, else a private
                                             # redis-server): its routing facts published, by default

Each kvgate routes over ``--replicas`` replicas (default 4, names on the one
upstream), so a policy has a choice to make. ``--repeat R`` measures every
cell R times, rotating over the targets, and prints the median of each figure.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson

from bench.loadgen import build_request, percentile, run_load

ROOT = Path(__file__).resolve().parent.parent
_TURNS = 256  # distinct user turns per prompt case
_ADMIN_TOKEN = "overhead-bench-admin"
# A policy named with this suffix runs with a redis_url (``--redis-url``, else a private redis-server).
REDIS = "+redis"
_TOKENS_PER_WORD = 1.28  # system_prompt's words, measured with MiniLM's WordPiece tokenizer


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_http(url: str, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(url)


@dataclass(frozen=True)
class Target:
    """Where a cell's load goes: the upstream itself, or a kvgate with this policy and workers."""

    label: str
    port: int
    policy: str | None = None
    workers: int = 1
    interpreted: bool = False  # routing from source, not compiled (routing._native)
    admin_port: int = 0  # its admin API, read for what routing cost inside it (GET /admin/routing)
    redis_url: str | None = None  # policy "X+redis": X with this redis_url (ttft shares its facts through it)


def start_upstream(port: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    up = subprocess.Popen([sys.executable, "-m", "bench.fast_upstream", "--port", str(port)], env=env)
    _wait_http(f"http://127.0.0.1:{port}/health")
    return up


def start_gateway(target: Target, upstream_port: int, replicas: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KVGATE_INTERPRETED": "1" if target.interpreted else ""}
    cfg = Path(tempfile.mkdtemp()) / "kvgate.yaml"
    names = ["fast"] if replicas == 1 else [f"fast{i}" for i in range(replicas)]
    fleet = ", ".join(f"{{name: {n}, url: 'http://127.0.0.1:{upstream_port}', models: [sim-model]}}" for n in names)
    routing = f"routing: {{policy: {target.policy.removesuffix(REDIS)}}}\n" if target.policy else ""
    if target.redis_url:
        routing += f"redis_url: '{target.redis_url}'\n"
    admin = (f"admin: {{port: {target.admin_port}, token: {_ADMIN_TOKEN}}}\n" if target.admin_port
             else "admin: {enabled: false}\n")
    cfg.write_text(f"listen: {{host: 127.0.0.1, port: {target.port}}}\n{admin}"
                   f"replicas: [{fleet}]\n{routing}workers: {target.workers}\nlog_level: warning\n")
    gw = subprocess.Popen([sys.executable, "-m", "gateway.server.cli", "serve", "--config", str(cfg)], env=env)
    _wait_http(f"http://127.0.0.1:{target.port}/readyz")
    if target.workers > 1:
        _wait_workers(target.port, target.workers)
    return gw


def _wait_workers(port: int, workers: int, timeout: float = 90.0) -> None:
    """Until every worker answers on the port (a fresh connection each time)."""
    seen: set[str] = set()
    deadline = time.monotonic() + timeout
    while len(seen) < workers:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only workers {sorted(seen)} answered")
        r = httpx.get(f"http://127.0.0.1:{port}/healthz", headers={"connection": "close"}, timeout=2)
        seen.add(r.headers.get("x-kvgate-worker", "0"))


# -- prompts ---------------------------------------------------------------------------
_WORDS = ("account order refund shipping customer policy support warranty invoice payment product "
          "delivery return exchange tracking billing subscription plan upgrade discount coupon store "
          "item price tax region address contact agent escalate verify identity secure privacy data "
          "request response answer question issue ticket priority urgent standard business hours "
          "weekend holiday team manager review approve decline reason note summary detail step").split()
_TOPICS = ("Refunds", "Shipping", "Accounts", "Billing", "Privacy", "Escalation", "Tone", "Products",
           "Returns", "Security", "Subscriptions", "Tickets")


def system_prompt(words: int, seed: int = 7) -> str:
    """A support assistant's instructions: sections of rules, ``words`` words in all. Measured
    with a WordPiece tokenizer (MiniLM's), it is 1.28 tokens a word: 3,200 words, 4,089 tokens."""
    rng = random.Random(seed)
    out = ["You are the customer support assistant of Example Store. Follow these rules."]
    count = len(out[0].split())
    section = 0
    while count < words:
        if count == len(out[0].split()) or rng.random() < 0.08:
            out.append(f"\n## {_TOPICS[section % len(_TOPICS)]}\n")
            section += 1
        sentence = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(8, 18)))
        out.append(f"- Always {sentence}.")
        count += len(sentence.split()) + 1
    return "\n".join(out)


def prompt_cases(args: argparse.Namespace) -> dict[str, list[bytes] | None]:
    """Name -> chat bodies (None: today's one-line 'hello there', the same every request)."""
    cases: dict[str, list[bytes] | None] = {}
    if not args.policy:
        cases["hello"] = None
    if args.policy or args.system_words:
        cases[f"{args.system_words or 200}-word system prompt"] = _chats(args.system_words or 200)
    for tokens in args.prompt_tokens:
        cases[f"{tokens}-token system prompt"] = _chats(round(tokens / _TOKENS_PER_WORD))
    return cases


def _chats(words: int) -> list[bytes]:
    system = system_prompt(words)
    return [orjson.dumps({"model": "sim-model", "max_tokens": 16, "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": f"Hello, my order number {1000 + i} has not arrived yet. What can I do?"}]})
        for i in range(_TURNS)]


# -- measuring -------------------------------------------------------------------------
def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process and its children (a supervisor's workers), from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if stat.parent.name == str(pid) or fields[1] == str(pid):  # fields[1]: the parent's pid
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def _as_responses(body: bytes) -> bytes:
    """The chat body's request as the Responses API's: system -> instructions, user -> input."""
    chat = orjson.loads(body)
    out = {"model": chat["model"], "max_output_tokens": chat["max_tokens"]}
    for m in chat["messages"]:
        out["instructions" if m["role"] == "system" else "input"] = m["content"]
    return orjson.dumps(out)


def _as_messages(body: bytes) -> bytes:
    """The chat body's request as Anthropic's Messages API: system -> system, the rest as messages."""
    chat = orjson.loads(body)
    out = {"model": chat["model"], "max_tokens": chat["max_tokens"],
           "messages": [m for m in chat["messages"] if m["role"] != "system"]}
    out.update(("system", m["content"]) for m in chat["messages"] if m["role"] == "system")
    return orjson.dumps(out)


# Endpoint -> (path, how a chat body becomes its request).
ENDPOINTS = {"chat": ("/v1/chat/completions", None), "responses": ("/v1/responses", _as_responses),
             "messages": ("/v1/messages", _as_messages)}


async def measure(port: int, bodies: list[bytes] | None, stream: bool, concurrency: int,
                  duration: float, pid: int | None = None, endpoint: str = "chat") -> dict[str, float]:
    if bodies is None:
        bodies = [orjson.dumps({"model": "sim-model", "messages": [{"role": "user", "content": "hello there"}],
                                "max_tokens": 16})]
    path, convert = ENDPOINTS[endpoint]
    if convert is not None:
        bodies = [convert(b) for b in bodies]
    if stream:
        bodies = [b[:-1] + b',"stream":true}' for b in bodies]
    raws = [build_request("127.0.0.1", port, path, b) for b in bodies]
    cpu: list[float] = []
    clock = (lambda: cpu.append(cpu_seconds(pid))) if pid is not None else None
    result, seconds = await run_load("127.0.0.1", port, raws, concurrency=concurrency, duration_s=duration,
                                     on_measure=clock)
    ok = result.statuses.get(200, 0)
    used = cpu_seconds(pid) - cpu[0] if pid is not None and cpu else float("nan")
    return {"p50": percentile(result.latencies, 50) * 1000, "p99": percentile(result.latencies, 99) * 1000,
            "rps": ok / seconds, "cpu_us": used / ok * 1e6 if ok else float("nan"),
            "errors": result.errors + sum(v for k, v in result.statuses.items() if k != 200)}


def _median(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]} | {"errors": sum(r["errors"] for r in runs)}


def run_cells(args: argparse.Namespace, targets: list[Target], pids: dict[str, int]) -> None:
    cases = prompt_cases(args)
    modes = args.modes or (["unary"] if args.policy else ["unary", "stream"])
    header = True
    for case, bodies in cases.items():
        for mode in modes:
            for c in args.concurrency:
                for endpoint in args.endpoints:
                    runs: dict[str, list[dict[str, float]]] = {t.label: [] for t in targets}
                    for _ in range(args.repeat):
                        for t in targets:
                            run = asyncio.run(measure(t.port, bodies, mode == "stream", c,
                                                      args.duration, pids.get(t.label), endpoint))
                            runs[t.label].append(run | _decision_cost(t))
                    cells = {label: _median(r) for label, r in runs.items()}
                    label = case if args.endpoints == ["chat"] else f"{case} · {endpoint}"
                    _print_cells(label, mode, c, cells, header)
                    header = False


def _decision_cost(target: Target) -> dict[str, float]:
    """What prefer + observe cost inside the kvgate over its last 1,024 requests (its own timing)."""
    if not target.admin_port:
        return {}
    got = httpx.get(f"http://127.0.0.1:{target.admin_port}/admin/routing",
                    headers={"authorization": f"Bearer {_ADMIN_TOKEN}"}, timeout=10).json()["decision_cost"]
    return {"route_p50": got["p50_us"] or 0.0, "route_p99": got["p99_us"] or 0.0}


def _print_cells(case: str, mode: str, c: int, cells: dict[str, dict[str, float]], header: bool) -> None:
    if header:
        print(f"{'prompt':<26}{'mode':<7}{'conc':>5}  {'target':<34}{'p50 ms':>9}{'p99 ms':>9}{'req/s':>8}"
              f" | {'added p50':>9}{'added p99':>10}{'rps ratio':>10} | {'CPU µs/req':>10}{'errors':>7}")
        print("-" * 143)
    d = cells["direct"]
    for label, v in cells.items():
        added = "" if label == "direct" else (f"{v['p50'] - d['p50']:>9.3f} {v['p99'] - d['p99']:>9.3f}"
                                              f"{v['rps'] / d['rps'] if d['rps'] else 0:>10.2f}")
        cpu = "" if label == "direct" else f"{v['cpu_us']:>10.0f}"
        print(f"{case:<26}{mode:<7}{c:>5}  {label:<34}{v['p50']:>9.3f}{v['p99']:>9.3f}{v['rps']:>8.0f} | "
              f"{added:<29} | {cpu:>10}{int(v['errors']):>7}", flush=True)
    for label, v in cells.items():
        if "route_p50" in v:
            print(f"{'':<38}{label}: routing (prefer + observe) inside it p50 {v['route_p50']:.1f} µs, "
                  f"p99 {v['route_p99']:.1f} µs")
    base = next((v for label, v in cells.items() if "round_robin" in label), None)
    for label, v in cells.items():
        if base is not None and label != "direct" and "round_robin" not in label:
            print(f"{'':<38}{label} over round_robin: p50 {v['p50'] - base['p50']:+.3f} ms, "
                  f"p99 {v['p99'] - base['p99']:+.3f} ms", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, nargs="+")
    p.add_argument("--duration", type=float, default=5.0, help="seconds measured per cell")
    p.add_argument("--workers", type=int, nargs="+", default=[1], help="kvgate worker processes, one kvgate each")
    p.add_argument("--policy", nargs="+", help="routing policies, one kvgate each (default: the config default)")
    p.add_argument("--prompt-tokens", type=int, nargs="*", default=[], help="add a system prompt of about N tokens")
    p.add_argument("--system-words", type=int, help="the words of the short system prompt case (200)")
    p.add_argument("--modes", nargs="+", choices=["unary", "stream"])
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--redis-url", default=None, help=f"the Redis of policies named X{REDIS} (default: a private one)")
    p.add_argument("--endpoints", nargs="+", choices=sorted(ENDPOINTS), default=["chat"],
                   help="routes measured side by side, each cell in turn")
    p.add_argument("--repeat", type=int, default=1, help="measure each cell this often; print medians")
    p.add_argument("--interpreted", action="store_true",
                   help="also each policy with routing interpreted (KVGATE_INTERPRETED=1), beside the compiled build")
    p.add_argument("--pin", action="store_true",
                   help="kvgate on the last core, the upstream and this load generator on the others: on loopback "
                        "a write wakes its reader, and on a shared core the writer waits inside write() for it")
    args = p.parse_args(argv)
    if args.concurrency is None:
        args.concurrency = [1] if args.policy else [256] if args.workers != [1] else [1, 32, 256]
    up_port = _free_port()
    targets = [Target("direct", up_port)]
    redis = None
    if any(x.endswith(REDIS) for x in args.policy or []) and not args.redis_url:
        from bench.chaos_fleet import RedisProc

        redis = RedisProc().start()
        args.redis_url = redis.url
    for policy in args.policy or [None]:
        for w in args.workers:
            name = f"kvgate {policy}" if policy else "kvgate"
            if args.workers != [1]:
                name += f", {w} worker{'s' * (w > 1)}"
            admin = _free_port() if policy else 0
            url = args.redis_url if policy and policy.endswith(REDIS) else None
            targets.append(Target(name, _free_port(), policy, w, admin_port=admin, redis_url=url))
            if args.interpreted and policy != "round_robin":
                targets.append(Target(f"{name}, interpreted", _free_port(), policy, w, interpreted=True,
                                      admin_port=_free_port(), redis_url=url))
    procs = [start_upstream(up_port)]
    try:
        gateways = {t.label: start_gateway(t, up_port, args.replicas) for t in targets[1:]}
        procs += gateways.values()
        if args.pin:
            _pin([p.pid for p in gateways.values()], procs[0].pid)
        run_cells(args, targets, {label: proc.pid for label, proc in gateways.items()})
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(30)
        if redis is not None:
            redis.kill()
    return 0


def _pin(gateway_pids: list[int], upstream_pid: int) -> None:
    """Each kvgate (all its threads) on the last core; the upstream and this process elsewhere."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        print("--pin: one core only, not pinned", file=sys.stderr)
        return
    for pid in gateway_pids:
        for tid in os.listdir(f"/proc/{pid}/task"):
            os.sched_setaffinity(int(tid), {cores[-1]})
    for tid in os.listdir(f"/proc/{upstream_pid}/task"):
        os.sched_setaffinity(int(tid), set(cores[:-1]))
    os.sched_setaffinity(0, set(cores[:-1]))


if __name__ == "__main__":
    raise SystemExit(main())
