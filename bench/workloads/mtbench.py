"""Multi-turn chat from MT-Bench-101: real user and assistant text, closed-loop turns.

Each dialogue becomes one request per user turn: the prompt is a shared
application system prompt (about 400 tokens, the usual deployment; every
request carries it) plus the dialogue so far; the expected output is the
recorded assistant answer. Dialogues start as a Poisson process; turn k+1 is
sent a think time (exponential, mean ``think_s``) after turn k completes.
"""

from __future__ import annotations

import json
import random
from typing import Callable
from pathlib import Path

from vllm_sim.kv import block_hashes
from vllm_sim.template import render_chat
from vllm_sim.tokenizer import count_tokens

from . import Interner, Request, Workload
from .text import TextBank, TokenCache

__all__ = ["build"]

FILE = "conversations/mtbench101_conversations.jsonl"


def _load(data: Path, limit: int | None) -> list[list[dict]]:
    dialogues = []
    with open(data / FILE) as fh:
        for line in fh:
            messages = json.loads(line)["messages"]
            if messages and messages[0]["role"] == "user":
                dialogues.append(messages)
            if limit is not None and len(dialogues) >= limit:
                break
    return dialogues


def _chat_body(convo: list[dict]) -> Callable[[], dict]:
    return lambda: {"model": "chat-model", "messages": convo}


def build(data: Path, rate: float = 1.0, think_s: float = 10.0, limit: int | None = None,
          seed: int = 2) -> Workload:
    rng = random.Random(seed)
    bank, cache, intern = TextBank(seed), TokenCache(1 << 15), Interner()
    system = {"role": "system", "content": bank.paragraph("mt:system", 400)}
    sys_ids = cache.get("mt:system", render_chat([system], add_generation_prompt=False))
    gen_ids = cache.get("<gen>", render_chat([], add_generation_prompt=True))
    requests: list[Request] = []
    start = 0.0
    for d, messages in enumerate(_load(data, limit)):
        start += rng.expovariate(rate)
        prev: int | None = None
        ids = list(sys_ids)
        for k, message in enumerate(messages):
            ids += cache.get(f"mt:{d}:{k}", render_chat([message], add_generation_prompt=False))
            if message["role"] != "user":
                continue
            answer = messages[k + 1]["content"] if k + 1 < len(messages) else ""
            prompt = ids + gen_ids
            convo = [system, *messages[: k + 1]]
            rid = len(requests)
            requests.append(Request(
                rid=rid, endpoint="chat", model="chat-model", namespace="app",
                build=_chat_body(convo),
                prompt_tokens=len(prompt), output_tokens=max(8, count_tokens(answer)),
                kv_hashes=intern(block_hashes(prompt)),
                arrival=start if prev is None else rng.expovariate(1.0 / think_s),
                after=prev, prev=prev,
            ))
            prev = rid
    n_conv = sum(1 for r in requests if r.prev is None)
    return Workload("mtbench", requests, f"MT-Bench-101: {n_conv} dialogues, {len(requests)} turns, "
                    f"closed loop (think {think_s:g}s), shared 400-token system prompt")
