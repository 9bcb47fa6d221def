"""The simulator's one settings object, built once by the CLI or a test and read by ``build_app``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from vllm_sim.faults import Faults
from vllm_sim.timing import TimingModel
from vllm_sim.waiting import POLICIES, Policy

__all__ = ["SimConfig"]


@dataclass(slots=True)
class SimConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # Served model names; the first is the primary (vLLM's --served-model-name accepts several).
    model: str = "sim-model"
    extra_models: tuple[str, ...] = ()
    # LoRA adapters served on top of the primary model, (name, path) each, as vLLM's
    # --lora-modules name=path: listed in /v1/models with it as parent, and a request
    # naming one hashes every block with the adapter (vllm_sim.vllm_hash).
    lora_modules: tuple[tuple[str, str], ...] = ()
    num_gpu_blocks: int = 8192
    block_size: int = 16
    max_model_len: int = 32768
    timing: TimingModel = field(default_factory=TimingModel)
    # vLLM's --scheduling-policy: the waiting queue's order and whom preemption takes
    # (vllm_sim.waiting). Under fcfs a request's priority is accepted and ignored, as in vLLM.
    scheduling_policy: Policy = "fcfs"
    embedding_dim: int = 64
    # A Hugging Face tokenizer directory (vllm_sim.tokenizer_dir builds one): prompts are
    # rendered and tokenized as vLLM would (vllm_sim.hf_tokenizer) instead of by the
    # built-in stand-in. vLLM's own flag is --tokenizer too.
    tokenizer: str | None = None
    faults: Faults = field(default_factory=Faults)
    # Reported in the ``x-sim-replica`` header of every response.
    name: str = "sim"
    # Seeds the fault dice so a faulty run can be replayed.
    seed: int = 0
    # Block hash: the simulator's own (fast), or vLLM's sha256_cbor reproduced exactly
    # (``--prefix-caching-hash-algo sha256_cbor``), seeded as vLLM seeds it: hash_seed,
    # else PYTHONHASHSEED, else vLLM's fixed default (vllm_sim.vllm_hash).
    kv_hash: Literal["sim", "sha256_cbor"] = "sim"
    hash_seed: str | None = None
    # Publish KV events as vLLM's --kv-events-config does (vllm_sim.kv_events):
    # PUB endpoint, e.g. "tcp://*:5557", and the replay ROUTER endpoint.
    kv_events: str | None = None
    kv_events_replay: str | None = None
    kv_events_topic: str = "kv-events"
    kv_events_buffer: int = 10_000
    # 64-bit hashes on the wire (vLLM's default), else the 32-byte digests.
    kv_events_int_hashes: bool = True
    # Events as arrays (vLLM before PR #42892) instead of tagged maps.
    kv_events_legacy: bool = False
    # P/D disaggregation, vLLM's --kv-transfer-config with NixlConnector (vllm_sim.pd).
    # "both" is vLLM's kv_both: it prefills for a remote decode and loads a remote
    # prefill; "prefill" (kv_producer) refuses to load one, "decode" (kv_consumer)
    # refuses to prefill for one. Every role serves plain requests, as vLLM does.
    role: Literal["both", "prefill", "decode"] = "both"
    # vLLM's kv_transfer_config.engine_id; None: a fresh uuid4, as vLLM draws one.
    engine_id: str | None = None
    # Where peers reach this replica's side channel (vLLM's VLLM_NIXL_SIDE_CHANNEL_HOST and
    # _PORT): the simulator serves it on its own HTTP port, so None means host and port.
    side_channel_host: str | None = None
    side_channel_port: int | None = None
    # vLLM's kv_transfer_config extra key kv_lease_duration (30 s): how long a prefill
    # keeps a finished request's blocks for a decode to pull, scaled by time_scale.
    kv_lease_s: float = 30.0
    # vLLM's kv_transfer_config.kv_load_failure_policy: a failed pull fails the request
    # ("fail", vLLM's default: HTTP 500) or is prefilled locally instead ("recompute").
    kv_load_failure_policy: Literal["fail", "recompute"] = "fail"

    def __post_init__(self) -> None:
        if self.num_gpu_blocks < 1 or self.block_size < 1:
            raise ValueError("num_gpu_blocks and block_size must be >= 1")
        if self.max_model_len < 1 or self.embedding_dim < 1:
            raise ValueError("max_model_len and embedding_dim must be >= 1")
        if self.scheduling_policy not in POLICIES:
            raise ValueError(f"Unknown scheduling policy: {self.scheduling_policy}")
        self.faults.validate()
        if self.role not in ("both", "prefill", "decode"):
            raise ValueError(f"Unknown role: {self.role}")
        if self.kv_load_failure_policy not in ("fail", "recompute"):
            raise ValueError(f"Unknown kv_load_failure_policy: {self.kv_load_failure_policy}")
        if not self.kv_lease_s > 0:
            raise ValueError("kv_lease_s must be > 0")

    @property
    def models(self) -> tuple[str, ...]:
        """Every name a request may give: the served names, then the adapters'."""
        return (self.model, *self.extra_models, *(name for name, _ in self.lora_modules))

    def lora(self, model: str) -> tuple[str, str] | None:
        """The adapter a model name selects, or None for a base model name."""
        return next(((n, p) for n, p in self.lora_modules if n == model), None)
