"""Routing section of kvgate's settings (composed into gateway.settings.Settings)."""

from __future__ import annotations

import logging
from typing import Any, Literal

from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


_log = logging.getLogger("kvgate.settings")


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

    def endpoints_at(self, host: str) -> tuple[str, str | None] | None:
        """The event and replay endpoints of a replica found through dns_name at ``host`` (None: no port)."""
        if self.port is None:
            return None
        return f"tcp://{host}:{self.port}", f"tcp://{host}:{self.replay_port}" if self.replay_port else None


# Settings of the layered policy the cost model replaced (issue 15). A config that
# still sets them keeps loading: they are dropped with a warning naming each.
RETIRED = ("load_average_s", "burst_epsilon", "new_key_epsilon", "placement_memory_s", "heavy_share",
           "index_min_gain_chars")


class RoutingSettings(_Section):
    # ttft: routing.ttft_affinity (issue 26: the time to first token each replica would give,
    # in seconds, each replica's prefill rate learned from its /metrics, and a rail on the wait
    # ahead). prefix_affinity: routing.prefix_affinity, the default before it (one cost per
    # replica in prompt tokens, a bound on requests in flight at every decision); "cost", its
    # name while it was being measured, still selects it.
    policy: Literal["prefix_affinity", "ttft", "least_load", "round_robin", "consistent_hash"] = "ttft"
    # The load bound (consistent hashing with bounded loads): a replica takes a request
    # only if its in-flight stays within ceil((1 + epsilon) x mean in flight), judged at
    # every decision on this instance's own in-flight plus what the replicas report.
    # (prefix_affinity only: ttft has no count bound.)
    epsilon: float = Field(0.25, ge=0, le=10)
    # Share where keys live with the other gateway instances through Redis
    # (routing.gossip; true is ignored, with a warning, without redis_url): where each
    # placed a key away from its home, and which replica was found to hold one;
    # with policy ttft, every placement with its prompt's block hashes (block facts).
    # Unset: on with policy ttft wherever redis_url is set (several instances with a
    # Redis keep one instance's reuse and tail only with block facts), off otherwise.
    share_index: bool | None = None
    # The prefill rate that drains the queue of prompt tokens this instance sent each
    # replica (routing.backlog). Only the order between replicas matters, so a rough
    # figure for the fleet's engines will do.
    # (prefix_affinity only: ttft learns each replica's rate from its /metrics.)
    prefill_tokens_per_s: float = Field(15_000.0, gt=0)
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
    # P/D fleets (replicas with role prefill or decode; gateway.proxy.disagg): "selective"
    # prefills remotely only when it pays (routing.disagg.decide, from measured rates);
    # "always" sends every request through a prefill replica, as vLLM's own P/D router does.
    disaggregation: Literal["selective", "always"] = "selective"
    # How a P/D prefill leg's replica is chosen. "ttft": the least predicted time to first
    # token (routing.ttft_affinity), which is the whole of a prefill replica's job: no decode
    # runs beside the leg, and its pool, under pressure, is priced by what an eviction costs
    # later. "policy": by routing.policy, as the decode pick.
    prefill_pick: Literal["ttft", "policy"] = "ttft"
    # Precise mode's event streams (routing.kv_events; read by prefix_affinity).
    kv_events: KVEventSettings = Field(default_factory=KVEventSettings)

    @model_validator(mode="before")
    @classmethod
    def _retired(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        gone = [k for k in RETIRED if k in data]
        if gone or data.get("policy") == "cost":
            data = {k: v for k, v in data.items() if k not in RETIRED}
            if data.get("policy") == "cost":
                data["policy"] = "prefix_affinity"
                gone.append("policy: cost (now prefix_affinity)")
            _log.warning("routing settings retired with the cost model, ignored: %s", ", ".join(gone))
        return data

    @field_validator("render_url")
    @classmethod
    def _render_url(cls, v: str | None) -> str | None:
        if v is None:
            return v
        parts = urlsplit(v)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("must be an http(s) URL with a host, e.g. http://127.0.0.1:8100")
        return v.rstrip("/")
