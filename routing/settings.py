"""Routing section of kvgate's settings (composed into gateway.settings.Settings)."""

from __future__ import annotations

from typing import Literal

from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class KVEventSettings(_Section):
    """How kvgate consumes the replicas' KV events (endpoints: ``replicas[].kv_events``)."""

    # Replicas found through dns_name publish on these ports of their address (vLLM's
    # --kv-events-config endpoint / replay_endpoint ports). None: DNS replicas stay approximate.
    port: int | None = Field(None, ge=1, le=65535)
    replay_port: int | None = Field(None, ge=1, le=65535)
    # Work that must store blocks was sent to a replica and no event came for this long:
    # its stream is slow or lost, so it is routed on the approximate index until one does.
    # Events follow a prefill step within milliseconds; seconds mean something is wrong.
    stale_s: float = Field(5.0, gt=0)
    # A block held in a lower tier (vLLM's CPU offload) saves its prefill but pays a copy
    # back to the GPU first: without a measurement of that ratio on the fleet, half.
    cpu_weight: float = Field(0.5, ge=0, le=1)
    # Per replica, far above any real pool (2M blocks = 32M tokens at 16 per block): past it
    # removals were lost, and the replica's entries are cleared and relearned.
    max_blocks: int = Field(1 << 21, ge=1024)


class RoutingSettings(_Section):
    policy: Literal["prefix_affinity", "least_load", "round_robin", "consistent_hash", "cost"] = "prefix_affinity"
    # "cost": the experimental cost model (routing.cost_model): one cost per replica
    # and a load bound at every decision; uses epsilon, prefill_tokens_per_s, share_index.
    # Bounded load: skip a replica whose load exceeds (1 + epsilon) x mean. Judged on
    # the replicas' scraped load averaged over load_average_s (the view every gateway
    # instance shares, so they move a key together) ...
    epsilon: float = Field(0.25, ge=0, le=10)
    load_average_s: float = Field(30.0, ge=0)
    # ... and, on the instantaneous load (with this instance's in-flight), skip a
    # replica swamped right now: past (1 + burst_epsilon) x mean.
    burst_epsilon: float = Field(1.0, ge=0, le=10)
    # A key no replica is known to hold yet (a new conversation, a one-off prompt)
    # goes where its prefill would start soonest (routing.backlog: the prompt
    # tokens this instance sent each replica, drained at prefill_tokens_per_s),
    # skipping a replica past (1 + new_key_epsilon) x mean right now; only while
    # this instance carries the replicas' traffic alone (its in-flight >= 3/4 of
    # their reported queues) or shares what it learns (share_index): otherwise
    # another instance would not know where the key went.
    # One instance, Mooncake trace: hit .256 vs .228, TTFT p95 4.5 vs 8.9 s;
    # unique prompts p95 262 vs 554 ms. None: off (keys go where they hash).
    new_key_epsilon: float | None = Field(0.25, ge=0, le=10)
    # Share where keys live with the other gateway instances through Redis
    # (routing.gossip; ignored, with a warning, without redis_url): where each
    # placed a new key, and which replica was found to hold one. New keys are then
    # placed by prefill queue with several instances too. Four simulated instances,
    # Mooncake trace: hit .256 vs .224, TTFT p95 7.4 vs 9.8 s.
    share_index: bool = False
    # Only the order between replicas matters, so a rough figure for the fleet's
    # engines will do (too high: the rendezvous order decides; too low: "fewest
    # prompt tokens sent lately").
    prefill_tokens_per_s: float = Field(15_000.0, gt=0)
    # New keys are spread by the work placed on each replica lately too, not only
    # by what is still queued: a new key brings its next turns. That memory fades
    # with this time constant (routing.backlog.Committed). Twin layout, mean of 8
    # seeds: TTFT p95 6.03 -> 5.88 s; shared prefix max/mean load 1.25 -> 1.01.
    placement_memory_s: float = Field(30.0, gt=0)
    # Characters per routing block (about 16 tokens of 4 characters, as llm-d does).
    block_chars: int = Field(64, ge=8, le=4096)
    # Literal text that marks the end of the stable prefix when a client places it.
    boundary_marker: str = "<!-- kvgate:cache-boundary -->"
    # Maximum routing blocks considered per request (bounds hashing work).
    max_blocks: int = Field(2048, ge=1)
    # Block-index capacity (entries across replicas), LRU. The popularity
    # estimate keeps a quarter of this many keys.
    index_capacity: int = Field(200_000, ge=1000)
    # A prefix carried by more than hot_fraction / replicas of the requests is "wide"
    # (more than one replica's share at 1.0): the routing key goes deeper than it.
    hot_fraction: float = Field(1.0, gt=0, le=1)
    # Keys carrying at least heavy_share of one replica's share get a packed home
    # (routing.placement) instead of their plain rendezvous first choice.
    heavy_share: float = Field(0.1, gt=0, le=1)
    # A replica the index believes holds a deeper prefix than the rendezvous first
    # choice goes first only if it is deeper by at least this many characters
    # (and by half again): small gains do not justify diverging from other instances.
    index_min_gain_chars: int = Field(2048, ge=0)
    # Exact token ids per served model (routing.tokens), so routing can key on what vLLM
    # will prefill: a Hugging Face tokenizer directory (the files the replicas load,
    # chat template included) per model name, tokenized in process ...
    tokenizers: dict[str, str] = Field(default_factory=dict)
    # ... or a vLLM render server (`vllm launch render MODEL_DIR`) asked for the ids of
    # every model without a directory above. Neither: approximate keys (block_chars).
    render_url: str | None = None
    render_timeout_s: float = Field(0.5, gt=0)
    # Tokens per KV block on the replicas (vLLM's --block-size; 16 is its default).
    block_size: int = Field(16, ge=1, le=1024)
    # Re-resolve replicas from a headless-service DNS name, e.g. "vllm.ns.svc.cluster.local:8000".
    dns_name: str | None = None
    dns_interval_s: float = Field(10.0, gt=0)
    # Precise mode's event streams (routing.kv_events; used by policy "cost").
    kv_events: KVEventSettings = Field(default_factory=KVEventSettings)

    @field_validator("render_url")
    @classmethod
    def _render_url(cls, v: str | None) -> str | None:
        if v is None:
            return v
        parts = urlsplit(v)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("must be an http(s) URL with a host, e.g. http://127.0.0.1:8100")
        return v.rstrip("/")
