"""All-unique prompts: nothing to reuse, so routing can only balance load.

Single-turn chat requests of 500 to 4,000 tokens that share nothing (not even
a system prompt), 50 to 400 output tokens, Poisson arrivals. kvgate must not
lose to least-load here.
"""

from __future__ import annotations

import random

from vllm_sim.kv import block_hashes

from . import Request, Workload
from .text import TextBank, TokenCache, chat_tokens

__all__ = ["build"]


def build(n_requests: int = 1500, rate: float = 1.0, seed: int = 4) -> Workload:
    rng = random.Random(seed)
    bank, cache = TextBank(seed, memo=64), TokenCache(64)
    requests: list[Request] = []
    t = 0.0
    for rid in range(n_requests):
        t += rng.expovariate(rate)
        name, size = f"uniq:{rid}", rng.randint(500, 4000)
        ids = chat_tokens(cache, [("user", [bank.paragraph_ids(name, size)])])

        def body(name: str = name, size: int = size) -> dict:
            return {"model": "uniq-model", "messages": [{"role": "user", "content": bank.paragraph(name, size)}]}

        requests.append(Request(
            rid=rid, endpoint="chat", model="uniq-model", namespace="app", build=body,
            prompt_tokens=len(ids), output_tokens=rng.randint(50, 400), kv_hashes=block_hashes(ids), arrival=t,
        ))
    return Workload("unique", requests, f"all-unique prompts: {n_requests} requests of 500-4,000 tokens")
