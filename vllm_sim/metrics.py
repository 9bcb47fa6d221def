"""``GET /metrics``: the vLLM V1 Prometheus series a gateway scrapes, written by hand.

Hand-written rather than via prometheus_client because its default registry
is a process global: two simulated replicas in one test process would share
(and clash over) one registry. The layout copies prometheus_client's output
for the same metrics, so any Prometheus parser reads it.
"""

from __future__ import annotations

from typing import Mapping

from prometheus_client.utils import floatToGoString

from vllm_sim.config import SimConfig
from vllm_sim.engine import Engine
from vllm_sim.pd import PD
from vllm_sim.stats import Histogram

__all__ = ["CONTENT_TYPE", "render_metrics"]

CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"


def _labels(pairs: Mapping[str, object]) -> str:
    inner = ",".join(f'{k}="{_escape(str(v))}"' for k, v in pairs.items())
    return "{" + inner + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


Sample = tuple[Mapping[str, object], float]


def _family(lines: list[str], name: str, kind: str, help_: str, samples: list[Sample]) -> None:
    lines.append(f"# HELP {name} {help_}")
    lines.append(f"# TYPE {name} {kind}")
    for labels, value in samples:
        lines.append(f"{name}{_labels(labels)} {float(value)!r}")


def _histogram(lines: list[str], name: str, help_: str, labels: Mapping[str, object], hist: Histogram,
               max_bound: float = float("inf")) -> None:
    """A histogram as prometheus_client writes one: cumulative ``_bucket``s ending at +Inf, ``_count``, ``_sum``."""
    lines.append(f"# HELP {name} {help_}")
    lines.append(f"# TYPE {name} histogram")
    for bound, n in [*hist.cumulative(max_bound), (float("inf"), hist.count)]:
        lines.append(f"{name}_bucket{_labels({**labels, 'le': floatToGoString(bound)})} {float(n)!r}")
    lines.append(f"{name}_count{_labels(labels)} {float(hist.count)!r}")
    lines.append(f"{name}_sum{_labels(labels)} {float(hist.sum)!r}")


def render_metrics(config: SimConfig, engine: Engine, pd: PD | None = None) -> str:
    base = {"engine": "0", "model_name": config.model}
    pool, stats = engine.pool, engine.stats
    running, waiting = engine.reported
    lines: list[str] = []
    _family(lines, "vllm:num_requests_running", "gauge",
            "Number of requests in model execution batches.", [(base, running)])
    _family(lines, "vllm:num_requests_waiting", "gauge",
            "Number of requests waiting to be processed.", [(base, waiting)])
    # Every simulated wait is for capacity: "deferred" is vLLM's LoRA budget, KV transfer
    # or a blocked status, none of which the simulator has.
    _family(lines, "vllm:num_requests_waiting_by_reason", "gauge",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling "
            "capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked "
            "status). Sum of all reasons equals vllm:num_requests_waiting.",
            [({**base, "reason": "capacity"}, waiting), ({**base, "reason": "deferred"}, 0)])
    _family(lines, "vllm:kv_cache_usage_perc", "gauge",
            "KV-cache usage. 1 means 100 percent usage.", [(base, pool.usage)])
    _family(lines, "vllm:prefix_cache_queries_total", "counter",
            "Prefix cache queries, in terms of number of queried tokens.", [(base, pool.queries_tokens)])
    _family(lines, "vllm:prefix_cache_hits_total", "counter",
            "Prefix cache hits, in terms of number of cached tokens.", [(base, pool.hits_tokens)])
    info = {**base, "block_size": config.block_size, "num_gpu_blocks": config.num_gpu_blocks,
            "enable_prefix_caching": "True", "prefix_caching_hash_algo": "blake2b"}
    _family(lines, "vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig",
            [(info, 1)])
    # vLLM counts aborted requests here too, under finished_reason="abort".
    reasons = {**stats.finished_by_reason, "abort": stats.aborted}
    _family(lines, "vllm:request_success_total", "counter", "Count of successfully processed requests.",
            [({**base, "finished_reason": r}, reasons.get(r, 0)) for r in ("stop", "length", "abort")])
    _family(lines, "vllm:num_preemptions_total", "counter", "Cumulative number of preemption from the engine.",
            [(base, stats.preemptions)])
    _family(lines, "vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.",
            [(base, stats.prompt_tokens)])
    _family(lines, "vllm:generation_tokens_total", "counter", "Number of generation tokens processed.",
            [(base, stats.generation_tokens)])
    # vLLM's buckets: the request-phase latency bounds, and the 1-2-5 series up to max_model_len.
    _histogram(lines, "vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.",
               base, stats.prefill_seconds)
    _histogram(lines, "vllm:request_prefill_kv_computed_tokens",
               "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
               base, stats.prefill_computed_tokens, config.max_model_len)
    _histogram(lines, "vllm:request_num_preemptions", "Histogram of the number of times a request was preempted.",
               base, stats.request_preemptions)
    if pd is not None:
        _pd_metrics(lines, base, pd)
    return "\n".join(lines) + "\n"


def _pd_metrics(lines: list[str], base: Mapping[str, object], pd: PD) -> None:
    """P/D transfers (vllm_sim.pd): vLLM's NIXL and connector counters where it has them
    (``nixl/stats.py``, ``v1/metrics/loggers.py``), ``vllm_sim:`` ones for what it has not."""
    def counter(name: str, help_: str, value: int) -> None:
        _family(lines, name, "counter", help_, [(base, value)])

    stats = pd.stats

    counter("vllm:external_prefix_cache_queries_total",
            "External prefix cache queries from KV connector cross-instance cache sharing, in terms of "
            "number of queried tokens.", stats.external_queries)
    counter("vllm:external_prefix_cache_hits_total",
            "External prefix cache hits from KV connector cross-instance cache sharing, in terms of "
            "number of cached tokens.", stats.external_hits)
    counter("vllm:nixl_num_failed_transfers_total", "Number of failed NIXL KV Cache transfers.",
            stats.failed_transfers)
    counter("vllm:nixl_num_kv_expired_reqs_total", "Number of requests that had their KV expire.",
            stats.kv_expired_reqs)
    counter("vllm:nixl_num_notifications_after_expiry_total",
            "Number of completion notifications for requests that were no longer tracked.",
            stats.notifications_after_expiry)
    counter("vllm_sim:kv_transfers_total", "Pulls of KV blocks from a prefill replica that moved blocks.",
            stats.transfers)
    counter("vllm_sim:kv_transfer_blocks_total", "KV blocks pulled from prefill replicas.", stats.transfer_blocks)
    counter("vllm_sim:kv_transfer_tokens_total", "Prompt tokens whose KV was pulled from prefill replicas.",
            stats.transfer_tokens)
    counter("vllm_sim:kv_remote_prefills_total", "Requests prefilled for a remote decode.", stats.remote_prefills)
    _family(lines, "vllm_sim:kv_held_requests", "gauge",
            "Finished prefills whose blocks are held for a decode to pull.", [(base, pd.held_requests)])
    _histogram(lines, "vllm:nixl_xfer_time_seconds", "Histogram of transfer duration for NIXL KV Cache transfers.",
               base, pd.xfer_seconds)
