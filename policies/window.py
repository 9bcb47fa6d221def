"""Sliding-window counter arithmetic, shared by the Redis script and the local fallback. Pure.

A limit of L per window W is enforced on an estimate of the last W seconds:
the current fixed window's count plus the previous window's count weighted
by how much of it still overlaps the sliding window:

    estimate(e) = prev * (1 - e / W) + cur        (e = time into the current window)

Two integers per counter instead of one entry per request (a sliding log);
the error is bounded by assuming the previous window's events were spread
evenly, which is what Cloudflare and others accept for rate limits.

``ratelimit._LUA`` implements ``roll`` and ``admit`` in Lua for Redis; the
tests run the same scenarios through both to keep them equal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Counter:
    """Requests and tokens of the previous and current fixed windows."""

    window: int = 0  # index of the current window: floor(now / W)
    req_prev: int = 0
    req_cur: int = 0
    tok_prev: int = 0
    tok_cur: int = 0


def roll(c: Counter, window: int) -> Counter:
    """The counter as seen from window index ``window`` (never moves backwards)."""
    if window <= c.window:
        return c
    if window == c.window + 1:
        return Counter(window, c.req_cur, 0, c.tok_cur, 0)
    return Counter(window)


def estimate(prev: int, cur: int, frac: float) -> float:
    return prev * (1.0 - frac) + cur


def admit(c: Counter, frac: float, rpm: int | None, tpm: int | None, cost_req: int,
          cost_tok: int) -> tuple[bool, str | None]:
    """Whether a request fits, and if not which limit ("requests" / "tokens") refuses it.

    Tokens are mostly counted after the fact, so the token limit refuses once
    the window is used up (estimate >= tpm) or when a declared reservation
    would overflow it.
    """
    if rpm is not None and estimate(c.req_prev, c.req_cur, frac) + cost_req > rpm:
        return False, "requests"
    if tpm is not None:
        used = estimate(c.tok_prev, c.tok_cur, frac)
        if used >= tpm or used + cost_tok > tpm:
            return False, "tokens"
    return True, None


def wait_s(prev: int, cur: int, elapsed_s: float, window_s: float, limit: int, cost: float) -> float:
    """Seconds until ``estimate + cost <= limit`` holds, with no further traffic.

    Within the current window the estimate falls as the previous window slides
    out; if that is not enough, after the next boundary ``cur`` becomes the
    sliding part and falls in turn.
    """
    budget = limit - cost
    if budget < 0:
        return 2 * window_s - elapsed_s  # can never fit; retry when both windows are empty
    if cur <= budget:
        if prev <= 0 or prev + cur <= budget:
            return 0.0
        need = window_s * (1.0 - (budget - cur) / prev)  # elapsed time at which it fits
        if need < window_s:
            return max(0.0, need - elapsed_s)
    rest = window_s - elapsed_s
    if cur <= budget:
        return rest
    return rest + window_s * (1.0 - budget / cur)


def retry_after(seconds: float) -> int:
    """Whole seconds for a Retry-After header: rounded up, at least 1."""
    return max(1, math.ceil(seconds - 1e-9))
