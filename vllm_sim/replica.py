"""Everything one simulated replica owns, built once per app: no module-level state anywhere.

Several replicas can live in one process (one app each), which is how tests
run a fleet of fakes on one event loop.
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from vllm_sim.config import SimConfig
from vllm_sim.engine import Engine
from vllm_sim.faults import Faults, Verdict, decide
from vllm_sim.kv import Hasher, KVPool
from vllm_sim.kv_events import KVEventPublisher
from vllm_sim.pd import PD
from vllm_sim.stats import EngineStats

__all__ = ["Replica"]

if TYPE_CHECKING:
    from vllm_sim.hf_tokenizer import HFPrompts


class Replica:
    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.pool = KVPool(config.num_gpu_blocks, config.block_size, events=bool(config.kv_events),
                           hasher=_hasher(config))
        self.engine = Engine(self.pool, config.timing, policy=config.scheduling_policy)
        # P/D disaggregation (vllm_sim.pd): blocks held for decodes, pulls from prefills.
        self.pd = PD(config, self.pool, config.timing)
        self.publisher: KVEventPublisher | None = None
        if config.kv_events:
            self.publisher = KVEventPublisher(
                config.kv_events, config.kv_events_replay, block_size=config.block_size,
                topic=config.kv_events_topic, buffer_steps=config.kv_events_buffer,
                int_hashes=config.kv_events_int_hashes, legacy=config.kv_events_legacy,
                drop=lambda: self.faults.kv_events_drop, delay=lambda: self.faults.kv_events_delay_s)
            self.engine.on_kv_events = self.publisher.publish
        # A copy: run-time changes (POST /sim/faults) must not write back into the caller's config.
        self.faults: Faults = replace(config.faults)
        self.rng = random.Random(config.seed)
        # API requests received (generation and embeddings), faulted or invalid included:
        # what a test counts to check that a gateway retried, or never forwarded.
        self.http_requests = 0
        self.renders = 0
        self.faulted: dict[str, int] = {}
        # The real tokenizer when configured (seconds to load: once, here), else the stand-in.
        self.prompts: HFPrompts | None = None
        if config.tokenizer:
            from vllm_sim.hf_tokenizer import HFPrompts

            self.prompts = HFPrompts(config.tokenizer)

    def roll_faults(self) -> tuple[Faults, Verdict]:
        """Count an API request and decide its whole-response fault, with the faults in force now.

        The returned ``Faults`` is the request's snapshot: POST /sim/faults replaces the
        object rather than mutating it, so a request in flight keeps a consistent set.
        """
        self.http_requests += 1
        faults = self.faults
        verdict = decide(faults, self.rng)
        if verdict is not None:
            self.faulted[verdict] = self.faulted.get(verdict, 0) + 1
        return faults, verdict

    def reset(self) -> None:
        """Forget cached blocks and counters (POST /sim/reset); running requests keep their blocks."""
        self.pool.clear()
        self.engine.publish_kv_events()
        self.engine.stats = EngineStats()
        self.pd.reset_stats()
        self.http_requests = 0
        self.renders = 0
        self.faulted = {}

    def close(self) -> None:
        """Release the event sockets (app shutdown), so a restarted replica can bind them again."""
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None

    def stats(self) -> dict[str, Any]:
        engine, pool = self.engine, self.pool
        return {
            **engine.stats.as_dict(),
            # Every API request received, faulted or invalid included: "did it reach the replica?"
            "requests": self.http_requests,
            # Those that got as far as the engine.
            "engine_requests": engine.stats.requests,
            # Render requests answered (a router tokenizing through this replica), not in engine_requests.
            "renders": self.renders,
            "faulted": dict(self.faulted),
            "running": engine.num_running,
            "waiting": engine.num_waiting,
            "prefix_cache_queries_tokens": pool.queries_tokens,
            "prefix_cache_hits_tokens": pool.hits_tokens,
            "kv_cache_usage_perc": pool.usage,
            "num_cached_blocks": pool.num_cached_blocks,
            "num_gpu_blocks": pool.num_blocks,
            "block_size": pool.block_size,
            "name": self.config.name,
            "kv_events_published": self.publisher.published if self.publisher else 0,
            "kv_events_dropped": self.publisher.dropped if self.publisher else 0,
            "kv_events_pending": self.publisher.pending if self.publisher else 0,
            "role": self.config.role,
            "engine_id": self.pd.engine_id,
            "kv_held_requests": self.pd.held_requests,
            "kv_transfer": self.pd.stats.as_dict(),
        }


def _hasher(config: SimConfig) -> Hasher | None:
    if config.kv_hash != "sha256_cbor":
        return None
    from vllm_sim.vllm_hash import vllm_block_hashes

    seed = config.hash_seed

    def hasher(token_ids: Any, block_size: int, salt: str | None, lora: tuple[str, str] | None) -> list[bytes]:
        return vllm_block_hashes(token_ids, block_size, salt, seed, lora)

    return hasher
