"""kvgate's own overhead: the same load sent directly to a fast upstream and through kvgate.

Side by side in one run, at several concurrencies, streaming and not. The
upstream is a canned vLLM-shaped server that does no work (``bench.fast_upstream``),
so every microsecond of difference is the gateway's. Each of the three runs in
its own process: upstream, one kvgate worker, and this load generator.

    python -m bench.overhead                 # concurrency 1, 32, 256; 5 s per cell
    python -m bench.overhead --duration 10 --concurrency 1 64
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import orjson

from bench.loadgen import build_request, percentile, run_load

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_http(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(url)


def start_processes(upstream_port: int, gateway_port: int) -> list[subprocess.Popen[bytes]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    up = subprocess.Popen([sys.executable, "-m", "bench.fast_upstream", "--port", str(upstream_port)], env=env)
    _wait_http(f"http://127.0.0.1:{upstream_port}/health")
    cfg = Path(tempfile.mkdtemp()) / "kvgate.yaml"
    cfg.write_text(
        f"listen: {{host: 127.0.0.1, port: {gateway_port}}}\n"
        "admin: {enabled: false}\n"
        f"replicas: [{{name: fast, url: 'http://127.0.0.1:{upstream_port}', models: [sim-model]}}]\n"
        "log_level: warning\n"
    )
    gw = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--config", str(cfg)], env=env)
    _wait_http(f"http://127.0.0.1:{gateway_port}/readyz")
    return [up, gw]


async def measure(port: int, stream: bool, concurrency: int, duration: float) -> dict[str, float]:
    body = orjson.dumps({"model": "sim-model", "messages": [{"role": "user", "content": "hello there"}],
                         "max_tokens": 16, "stream": stream})
    raw = build_request("127.0.0.1", port, "/v1/chat/completions", body)
    result, seconds = await run_load("127.0.0.1", port, raw, concurrency=concurrency, duration_s=duration)
    ok = result.statuses.get(200, 0)
    return {"p50": percentile(result.latencies, 50) * 1000, "p99": percentile(result.latencies, 99) * 1000,
            "rps": ok / seconds, "errors": result.errors + sum(v for k, v in result.statuses.items() if k != 200)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32, 256])
    p.add_argument("--duration", type=float, default=5.0, help="seconds measured per cell")
    args = p.parse_args(argv)
    up_port, gw_port = _free_port(), _free_port()
    procs = start_processes(up_port, gw_port)
    rows = []
    try:
        for stream in (False, True):
            for c in args.concurrency:
                direct = asyncio.run(measure(up_port, stream, c, args.duration))
                via = asyncio.run(measure(gw_port, stream, c, args.duration))
                rows.append((stream, c, direct, via))
                _print_row(stream, c, direct, via, header=len(rows) == 1)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(10)
    return 0


def _print_row(stream: bool, c: int, d: dict[str, float], v: dict[str, float], header: bool) -> None:
    if header:
        print(f"{'mode':<10}{'conc':>5} | {'direct p50':>10}{'p99':>8}{'rps':>8} | {'kvgate p50':>10}{'p99':>8}"
              f"{'rps':>8} | {'added p50':>9}{'added p99':>10}{'rps ratio':>10}{'errors':>7}")
        print("-" * 118)
    mode = "stream" if stream else "unary"
    print(f"{mode:<10}{c:>5} | {d['p50']:>9.2f}m{d['p99']:>7.2f}m{d['rps']:>8.0f} | {v['p50']:>9.2f}m"
          f"{v['p99']:>7.2f}m{v['rps']:>8.0f} | {v['p50'] - d['p50']:>8.2f}m{v['p99'] - d['p99']:>9.2f}m"
          f"{v['rps'] / d['rps'] if d['rps'] else 0:>10.2f}{int(d['errors'] + v['errors']):>7}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
