"""What prompt hygiene costs per request, in process: ``analyze`` alone and the policy path.

    python -m bench.hygiene_cost                 # 200-word and 3,200-word (~4K-token) system prompts
    python -m bench.hygiene_cost --words 3200 --tools 8 --calls 4000

``analyze`` is timed on one body, as a quick check of the scan, without a memo
and with one (every call after the first a hit); the policy path
(``PolicyEngine.admit`` with the hygiene tracker, as the gateway calls it) on a
fresh parsed body per call with 256 distinct user turns, as the gateway parses
a new body for every request, timed after a first pass over the 256 bodies (the
steady state). The same path with ``prompt_hygiene`` off ("off") is the floor:
the difference ("hygiene") is what hygiene adds.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import timeit
from typing import Any

import orjson

from bench.overhead import system_prompt
from policies import HygieneTracker, PolicyEngine, RateLimiter, Tenant, TenantRegistry, analyze, scan_memo

_TURNS = 256


def _tools(n: int) -> list[dict[str, Any]]:
    """``n`` function tools of a typical shape (a description, three typed parameters)."""
    return [{"type": "function", "function": {
        "name": f"tool_{i}", "description": f"Look up the {i}th kind of record by its number and region.",
        "parameters": {"type": "object", "required": ["number"], "properties": {
            "number": {"type": "string", "description": "The record number, as printed."},
            "region": {"type": "string", "enum": ["eu", "us", "apac"]},
            "limit": {"type": "integer", "minimum": 1, "maximum": 100}}}}} for i in range(n)]


def _raw_bodies(words: int, tools: int) -> list[bytes]:
    system = system_prompt(words)
    out = []
    for i in range(_TURNS):
        body: dict[str, Any] = {"model": "m", "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": f"Question {i}: how do I change the billing address on order {1000 + i}?"}]}
        if tools:
            body["tools"] = _tools(tools)
        out.append(orjson.dumps(body))
    return out


def analyze_us(words: int, memo: bool, number: int = 200) -> float:
    """The brief's snippet: ``analyze`` of one body, again and again; with ``memo``, one memo throughout."""
    b = orjson.loads(_raw_bodies(words, 0)[3])
    scans = scan_memo() if memo else None
    return timeit.timeit(lambda: analyze(b, memo=scans), number=number) / number * 1e6


def admit_us(words: int, tools: int, calls: int, hygiene: bool) -> float:
    """``PolicyEngine.admit`` per call, a freshly parsed body each time (parsing not timed)."""
    engine = PolicyEngine(TenantRegistry([], "bench-secret"), RateLimiter(None), HygieneTracker(), scans=scan_memo())
    tenant = Tenant("acme", "acme", cache_salt="salt", prompt_hygiene=hygiene)
    raw = _raw_bodies(words, tools)
    bodies = [orjson.loads(raw[i % _TURNS]) for i in range(calls)]

    async def run() -> float:
        for b in bodies[:_TURNS]:  # warm: the first sighting of a prompt is not the steady state
            await engine.admit(tenant, "chat", b)
        start = time.perf_counter()
        for b in bodies[_TURNS:]:
            await engine.admit(tenant, "chat", b)
        return (time.perf_counter() - start) / (len(bodies) - _TURNS) * 1e6

    return asyncio.run(run())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--words", type=int, nargs="*", default=[200, 3200])
    p.add_argument("--tools", type=int, nargs="*", default=[0, 8])
    p.add_argument("--calls", type=int, default=4000)
    args = p.parse_args()
    print(f"{'system prompt':>14} {'tools':>5}  {'analyze':>8}  {'+ memo':>7}  {'admit':>7}  {'off':>6}  "
          f"{'hygiene':>7}   (us per call)")
    for words in args.words:
        bare, memo = analyze_us(words, False), analyze_us(words, True)
        for tools in args.tools:
            on = min(admit_us(words, tools, args.calls, True) for _ in range(3))
            off = min(admit_us(words, tools, args.calls, False) for _ in range(3))
            print(f"{words:>8} words {tools:>5}  {bare:>8.1f}  {memo:>7.1f}  {on:>7.1f}  {off:>6.1f}  {on - off:>7.1f}")

if __name__ == "__main__":
    main()
