"""The simulator's one settings object, built once by the CLI or a test and read by ``build_app``."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_sim.faults import Faults
from vllm_sim.timing import TimingModel

__all__ = ["SimConfig"]


@dataclass(slots=True)
class SimConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # Served model names; the first is the primary (vLLM's --served-model-name accepts several).
    model: str = "sim-model"
    extra_models: tuple[str, ...] = ()
    num_gpu_blocks: int = 8192
    block_size: int = 16
    max_model_len: int = 32768
    timing: TimingModel = field(default_factory=TimingModel)
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

    def __post_init__(self) -> None:
        if self.num_gpu_blocks < 1 or self.block_size < 1:
            raise ValueError("num_gpu_blocks and block_size must be >= 1")
        if self.max_model_len < 1 or self.embedding_dim < 1:
            raise ValueError("max_model_len and embedding_dim must be >= 1")
        self.faults.validate()

    @property
    def models(self) -> tuple[str, ...]:
        return (self.model, *self.extra_models)
