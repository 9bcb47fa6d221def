"""Semantic-cache section of kvgate's settings (composed into gateway.settings.Settings).

Defaults are the configuration measured by ``bench/semantic_eval.py``; change
``threshold`` or ``verifier`` only with a new measurement.
"""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SemanticCacheSettings(_Section):
    # The semantic cache (both tiers) on or off.
    enabled: bool = False
    # Similarity search on top of the exact tier (off: exact repeats only).
    semantic_enabled: bool = True
    # Cosine similarity a candidate must reach before the verifier looks at it
    # (0.90 with the verifier: QQP false hits <= 1%; see bench/semantic_eval.py).
    threshold: float = Field(0.90, ge=0, le=1)
    # Rule-based checks (negation, numbers, entities, word order...) after the threshold.
    verifier: bool = True
    # Nearest candidates (above threshold) offered to the verifier, best first.
    candidates: int = Field(3, ge=1, le=32)
    # Longer final messages are documents, not questions: exact tier only.
    semantic_max_chars: int = Field(400, ge=1)
    # Raw completion prompts continue text byte for byte: exact tier only unless set.
    semantic_completions: bool = False
    # How long an entry lives.
    ttl_s: int = Field(86_400, ge=1)
    # Entries kept per tenant namespace.
    max_entries_per_namespace: int = Field(100_000, ge=10)
    # Answers bigger than this are not worth a Redis round trip to replay.
    max_answer_chars: int = Field(200_000, ge=1)
    # Store answers that call tools (off: never cached).
    cache_tool_calls: bool = False
    # local: the MiniLM model in process; remote: embedding_url; hash: meaning-free hashed words, for tests of plumbing.
    embedder: Literal["local", "remote", "hash"] = "local"
    # The local embedder's model.
    embedding_model: str = "all-MiniLM-L6-v2"
    # For the remote embedder: an OpenAI-compatible /v1/embeddings endpoint (full URL).
    embedding_url: str | None = None
    # A lookup waits at most this long for its embedding, then counts as a miss: a
    # starved model must not add seconds to time-to-first-token (one query: ~15 ms).
    embed_timeout_s: float = Field(0.5, gt=0)
    # Threads for the local model. Unset: ONNX Runtime (the default path) gets every core
    # this process may run on, shared among the workers (``embedder_threads``): its
    # threads sleep between batches instead of spinning, so they take a core only while
    # a batch computes, and a batch is pure arithmetic that splits across cores (8
    # clients in new contexts, idle box: p99 68 -> 40 ms with 2 threads instead of 1).
    # Torch (the fallbacks) keeps one: its OpenMP threads spin-wait against the event
    # loop (one query under load: p50 13 ms with 1 thread, 115 ms with 2). A number
    # sets both.
    embed_threads: int | None = Field(None, ge=1, le=64)
    # Run the local model through ONNX Runtime, else a frozen TorchScript trace (same
    # vectors, checked at load; one query 24.6 -> 9.6 ms on one core, see
    # semantic_cache/fast_encode.py). Off: SentenceTransformer.encode.
    embed_fast: bool = True
    # The end of a response waits at most this long for its exact-tier write, so a repeat
    # sent the moment the answer arrives is a hit (in-process: immediate; Redis: one round
    # trip, ~0.3 ms). A slower Redis finishes the write in the background instead.
    store_wait_ms: float = Field(50.0, ge=0)
    # Texts per model call. No wait to fill a batch: a lone query goes at once, and what
    # queued while the model ran goes in its next call. The cap bounds one call, so a query
    # queued behind a full batch still meets embed_timeout_s (32 short questions: ~0.2 s
    # on one core, ~6 ms each).
    batch_max: int = Field(32, ge=1)
    # HNSW parameters; partitions smaller than brute_force_max are searched exactly.
    hnsw_m: int = Field(16, ge=4, le=64)
    hnsw_ef_construction: int = Field(100, ge=10)
    hnsw_ef_search: int = Field(64, ge=10)
    brute_force_max: int = Field(256, ge=0)
    # Redis layout and fault handling.
    key_prefix: str = "kvgate:sc:"
    probe_interval_s: float = Field(1.0, gt=0)
    # Redis calls in flight at once (more queue, briefly); consecutive failures that open
    # the breaker (a refused connection opens it at once).
    redis_max_connections: int = Field(32, ge=1)
    breaker_failures: int = Field(3, ge=1)
    # A full resynchronisation of the in-memory index with Redis this often (besides start-up and each outage).
    resync_interval_s: float = Field(60.0, gt=0)
    # Longest wait of one read of the change-log stream.
    sync_block_ms: int = Field(500, ge=10, le=10_000)
    # The change-log tail reads at most this often: each read is a socket write on the
    # event loop, and every write (this instance's own too) would otherwise trigger one.
    # Other instances still see an entry within about this plus one fetch (< 1 s).
    sync_interval_ms: int = Field(100, ge=0, le=900)
    # Length the change-log stream is capped at.
    stream_maxlen: int = Field(100_000, ge=100)


def cores_available() -> int:
    """CPUs this process may run on (its affinity mask, which taskset and cpusets narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def embedder_threads(embed_threads: int | None, workers: int = 1) -> tuple[int, int]:
    """(torch threads, ONNX Runtime threads) for ``embed_threads`` (see the setting)."""
    if embed_threads is not None:
        return embed_threads, embed_threads
    # Each worker process runs its own model: together they use each core once.
    return 1, max(1, cores_available() // max(1, workers))
