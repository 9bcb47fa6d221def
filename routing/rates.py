"""A replica's prefill rate, learned from what it reports: no hand-set tokens per second.

vLLM's ``/metrics`` carries two histograms per request (``vllm.v1.metrics.loggers``):
``vllm:request_prefill_kv_computed_tokens`` (prompt tokens actually computed,
prefix-cache hits excluded) and ``vllm:request_prefill_time_seconds`` (from the
request's first scheduling to its first token). The ratio of their ``_sum``s
is the tokens the replica computes per second of prefill. A replica at half
speed reports half the rate; every gateway instance reads the same counters,
so they learn the same figure without talking.

The ratio is taken over the counters' whole life (since the replica started):
a replica's speed is set by its model and hardware, which change only with a
restart, and a restart resets the counters, so the estimate starts afresh
exactly when it should. No window, no decay constant.

What it measures is per request: requests prefilled in one step each count
that step's time, so under batching the figure is the rate a request sees,
below the engine's raw throughput. That is the figure a time-to-first-token
prediction needs, and replicas of one fleet are compared on the same footing.
"""

from __future__ import annotations

__all__ = ["prefill_rate", "RATE_METRICS"]

# The two _sum series the rate is read from (summed over label sets by the scraper).
RATE_METRICS = {
    "vllm:request_prefill_kv_computed_tokens_sum": "prefill_tokens_sum",
    "vllm:request_prefill_time_seconds_sum": "prefill_seconds_sum",
}


def prefill_rate(tokens_sum: float | None, seconds_sum: float | None) -> float | None:
    """Prompt tokens computed per prefill-second, or None before any prefill was timed."""
    if tokens_sum is None or seconds_sum is None or seconds_sum <= 0.0 or tokens_sum <= 0.0:
        return None
    return tokens_sum / seconds_sum
