"""Soak: many concurrent streaming clients through one kvgate worker for minutes; does anything grow?

Three vllm_sim processes with a fixed decode step (no batch slowdown, so the
replica's own inter-token time is a known constant) and one kvgate process
in front. First a short direct run sends the same load straight to the
replicas; then the same clients go through kvgate for ``--duration``. Every
few seconds the kvgate process's RSS (``/proc/PID/status`` VmRSS) and open
descriptors (``/proc/PID/fd``) are sampled.

Reported: requests, errors (any non-200, a stream without ``[DONE]``, or text
that is not the replica's deterministic answer), inter-token gaps seen by
clients direct vs. through kvgate (the difference at p99 is kvgate's added
inter-token latency), start / after-warm-up / peak / end RSS and fds, and
kvgate's CPU use (to tell its own saturation from a busy machine).
"Flat" means the end is within a margin of the level after warm-up (for
descriptors, 10% of the client count: the idle pool of upstream connections
keeps its high-water mark, which may still creep up after warm-up; a leak
grows with every request and blows through that margin).

    python -m bench.soak                          # 500 clients, 600 s (plus a 60 s direct run)
    python -m bench.soak --clients 100 --duration 60

Exits 1 on any error or on growth beyond ``--rss-margin-mb`` / ``--fd-margin``.
The client is a bare asyncio HTTP/1.1 reader, not httpx: at 500 streams on two
cores a general-purpose client would be the bottleneck being measured.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence
import orjson

from bench.chaos_check import Expected, expected_answer
from bench.chaos_fleet import HOST, MODEL, Fleet, free_port, kvgate_config, start_kvgate, start_sims

DEADLINE_S = 60.0  # one request; then it counts as an error


# -- latency histogram: fixed memory however long the run ---------------------------------------------
class Histogram:
    """0.1 ms bins up to 5 s, then one overflow bin."""

    RES = 1e-4
    BINS = 50_000

    def __init__(self) -> None:
        self.counts = [0] * (self.BINS + 1)
        self.n = 0

    def add(self, seconds: float) -> None:
        self.counts[min(self.BINS, max(0, int(seconds / self.RES)))] += 1
        self.n += 1

    def quantile_ms(self, q: float) -> float | None:
        if not self.n:
            return None
        target = q * (self.n - 1)
        seen = 0
        for i, c in enumerate(self.counts):
            seen += c
            if seen > target:
                return (i + 0.5) * self.RES * 1000
        return self.BINS * self.RES * 1000


@dataclass
class LoadStats:
    requests: int = 0
    errors: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)
    tokens: int = 0
    gaps: Histogram = field(default_factory=Histogram)
    ttft: Histogram = field(default_factory=Histogram)

    def error(self, kind: str) -> None:
        self.errors += 1
        self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1


# -- prompts --------------------------------------------------------------------------------------------
def make_prompts(count: int, max_tokens: int, seed: int = 0) -> list[tuple[bytes, Expected]]:
    """Request bodies (streaming) with their one right answer, computed once."""
    rng = random.Random(seed)
    words = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november".split()
    out = []
    for i in range(count):
        body = {"model": MODEL, "stream": True, "max_tokens": max_tokens,
                "messages": [{"role": "system", "content": "You are a soak-test assistant."},
                             {"role": "user", "content": f"Soak {seed}-{i}: " + " ".join(rng.sample(words, 6))}]}
        out.append((orjson.dumps(body), expected_answer(body)))
    return out


# -- the lean streaming client ------------------------------------------------------------------------
def _request(port: int, body: bytes) -> bytes:
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {HOST}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


async def _read_body_events(reader: asyncio.StreamReader, head: bytes) -> list[tuple[float, bytes]]:
    """(arrival time, data payload) of each SSE event of a chunked or sized response body."""
    events: list[tuple[float, bytes]] = []
    buf = b""
    chunked = b"transfer-encoding: chunked" in head.lower()
    if not chunked:
        lower = head.lower()
        i = lower.find(b"content-length:")
        size = int(lower[i + 15:lower.find(b"\r\n", i)]) if i >= 0 else 0
        return [(time.perf_counter(), await reader.readexactly(size))]
    while True:
        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
        data = await reader.readexactly(size + 2)
        if size == 0:
            return events
        now = time.perf_counter()
        buf += data[:-2]
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            if event.startswith(b"data: "):
                events.append((now, event[6:]))


def _check_stream(events: list[tuple[float, bytes]], exp: Expected, started: float, stats: LoadStats) -> None:
    text, times, done = [], [], False
    for t, data in events:
        if data == b"[DONE]":
            done = True
            continue
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            stats.error("malformed event")
            return
        if "error" in obj:
            stats.error("error event")
            return
        for choice in obj.get("choices") or ():
            piece = (choice.get("delta") or {}).get("content")
            if piece:
                text.append(piece)
                times.append(t)
    if not done:
        stats.error("no [DONE]")
    elif "".join(text) != exp.texts[0]:
        stats.error("wrong text")
    else:
        stats.requests += 1
        stats.tokens += len(times)
        if times:
            stats.ttft.add(times[0] - started)
        for a, b in zip(times, times[1:]):
            stats.gaps.add(b - a)


async def client(port: int, prompts: list[tuple[bytes, Expected]], offset: int, stop_at: float,
                 stats: LoadStats, delay_s: float) -> None:
    """One client: one keep-alive connection, streaming requests back to back until ``stop_at``."""
    await asyncio.sleep(delay_s)
    conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
    i = offset
    while time.monotonic() < stop_at:
        body, exp = prompts[i % len(prompts)]
        i += 1
        try:
            async with asyncio.timeout(DEADLINE_S):
                if conn is None:
                    conn = await asyncio.open_connection(HOST, port, limit=1 << 20)
                reader, writer = conn
                started = time.perf_counter()
                writer.write(_request(port, body))
                head = await reader.readuntil(b"\r\n\r\n")
                events = await _read_body_events(reader, head)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ValueError) as e:
            stats.error(type(e).__name__)
            _close(conn)
            conn = None
            continue
        if head[9:12] != b"200":
            stats.error(f"http {head[9:12].decode()}")
        else:
            _check_stream(events, exp, started, stats)
        if b"connection: close" in head.lower():
            _close(conn)
            conn = None
    _close(conn)


def _close(conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None) -> None:
    if conn is not None:
        conn[1].close()
    return None


async def run_clients(ports: list[int], prompts: list[tuple[bytes, Expected]], *, clients: int,
                      duration: float) -> LoadStats:
    """``clients`` concurrent streaming clients, client ``i`` on ``ports[i % len(ports)]``."""
    stats = LoadStats()
    ramp = min(1.0, duration / 10)  # staggered starts: not every stream on the same engine step
    stop_at = time.monotonic() + duration
    await asyncio.gather(*(client(ports[i % len(ports)], prompts, i * 7, stop_at, stats, ramp * i / clients)
                           for i in range(clients)))
    return stats


# -- process sampling -----------------------------------------------------------------------------------
_TICK = os.sysconf("SC_CLK_TCK")


def sample_process(pid: int) -> tuple[float, int, float]:
    """(RSS in MiB, open descriptors, CPU seconds used so far) of a live process."""
    rss_kb = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss_kb = int(line.split()[1])
                break
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    cpu_s = (int(fields[11]) + int(fields[12])) / _TICK  # utime + stime
    return rss_kb / 1024, len(os.listdir(f"/proc/{pid}/fd")), cpu_s


@dataclass
class Samples:
    points: list[tuple[float, float, int, float]] = field(default_factory=list)  # (t, rss MiB, fds, cpu s)

    def at_or_after(self, t: float) -> tuple[float, float, int, float]:
        return next((p for p in self.points if p[0] >= t), self.points[-1])


async def sample_every(pid: int, interval: float, stop: asyncio.Event, samples: Samples, t0: float) -> None:
    while not stop.is_set():
        samples.points.append((time.monotonic() - t0, *sample_process(pid)))
        try:
            await asyncio.wait_for(stop.wait(), interval)
        except TimeoutError:
            pass


# -- the run ----------------------------------------------------------------------------------------------
@dataclass
class SoakReport:
    clients: int
    duration: float
    decode_s: float
    direct: LoadStats | None
    direct_duration: float
    gateway: LoadStats
    samples: Samples
    idle: tuple[float, int, float]  # RSS, fds, CPU s before any load
    after: tuple[float, int, float]  # RSS, fds, CPU s once the clients are gone
    warm_t: float
    end_t: float

    @property
    def warm(self) -> tuple[float, float, int, float]:
        return self.samples.at_or_after(self.warm_t)

    @property
    def end(self) -> tuple[float, float, int, float]:
        return max((p for p in self.samples.points if p[0] <= self.end_t), key=lambda p: p[0])

    def growth(self) -> tuple[float, int]:
        return self.end[1] - self.warm[1], self.end[2] - self.warm[2]

    def cpu_percent(self) -> float | None:
        """kvgate's average CPU use between warm-up and end (100 = one core busy)."""
        (t0, _, _, c0), (t1, _, _, c1) = self.warm, self.end
        return 100 * (c1 - c0) / (t1 - t0) if t1 > t0 else None


async def soak(fleet: Fleet, *, clients: int, duration: float, direct_duration: float, decode_s: float,
               max_tokens: int, sample_s: float, warmup_s: float) -> SoakReport:
    prompts = make_prompts(512, max_tokens)
    pid = fleet.gateway.pid
    idle = sample_process(pid)
    direct = None
    if direct_duration > 0:
        direct = await run_clients([s.port for s in fleet.sims], prompts, clients=clients, duration=direct_duration)
    samples, stop = Samples(), asyncio.Event()
    t0 = time.monotonic()
    sampler = asyncio.create_task(sample_every(pid, sample_s, stop, samples, t0))
    stats = await run_clients([fleet.gateway.port], prompts, clients=clients, duration=duration)
    end_t = time.monotonic() - t0
    stop.set()
    await sampler
    samples.points.append((time.monotonic() - t0, *sample_process(pid)))
    after = sample_process(pid)
    return SoakReport(clients, duration, decode_s, direct, direct_duration, stats, samples, idle, after, warmup_s,
                      min(duration, end_t))


def start_soak_fleet(*, replicas: int, decode_s: float, clients: int) -> Fleet:
    # A fixed step (no per-sequence cost) and room for every client: the replica's own
    # inter-token time is then decode_s, whatever the batch.
    flags = {"decode_base_s": decode_s, "decode_s_per_seq": 0.0, "max_num_seqs": max(256, clients),
             "prefill_base_s": 0.002}
    sims = start_sims([f"s{i + 1}" for i in range(replicas)], flags)
    workdir = Path(tempfile.mkdtemp(prefix="kvgate-soak-"))
    try:
        gateway = start_kvgate(workdir, kvgate_config(free_port(), sims, routing={"policy": "least_load"}))
    except BaseException:
        for s in sims:
            s.kill()
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    return Fleet(sims, gateway, None, workdir)


# -- report -------------------------------------------------------------------------------------------------
def _f(v: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if v is None else fmt.format(v)


def _table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def format_report(r: SoakReport, rss_margin: float, fd_margin: int) -> str:
    rows: list[tuple[str, ...]] = [("path", "clients", "seconds", "requests ok", "errors", "tokens", "gap p50 ms",
                                    "gap p99 ms", "gap p99.9 ms", "ttft p50 ms", "ttft p99 ms")]
    runs: list[tuple[str, LoadStats, float]] = []
    if r.direct is not None:
        runs.append(("direct to replicas", r.direct, r.direct_duration))
    runs.append(("through kvgate", r.gateway, r.duration))
    for name, s, secs in runs:
        rows.append((name, str(r.clients), f"{secs:g}", str(s.requests), str(s.errors), str(s.tokens),
                     _f(s.gaps.quantile_ms(0.5)), _f(s.gaps.quantile_ms(0.99)), _f(s.gaps.quantile_ms(0.999)),
                     _f(s.ttft.quantile_ms(0.5)), _f(s.ttft.quantile_ms(0.99))))
    out = [_table(rows)]
    gw99 = r.gateway.gaps.quantile_ms(0.99)
    base = r.direct.gaps.quantile_ms(0.99) if r.direct is not None else r.decode_s * 1000
    what = "direct run" if r.direct is not None else "replica decode step"
    added = None if gw99 is None or base is None else gw99 - base
    out.append(f"\nadded inter-token latency p99: {_f(added)} ms (kvgate p99 {_f(gw99)} ms vs {what} p99 "
               f"{_f(base)} ms; replica decode step {r.decode_s * 1000:.0f} ms)")
    if r.gateway.error_kinds:
        out.append(f"errors: {r.gateway.error_kinds}")
    warm, end = r.warm, r.end
    peak_rss = max(p[1] for p in r.samples.points)
    peak_fd = max(p[2] for p in r.samples.points)
    grow_rss, grow_fd = r.growth()
    res: list[tuple[str, ...]] = [("kvgate process", "idle", f"after warm-up (t={warm[0]:.0f}s)", "peak",
                                   f"end (t={end[0]:.0f}s)", "clients gone", "end - warm-up", "flat?")]
    res.append(("RSS MiB", f"{r.idle[0]:.1f}", f"{warm[1]:.1f}", f"{peak_rss:.1f}", f"{end[1]:.1f}",
                f"{r.after[0]:.1f}", f"{grow_rss:+.1f}", "yes" if grow_rss <= rss_margin else "NO"))
    res.append(("open fds", str(r.idle[1]), str(warm[2]), str(peak_fd), str(end[2]), str(r.after[1]),
                f"{grow_fd:+d}", "yes" if grow_fd <= fd_margin else "NO"))
    out.append("\n" + _table(res))
    out.append(f"({len(r.samples.points)} samples; margins: RSS {rss_margin:.0f} MiB, fds {fd_margin}; "
               f"kvgate CPU after warm-up: {_f(r.cpu_percent(), '{:.0f}')}% of one core)")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=500)
    parser.add_argument("--duration", type=float, default=600.0, help="seconds through kvgate")
    parser.add_argument("--direct-duration", type=float, default=None,
                        help="seconds of the direct run first (default min(60, duration/10); 0 skips it)")
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--decode-s", type=float, default=0.1, help="replica decode step (inter-token time)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--sample-s", type=float, default=None, help="RSS/fd sampling period (default 5 s)")
    parser.add_argument("--warmup-s", type=float, default=None, help="default: 10%% of the duration, >= 2 s")
    parser.add_argument("--rss-margin-mb", type=float, default=None, help="default: max(16 MiB, 10%% of warm)")
    parser.add_argument("--fd-margin", type=int, default=None, help="default: max(16, 10%% of --clients)")
    args = parser.parse_args(argv)
    direct_s = args.direct_duration if args.direct_duration is not None else min(60.0, args.duration / 10)
    sample_s = args.sample_s or min(5.0, max(0.5, args.duration / 20))
    warmup_s = args.warmup_s if args.warmup_s is not None else max(2.0, args.duration / 10)
    fleet = start_soak_fleet(replicas=args.replicas, decode_s=args.decode_s, clients=args.clients)
    try:
        print(f"soak: {args.clients} streaming clients, {direct_s:g} s direct then {args.duration:g} s through "
              f"kvgate pid {fleet.gateway.pid}, {args.replicas} replicas, decode step {args.decode_s * 1000:.0f} ms",
              file=sys.stderr)
        report = asyncio.run(soak(fleet, clients=args.clients, duration=args.duration, direct_duration=direct_s,
                                  decode_s=args.decode_s, max_tokens=args.max_tokens, sample_s=sample_s,
                                  warmup_s=warmup_s))
    finally:
        fleet.close()
    warm = report.warm
    rss_margin = args.rss_margin_mb if args.rss_margin_mb is not None else max(16.0, 0.10 * warm[1])
    # kvgate's keep-alive pool to the replicas keeps its high-water mark of concurrent upstream
    # requests, which creeps up a little as rarer peaks occur: bounded by the client count. A leak
    # grows with requests (tens of thousands in a run), so 10% of the clients still catches one.
    fd_margin = args.fd_margin if args.fd_margin is not None else max(16, args.clients // 10)
    print(format_report(report, rss_margin, fd_margin))
    grow_rss, grow_fd = report.growth()
    problems = []
    if report.gateway.errors or (report.direct is not None and report.direct.errors):
        problems.append("errors")
    if grow_rss > rss_margin:
        problems.append(f"RSS grew {grow_rss:.1f} MiB")
    if grow_fd > fd_margin:
        problems.append(f"fds grew by {grow_fd}")
    if problems:
        print("FAIL: " + ", ".join(problems), file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
