"""Each replica's KV pool, sized from the workload: pools under pressure in every routing benchmark.

Real fleets run with their pools full: an 8B model on an 80 GB GPU holds
about 400K tokens of KV, a dozen 35K-token prompts. A benchmark whose pools
never evict cannot tell a router that keeps each prefix in one place from one
that copies it everywhere. So ``bench.routing_suite``, ``bench.routing`` and
``bench.routing_e2e`` size every replica's pool from the workload itself
(``pool_size``), all three with this one function:

* the **reused working set**: the tokens of the distinct KV blocks
  (``Request.kv_hashes``, ``block_size`` tokens each) that at least two
  requests reference, the only blocks a prefix cache can ever hit on;
* the fleet's pools together hold ``ratio`` times it (``--pool-ratio``,
  default 2.0; meant for 1.5-3): per replica ``ratio x working set /
  replicas``, rounded up to whole blocks;
* floored so that one replica can always run what it must at once:
  ``concurrency`` of the largest request's prompt and output
  (``floor_concurrency``);
* an explicit size (``--kv-tokens``) overrides all of it.

A router that puts each reused prefix on one replica then keeps all of them
warm with room to spare; one that copies every prefix onto every replica
needs ``replicas / ratio`` times the room it has, and evicts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .workloads import Workload

__all__ = ["DEFAULT_RATIO", "RATIO_RANGE", "PoolSize", "reused_working_set", "floor_concurrency", "pool_size"]

DEFAULT_RATIO = 2.0
RATIO_RANGE = (1.5, 3.0)  # documented; not enforced (a study may go outside it)


@dataclass(frozen=True, slots=True)
class PoolSize:
    """One replica's KV pool and where it came from."""

    kv_tokens: int  # per replica: a whole number of blocks, unless given (--kv-tokens)
    working_set: int  # reused working set, tokens
    ratio: float
    replicas: int
    floor: int  # the per-replica floor, tokens
    overridden: bool = False  # an explicit size (--kv-tokens) was given
    block_size: int = 16

    @property
    def blocks(self) -> int:
        """Whole blocks, as the simulator and ``vllm_sim --kv-blocks`` count the pool."""
        return self.kv_tokens // self.block_size

    def describe(self) -> str:
        """The header line the benchmark tables print."""
        ws = f"reused working set {self.working_set:,} tokens"
        if self.overridden:
            return f"KV pool per replica {self.kv_tokens:,} tokens (--kv-tokens); {ws}"
        floored = " (the floor)" if self.kv_tokens == self.floor else ""
        return (f"KV pool per replica {self.kv_tokens:,} tokens{floored}: {self.ratio:g} x {ws} / "
                f"{self.replicas} replicas, floor {self.floor:,}")


def reused_working_set(w: Workload, block_size: int = 16) -> int:
    """Tokens of the distinct KV blocks that at least two requests of ``w`` reference."""
    seen: set[bytes] = set()
    reused: set[bytes] = set()
    for r in w.requests:
        hashes = set(r.kv_hashes)
        reused |= hashes & seen
        seen |= hashes
    return len(reused) * block_size


def floor_concurrency(replicas: int, clients: int = 0) -> int:
    """How many of the largest request a replica's pool must hold at once.

    The simulator's scheduler (``bench.routing_sim.SimEngine._admit``, vLLM's
    without preemption) admits a waiting request only when blocks for its
    whole prompt and output are free beside the running requests'. A pool that
    holds one request at a time runs them one after another whatever the
    router does, so its hit ratio and tail would measure memory, not routing.
    Two is the least that lets a replica prefill the next request while one
    decodes; a closed loop keeps ``clients / replicas`` requests per replica in
    flight on average, so where that is more, the pool holds that many.
    """
    per_replica = math.ceil(clients / replicas) if clients and replicas else 0
    return max(2, per_replica)


def pool_size(w: Workload, replicas: int, ratio: float = DEFAULT_RATIO, *, clients: int = 0,
              kv_tokens: int = 0, block_size: int = 16, max_output: int | None = None) -> PoolSize:
    """Each of ``replicas`` replicas' KV pool for ``w``: ``ratio`` x reused working set / replicas, floored.

    ``clients``: a closed loop's clients (0: open loop), for the floor's
    concurrency; ``kv_tokens`` > 0 overrides the size; ``max_output`` caps each
    request's output tokens as the client sends it (``bench.routing_e2e``
    caps ``max_tokens``), for the floor.
    """
    if replicas < 1:
        raise ValueError("replicas must be >= 1")
    if ratio <= 0:
        raise ValueError("ratio must be > 0")
    working = reused_working_set(w, block_size)
    largest = max((r.prompt_tokens + (r.output_tokens if max_output is None else min(r.output_tokens, max_output))
                   for r in w.requests), default=0)
    floor = _whole_blocks(floor_concurrency(replicas, clients) * largest, block_size)
    if kv_tokens > 0:
        return PoolSize(kv_tokens, working, ratio, replicas, floor, True, block_size)
    share = _whole_blocks(math.ceil(ratio * working / replicas), block_size)
    return PoolSize(max(share, floor, block_size), working, ratio, replicas, floor, False, block_size)


def _whole_blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size) * block_size
