"""A lean HTTP/1.1 keep-alive load generator over asyncio streams.

The benchmarks measure microseconds of gateway overhead; a general-purpose
client costs more than that per request, and at high concurrency it would be
the bottleneck on a 2-core machine. This client does only what the
benchmarks need: POST a fixed body, read a Content-Length or chunked answer,
note the time of the first body byte and the end.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence


@dataclass
class Result:
    latencies: list[float] = field(default_factory=list)
    ttfb: list[float] = field(default_factory=list)
    errors: int = 0
    statuses: dict[int, int] = field(default_factory=dict)


class Conn:
    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def _ensure(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self.reader is None or self.writer is None or self.writer.is_closing():
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port, limit=1 << 22)
        return self.reader, self.writer

    async def post(self, raw_request: bytes) -> tuple[int, float, bytes]:
        """Returns (status, seconds to first body byte, body)."""
        reader, writer = await self._ensure()
        t0 = time.perf_counter()
        writer.write(raw_request)
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        lower = head.lower()
        body = bytearray()
        ttfb = 0.0
        if b"transfer-encoding: chunked" in lower:
            while True:
                size_line = await reader.readuntil(b"\r\n")
                size = int(size_line.split(b";")[0], 16)
                if not ttfb:
                    ttfb = time.perf_counter() - t0
                if size == 0:
                    await reader.readuntil(b"\r\n")
                    break
                body += await reader.readexactly(size + 2)
        else:
            i = lower.find(b"content-length:")
            length = int(lower[i + 15:lower.find(b"\r\n", i)]) if i >= 0 else 0
            body += await reader.readexactly(length)
            ttfb = time.perf_counter() - t0
        if b"connection: close" in lower:
            self.close()
        return status, ttfb, bytes(body)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


def build_request(host: str, port: int, path: str, body: bytes, headers: dict[str, str] | None = None) -> bytes:
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}", "Content-Type: application/json",
             f"Content-Length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def run_load(host: str, port: int, raw_request: bytes | Sequence[bytes], *, concurrency: int,
                   duration_s: float, warmup_s: float = 0.5,
                   on_measure: Callable[[], None] | None = None) -> tuple[Result, float]:
    """Closed loop: ``concurrency`` workers, each sending back to back. Returns (result, seconds measured).

    Several requests are sent in turn (one user turn after another under a shared system
    prompt), so nothing keyed on a whole request can make a repeat cheaper than a real one.
    ``on_measure`` is called when the warm-up ends (to start a CPU clock, say)."""
    variants = [raw_request] if isinstance(raw_request, bytes) else list(raw_request)
    turns = itertools.cycle(variants)
    result = Result()
    start = time.perf_counter()
    measure_from = start + warmup_s
    stop_at = measure_from + duration_s

    async def worker() -> None:
        conn = Conn(host, port)
        try:
            while True:
                t0 = time.perf_counter()
                if t0 >= stop_at:
                    return
                try:
                    status, ttfb, _ = await conn.post(next(turns))
                except (OSError, asyncio.IncompleteReadError, ValueError):
                    conn.close()
                    if t0 >= measure_from:
                        result.errors += 1
                    continue
                if t0 >= measure_from:
                    result.latencies.append(time.perf_counter() - t0)
                    result.ttfb.append(ttfb)
                    result.statuses[status] = result.statuses.get(status, 0) + 1
        finally:
            conn.close()

    if on_measure is not None:
        asyncio.get_running_loop().call_later(warmup_s, on_measure)
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return result, duration_s


def percentile(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = min(len(s) - 1, max(0, int(round(p / 100 * (len(s) - 1)))))
    return s[k]
