"""How long engine steps take: the one place the simulator's latency model lives.

The shape, not the constants, is what routing experiments depend on: prefill
cost is linear in the tokens not served from the prefix cache (so a cache hit
shortens time to first token), and a decode step gets slower as the batch
grows (so piling requests on one replica hurts everyone on it).
``time_scale`` multiplies every duration: 0.01 runs 100x faster than real
time, 0 never sleeps at all. ``prefill_speed`` divides prefill alone (base and
per-token cost): 0.5 is a replica that prefills at half speed, for fleets of
unequal replicas; decode is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TimingModel"]


@dataclass(slots=True)
class TimingModel:
    prefill_base_s: float = 0.004
    prefill_s_per_token: float = 1 / 15000
    decode_base_s: float = 0.010
    decode_s_per_seq: float = 0.0002
    max_num_seqs: int = 64
    # vLLM's --max-num-batched-tokens: the tokens one step schedules, a long prompt chunked over
    # several (vllm_sim.engine). None: every prompt whole in the step that admits it. vLLM's
    # default is 2048 on most GPUs and 8192 from 70 GB (EngineArgs._set_default_args).
    max_num_batched_tokens: int | None = None
    time_scale: float = 1.0
    prefill_speed: float = 1.0
    # P/D: seconds per prompt token a decode replica waits while it pulls KV from a
    # prefill replica (vllm_sim.pd); only the tokens it does not hold itself move.
    kv_transfer_s_per_token: float = 0.0

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.max_num_seqs:
            # vLLM refuses it too (SchedulerConfig): every seat must get its decode token.
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs")
        if min(self.prefill_base_s, self.prefill_s_per_token, self.decode_base_s, self.decode_s_per_seq,
               self.kv_transfer_s_per_token) < 0:
            raise ValueError("durations must be >= 0")
        if self.time_scale < 0:
            raise ValueError("time_scale must be >= 0")
        if not self.prefill_speed > 0:
            raise ValueError("prefill_speed must be > 0")

    def prefill_time(self, uncached_tokens: int) -> float:
        """Scaled seconds to prefill ``uncached_tokens`` prompt tokens in one step."""
        # x / 1.0 is x exactly: at full speed the figures are those without the factor.
        return (self.prefill_base_s + self.prefill_s_per_token * uncached_tokens) / self.prefill_speed * self.time_scale

    def transfer_time(self, tokens: int) -> float:
        """Scaled seconds to pull ``tokens`` prompt tokens' KV from a prefill replica."""
        return self.kv_transfer_s_per_token * tokens * self.time_scale

    def decode_step_time(self, batch_size: int) -> float:
        """Scaled seconds for one decode step of ``batch_size`` running sequences."""
        return (self.decode_base_s + self.decode_s_per_seq * batch_size) * self.time_scale
