"""The status page's pictures over time: a small ring buffer of per-interval samples.

Every ``interval_s`` (10 s) a background task reads the running totals the
Prometheus metrics already keep (requests, prompt and cached tokens, the TTFT
histogram, prefill computed and round robin's estimate) and stores what
changed since the last reading: the request rate, the fleet's prefix-cache hit
rate, TTFT p95 and the share of round robin's prefill that routing saved
(``gateway.observe.savings``) over that interval. ``samples`` (90) of them
make the last 15 minutes. Nothing is added to the hot path; one
reading walks the metric families once.

TTFT p95 is estimated from the histogram's bucket counts the way Prometheus'
``histogram_quantile`` does (linear within a bucket), so the page and a
Grafana panel over the same interval agree.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from .metrics import Metrics

log = logging.getLogger("kvgate.trends")


@dataclass(frozen=True)
class _Totals:
    at: float
    requests: float
    prompt_tokens: float
    cached_tokens: float
    ttft_buckets: tuple[tuple[float, float], ...]  # (upper bound, cumulative count), ascending
    computed: float = 0.0  # prompt tokens the fleet computed
    rr_computed: float = 0.0  # what round robin would have (the savings shadow's estimate)


@dataclass(frozen=True)
class TrendSample:
    t: float                      # wall-clock end of the interval (unix seconds)
    requests_per_s: float
    prefix_hit_rate: float | None  # cached / prompt tokens in the interval; None without prompt tokens
    ttft_p95_s: float | None       # None when no stream started in the interval
    # 1 - computed / round robin's computed in the interval; None without a served prompt.
    prefill_saved_share: float | None = None


def _samples(metric: Any) -> Iterable[Any]:
    for family in metric.collect():
        yield from family.samples


def read_totals(metrics: Metrics, now: float) -> _Totals:
    requests = sum(s.value for s in _samples(metrics.requests) if s.name.endswith("_total"))
    tokens = {"prompt": 0.0, "cached": 0.0}
    for s in _samples(metrics.tokens):
        kind = s.labels.get("kind")
        if s.name.endswith("_total") and kind in tokens:
            tokens[kind] += s.value
    buckets: dict[float, float] = {}
    for s in _samples(metrics.ttft):
        if s.name.endswith("_bucket"):
            le = float(s.labels["le"])
            buckets[le] = buckets.get(le, 0.0) + s.value  # summed over endpoints
    placed = {"actual": 0.0, "round_robin": 0.0}
    for s in _samples(metrics.prefill_tokens):
        placement = s.labels.get("placement")
        if s.name.endswith("_total") and placement in placed:
            placed[placement] += s.value
    return _Totals(now, requests, tokens["prompt"], tokens["cached"], tuple(sorted(buckets.items())),
                   placed["actual"], placed["round_robin"])


def quantile(q: float, buckets: tuple[tuple[float, float], ...]) -> float | None:
    """``histogram_quantile(q, ...)`` over cumulative (upper bound, count) pairs."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if upper == float("inf"):
                return lower  # past the last finite bound: the bound is all we know
            if count == below:
                return upper
            return lower + (upper - lower) * (rank - below) / (count - below)
        lower, below = upper, count
    return lower


def interval_sample(before: _Totals, after: _Totals, wall: float) -> TrendSample:
    span = max(after.at - before.at, 1e-9)
    prompt = after.prompt_tokens - before.prompt_tokens
    cached = after.cached_tokens - before.cached_tokens
    previous = dict(before.ttft_buckets)
    delta = tuple((le, count - previous.get(le, 0.0)) for le, count in after.ttft_buckets)
    rr = after.rr_computed - before.rr_computed
    computed = after.computed - before.computed
    return TrendSample(t=round(wall, 3), requests_per_s=max(after.requests - before.requests, 0.0) / span,
                       prefix_hit_rate=cached / prompt if prompt > 0 else None,
                       ttft_p95_s=quantile(0.95, delta),
                       prefill_saved_share=1 - computed / rr if rr > 0 else None)


class Trends:
    def __init__(self, metrics: Metrics, *, interval_s: float = 10.0, samples: int = 90,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self.metrics = metrics
        self.interval_s = interval_s
        self.samples: deque[TrendSample] = deque(maxlen=samples)
        self._clock, self._wall = clock, wall
        self._last: _Totals | None = None

    def tick(self) -> None:
        """Close the current interval (the first call only takes the starting totals)."""
        now = read_totals(self.metrics, self._clock())
        if self._last is not None:
            self.samples.append(interval_sample(self._last, now, self._wall()))
        self._last = now

    async def run(self) -> None:
        while True:
            try:
                self.tick()
            except Exception:  # a sampling bug costs the trend lines, never the gateway
                log.exception("trend sample failed")
            await asyncio.sleep(self.interval_s)

    def to_dict(self) -> dict[str, Any]:
        return {"interval_s": self.interval_s, "capacity": self.samples.maxlen,
                "samples": [{"t": s.t, "requests_per_s": round(s.requests_per_s, 3),
                             "prefix_hit_rate": s.prefix_hit_rate, "ttft_p95_s": s.ttft_p95_s,
                             "prefill_saved_share": s.prefill_saved_share}
                            for s in self.samples]}
