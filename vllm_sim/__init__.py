"""vllm_sim: a vLLM-compatible replica simulator, the fake every kvgate test and benchmark uses.

Layers, each usable on its own:

- pure building blocks, for in-process discrete-event benchmarks:
  ``tokenizer`` (text -> ids), ``template`` (chat -> prompt text),
  ``kv`` (chained block hashes, an LRU prefix-cached block pool),
  ``timing`` (step durations);
- ``engine``: continuous batching over those blocks in scaled real time (asyncio);
- ``server``: vLLM's OpenAI endpoints, ``/metrics`` and a ``/sim/*`` control plane
  (faults, stats, reset) over one engine;
- ``cli`` / ``__main__`` / ``process``: run it as a process;
- ``pd``: vLLM's P/D disaggregation (NixlConnector, pull mode) between replicas in
  prefill and decode roles (``--role``), the KV pulled over a side channel.

The simulator deliberately shares no code with kvgate (its hashing is blake2b and
crc32, not xxhash), so the gateway cannot pass a test by agreeing with itself.
Nothing here keeps module-level mutable state: everything lives in the objects
``build_app`` creates, so several replicas can share one process.
"""

from vllm_sim.config import SimConfig
from vllm_sim.faults import Faults
from vllm_sim.kv import Allocation, KVPool, block_hashes
from vllm_sim.template import render_chat
from vllm_sim.timing import TimingModel
from vllm_sim.tokenizer import count_tokens, tokenize

__all__ = [
    "Allocation",
    "Faults",
    "KVPool",
    "SimConfig",
    "TimingModel",
    "block_hashes",
    "count_tokens",
    "render_chat",
    "tokenize",
]
