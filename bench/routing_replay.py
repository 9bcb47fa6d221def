"""Replay a workload through any async ``send(request) -> usage``: the end-to-end seam.

The simulator (``bench.routing_sim``) routes in-process; this drives the same
``Workload`` in real time through whatever ``send`` does, e.g. an OpenAI SDK
pointed at a running kvgate in front of ``vllm_sim`` processes:

    async def send(req: Request) -> Usage:
        resp = await client.post(PATHS[req.endpoint], json=req.body(), headers=req.headers)
        u = resp.json()["usage"]
        return Usage(u["prompt_tokens"], (u.get("prompt_tokens_details") or {}).get("cached_tokens"))

    results = await replay(workload, send, speed=10.0)

Absolute arrivals are honoured (divided by ``speed``); a closed-loop follow-up
is sent ``arrival / speed`` seconds after the request it follows completes. A
failed request is recorded, and its follow-ups are still sent.

With a ``ClosedLoop`` (``closed_loop=``, else the workload's own) a fixed
number of client tasks replay the conversations instead, as the simulator
does: each sends its next request as soon as the previous one completes
(burst windows scaled by ``speed`` too), and arrivals and think times are
ignored.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from .workloads import ClosedLoop, Request, Workload, chains

__all__ = ["Usage", "Result", "replay", "summarise"]


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int | None = None
    # Time to first token, if ``send`` streamed and measured it.
    ttft_s: float | None = None
    # Seconds between successive text chunks after the first, and the answer's text (choice 0),
    # if ``send`` recorded them (bench.pd checks answers and inter-token latency).
    itl_s: list[float] = field(default_factory=list)
    text: str | None = None


@dataclass(slots=True)
class Result:
    rid: int
    started: float
    finished: float
    usage: Usage | None
    error: str | None = None


Send = Callable[[Request], Awaitable[Usage]]


async def _send(req: Request, send: Send, t0: float) -> Result:
    started = time.perf_counter() - t0
    usage, error = None, None
    try:
        usage = await send(req)
    except Exception as e:  # a failed request is a result, not the end of the replay
        error = f"{type(e).__name__}: {e}"
    return Result(req.rid, started, time.perf_counter() - t0, usage, error)


async def replay(workload: Workload, send: Send, speed: float = 1.0, max_concurrency: int = 1024,
                 closed_loop: ClosedLoop | None = None) -> list[Result]:
    """Send every request of ``workload``; return one ``Result`` per request, in rid order."""
    loop = closed_loop or workload.closed_loop
    if loop is not None:
        return await _replay_closed(workload, send, loop, speed)
    followers: dict[int, list[Request]] = {}
    roots: list[Request] = []
    for r in workload.requests:
        (followers.setdefault(r.after, []) if r.after is not None else roots).append(r)
    results: dict[int, Result] = {}
    gate = asyncio.Semaphore(max_concurrency)
    t0 = time.perf_counter()
    tasks: set[asyncio.Task[None]] = set()

    def spawn(req: Request, at: float) -> None:
        task = asyncio.create_task(one(req, at))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def one(req: Request, at: float) -> None:
        await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
        async with gate:
            result = results[req.rid] = await _send(req, send, t0)
        for nxt in followers.pop(req.rid, ()):
            spawn(nxt, result.finished + nxt.arrival / speed)

    for req in roots:
        spawn(req, req.arrival / speed)
    while tasks:
        await asyncio.gather(*list(tasks))
    return [results[rid] for rid in sorted(results)]


async def _replay_closed(workload: Workload, send: Send, loop: ClosedLoop, speed: float) -> list[Result]:
    conversations = deque(chains(workload))
    results: dict[int, Result] = {}
    t0 = time.perf_counter()

    async def client() -> None:
        while conversations:
            for req in conversations.popleft():
                now = time.perf_counter() - t0
                await asyncio.sleep(max(0.0, loop.next_start(now * speed) / speed - now))
                results[req.rid] = await _send(req, send, t0)

    await asyncio.gather(*(client() for _ in range(loop.clients)))
    return [results[rid] for rid in sorted(results)]


def summarise(results: list[Result]) -> dict[str, float]:
    """Fleet hit ratio (tokens), TTFT p50/p95 where measured, and the error count."""
    ok = [r.usage for r in results if r.usage is not None]
    prompt = sum(u.prompt_tokens for u in ok)
    cached = sum(u.cached_tokens or 0 for u in ok)
    ttfts = sorted(u.ttft_s for u in ok if u.ttft_s is not None)

    def q(p: float) -> float:
        return ttfts[min(len(ttfts) - 1, int(p * len(ttfts)))] if ttfts else float("nan")

    return {"requests": len(results), "errors": sum(1 for r in results if r.error),
            "hit_ratio": cached / prompt if prompt else 0.0, "ttft_p50_s": q(0.5), "ttft_p95_s": q(0.95)}
