"""Counters the engine keeps, for ``GET /sim/stats``, ``/metrics`` and tests.

Bounded by construction: per-request records keep only the most recent
``RECENT`` entries, so a benchmark pushing millions of requests through one
replica does not grow its memory.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

__all__ = ["EngineStats", "Histogram", "REQUEST_LATENCY_BUCKETS", "TOKEN_BUCKETS", "tokens_buckets"]

RECENT = 1024

# vLLM's bucket bounds (vllm.v1.metrics.buckets): the request-phase timing histograms
# (e2e, queue, inference, prefill, decode) share these.
REQUEST_LATENCY_BUCKETS: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)


# vllm.v1.metrics.buckets.REQUEST_NUM_PREEMPTIONS_BUCKETS.
PREEMPTION_BUCKETS: tuple[float, ...] = (1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 20.0)


def tokens_buckets(max_value: int) -> tuple[float, ...]:
    """vLLM's 1-2-5 series up to ``max_value`` (``build_1_2_5_buckets(max_model_len)``), for token counts."""
    out: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(out)
            out.append(float(mantissa * scale))
        scale *= 10


# Kept up to 5e9 tokens: /metrics shows the bounds up to the replica's max_model_len, as
# vLLM does (counts are cumulative, so leaving the larger bounds out changes none shown).
TOKEN_BUCKETS = tokens_buckets(5_000_000_000)


@dataclass(slots=True)
class Histogram:
    """One Prometheus histogram's state: a count per bucket (not cumulative), the sum and the count."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * len(self.bounds)

    def observe(self, value: float) -> None:
        self.sum += value
        self.count += 1
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1
                return

    def cumulative(self, max_bound: float = float("inf")) -> list[tuple[float, int]]:
        """(upper bound, observations at or below it) for each bound up to ``max_bound``, as ``_bucket`` shows."""
        out, total = [], 0
        for bound, n in zip(self.bounds, self.counts):
            if bound > max_bound:
                break
            total += n
            out.append((bound, total))
        return out


@dataclass(slots=True)
class EngineStats:
    requests: int = 0
    completed: int = 0
    aborted: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished_by_reason: dict[str, int] = field(default_factory=dict)
    last_cached_tokens: int | None = None
    # request id -> cached prompt tokens, most recent last.
    cached_tokens: OrderedDict[str, int] = field(default_factory=OrderedDict)
    # (request id, wall-clock time of the abort), most recent last.
    aborts: deque[tuple[str, float]] = field(default_factory=lambda: deque(maxlen=RECENT))
    # Preemptions (vllm:num_preemptions), and the request ids preempted, most recent last.
    preemptions: int = 0
    preempted: deque[str] = field(default_factory=lambda: deque(maxlen=RECENT))
    # vLLM's per-request prefill histograms, observed when a sequence finishes (never on a
    # client's abort: vLLM drops an aborted request's stats): seconds from its scheduling to
    # its first token, in the timing model's scaled time, and its prompt tokens not served
    # from the prefix cache.
    prefill_seconds: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    prefill_computed_tokens: Histogram = field(default_factory=lambda: Histogram(TOKEN_BUCKETS))
    # Times each finished sequence was preempted (vllm:request_num_preemptions).
    request_preemptions: Histogram = field(default_factory=lambda: Histogram(PREEMPTION_BUCKETS))

    def record_cached(self, request_id: str, tokens: int) -> None:
        self.last_cached_tokens = tokens
        self.cached_tokens[request_id] = tokens
        if len(self.cached_tokens) > RECENT:
            self.cached_tokens.popitem(last=False)

    def record_finish(self, reason: str) -> None:
        self.completed += 1
        self.finished_by_reason[reason] = self.finished_by_reason.get(reason, 0) + 1

    def record_prefill(self, seconds: float, computed_tokens: int, preemptions: int = 0) -> None:
        """A finished sequence's prefill figures and how often it was preempted."""
        self.prefill_seconds.observe(seconds)
        self.prefill_computed_tokens.observe(computed_tokens)
        self.request_preemptions.observe(preemptions)

    def record_preemption(self, request_id: str) -> None:
        self.preemptions += 1
        self.preempted.append(request_id)

    def record_abort(self, request_id: str) -> None:
        self.aborted += 1
        self.aborts.append((request_id, time.time()))

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "completed": self.completed,
            "aborted": self.aborted,
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
            "finished_by_reason": dict(self.finished_by_reason),
            "last_cached_tokens": self.last_cached_tokens,
            "cached_tokens": dict(self.cached_tokens),
            "aborts": [{"id": rid, "time": t} for rid, t in self.aborts],
            "preemptions": self.preemptions,
            "preempted": list(self.preempted),
            "prefills": self.prefill_seconds.count,
            "prefill_seconds_sum": self.prefill_seconds.sum,
            "prefill_computed_tokens_sum": self.prefill_computed_tokens.sum,
        }
