"""SGLang's generated-shared-prefix benchmark: groups of prompts sharing a long system prompt.

As in ``sglang.bench_serving --dataset-name generated-shared-prefix``: 64
groups, a 2,048-token system prompt per group, a 128-token question, 256
output tokens; requests shuffled, Poisson arrivals. SGLang's default is 16
prompts per group; the benchmark uses 48 so the run lasts long enough (about
two minutes of simulated time) for load averages to matter.
"""

from __future__ import annotations

import random
from typing import Callable

from vllm_sim.kv import block_hashes

from . import Interner, Request, Workload
from .text import TextBank, TokenCache, chat_tokens

__all__ = ["build"]


def _constant(body: dict) -> Callable[[], dict]:
    return lambda: body


def build(groups: int = 64, per_group: int = 16, system_tokens: int = 2048, question_tokens: int = 128,
          output_tokens: int = 256, rate: float = 1.0, seed: int = 3) -> Workload:
    rng = random.Random(seed)
    bank, cache, intern = TextBank(seed), TokenCache(1 << 14), Interner()
    pairs = [(g, q) for g in range(groups) for q in range(per_group)]
    rng.shuffle(pairs)
    requests: list[Request] = []
    t = 0.0
    for rid, (g, q) in enumerate(pairs):
        t += rng.expovariate(rate)
        sys_name, q_name = f"gsp:sys:{g}", f"gsp:q:{g}:{q}"
        system, question = bank.paragraph(sys_name, system_tokens), bank.paragraph(q_name, question_tokens)
        ids = chat_tokens(cache, [("system", [bank.paragraph_ids(sys_name, system_tokens)]),
                                  ("user", [bank.paragraph_ids(q_name, question_tokens)])])
        body = {"model": "gsp-model", "messages": [
            {"role": "system", "content": system}, {"role": "user", "content": question}]}
        requests.append(Request(
            rid=rid, endpoint="chat", model="gsp-model", namespace="app", build=_constant(body),
            prompt_tokens=len(ids), output_tokens=output_tokens, kv_hashes=intern(block_hashes(ids)), arrival=t,
        ))
    return Workload("shared_prefix", requests, f"generated shared prefix: {groups} groups x {per_group} prompts, "
                    f"{system_tokens}-token system prompts, {question_tokens}-token questions")
