"""What kvgate adds on the utility, pooling and audio routes, side by side with the replica alone.

One simulated replica (``vllm_sim``, time scale 0: it answers at once) and one
kvgate in front of it, each in its own process; this script sends the same
requests, one at a time on a kept-alive connection, to each in turn and prints
p50 / p99, what kvgate adds, and kvgate's CPU time per request (from /proc: the
steadiest figure on a busy machine), with a one-token chat request as the reference.
Then the cost of the one extra pass kvgate makes over an upload it has read
whole (find the fields, drop the forbidden ones:
``gateway.apis.utility.validate.audio_body``), per body size.

    python -m bench.utility_overhead                   # 300 requests a cell
    python -m bench.utility_overhead --requests 1000
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import httpx

from bench.loadgen import percentile
from bench.overhead import ROOT, Target, _free_port, _wait_http, cpu_seconds, start_gateway
from gateway.apis.utility.validate import audio_body
from vllm_sim.audio import synthetic_wav as wav

MODEL = "sim-model"


def cases() -> list[tuple[str, str, dict[str, Any]]]:
    """(label, path, httpx.post keyword arguments)."""
    docs = [f"Document {i} about shipping, refunds and the weather in spring." for i in range(8)]
    chat = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": docs[0]}]}
    return [
        ("chat, 1 token (reference)", "/v1/chat/completions", {"json": chat}),
        ("tokenize 40 tokens", "/tokenize", {"json": {"model": MODEL, "prompt": " ".join(docs[:2])}}),
        ("rerank 8 documents", "/rerank", {"json": {"model": MODEL, "query": "refunds", "documents": docs}}),
        ("classify", "/classify", {"json": {"model": MODEL, "input": docs[0]}}),
        ("transcription 2 s (64 KiB)", "/v1/audio/transcriptions",
         {"data": {"model": MODEL}, "files": {"file": ("a.wav", wav(2.0))}}),
        ("transcription 30 s (0.9 MiB)", "/v1/audio/transcriptions",
         {"data": {"model": MODEL}, "files": {"file": ("a.wav", wav(30.0))}}),
    ]


def measure(client: httpx.Client, url: str, kwargs: dict[str, Any], n: int,
            pid: int | None = None) -> tuple[float, float, float]:
    """p50 and p99 in ms, and the CPU µs per request of process ``pid`` (nan without one)."""
    for _ in range(min(20, n)):  # warm-up: connections, caches
        client.post(url, **kwargs).raise_for_status()
    lat = []
    cpu0 = cpu_seconds(pid) if pid is not None else 0.0
    for _ in range(n):
        t = time.perf_counter()
        client.post(url, **kwargs).raise_for_status()
        lat.append(time.perf_counter() - t)
    cpu = (cpu_seconds(pid) - cpu0) / n * 1e6 if pid is not None else float("nan")
    return percentile(lat, 50) * 1000, percentile(lat, 99) * 1000, cpu


def _form(audio: bytes, boundary: str, extra: str) -> bytes:
    return (f"--{boundary}\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\n{MODEL}\r\n{extra}"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n\r\n"
            ).encode() + audio + f"\r\n--{boundary}--\r\n".encode()


def _median_ms(body: bytes, ctype: str, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        audio_body(body, ctype)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def parse_cost(sizes_mib: list[float], repeat: int = 20) -> None:
    """``audio_body`` on a form as clients send it, and on one with a field kvgate must drop
    (``vllm_xargs``: the kept parts are joined into a new body, one copy of the upload)."""
    boundary = "----kvgatebench"
    ctype = f"multipart/form-data; boundary={boundary}"
    drop = f"--{boundary}\r\nContent-Disposition: form-data; name=\"vllm_xargs\"\r\n\r\n{{}}\r\n"
    print(f"\n{'upload':<12}{'fields found, ms':>18}{'MiB/s':>8}{'one field dropped, ms':>24}{'MiB/s':>8}")
    for mib in sizes_mib:
        audio = bytes(range(256)) * int(mib * 4096)
        kept = _median_ms(_form(audio, boundary, ""), ctype, repeat)
        dropped = _median_ms(_form(audio, boundary, drop), ctype, repeat)
        print(f"{f'{mib:g} MiB':<12}{kept:>18.3f}{mib / (kept / 1000):>8.0f}{dropped:>24.3f}"
              f"{mib / (dropped / 1000):>8.0f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=300, help="requests measured per cell")
    args = p.parse_args(argv)
    sim_port, gw_port = _free_port(), _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    sim = subprocess.Popen([sys.executable, "-m", "vllm_sim", "--port", str(sim_port), "--time-scale", "0"], env=env)
    procs = [sim]
    try:
        _wait_http(f"http://127.0.0.1:{sim_port}/health")
        gateway = start_gateway(Target("kvgate", gw_port), sim_port, replicas=1)
        procs.append(gateway)
        print(f"{'request':<30}{'target':<8}{'p50 ms':>9}{'p99 ms':>9} | {'added p50':>9}{'added p99':>10}"
              f" | {'kvgate CPU µs/req':>17}")
        print("-" * 98)
        with httpx.Client(timeout=30) as client:
            for label, path, kwargs in cases():
                d50, d99, _ = measure(client, f"http://127.0.0.1:{sim_port}{path}", kwargs, args.requests)
                k50, k99, cpu = measure(client, f"http://127.0.0.1:{gw_port}{path}", kwargs, args.requests,
                                        gateway.pid)
                print(f"{label:<30}{'direct':<8}{d50:>9.3f}{d99:>9.3f} |")
                print(f"{'':<30}{'kvgate':<8}{k50:>9.3f}{k99:>9.3f} | {k50 - d50:>9.3f}{k99 - d99:>10.3f}"
                      f" | {cpu:>17.0f}", flush=True)
        parse_cost([0.0625, 1, 10])
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
