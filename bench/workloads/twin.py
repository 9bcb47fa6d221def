"""The seeds' digital-twin layout: stable layers first, then 10-12K tokens of dynamic tail.

Per request (about 34K prompt tokens, as in the background article):

    system:  GLOBAL 4K | ORGANISATION 7K | AGENT 3K | TOOLS 6K | ROLE + PROFILE 3K   (23K stable)
    user:    MEMORY 1.5K | RETRIEVED DOCUMENTS 8-10K | current time + request id | question

Global is shared by every request; an organisation's policies by its twins;
the agent definition by twins of one type in one organisation; the tool
schemas by twins of one type (but, coming after the organisation, reusable
only within it); role and profile by one twin. The tail is unique to the
request (the time line and retrieved chunks differ each time). Twins are
picked with a Zipf(0.6) popularity, so a few twins are hot; arrivals are
Poisson. No client boundary hint is sent: kvgate must find the structure.
"""

from __future__ import annotations

import random

from vllm_sim.kv import block_hashes

from . import Interner, Request, Workload
from .text import TextBank, TokenCache, chat_tokens

__all__ = ["build"]

LAYERS = (("global", 4000), ("org", 7000), ("agent", 3000), ("tools", 6000), ("profile", 3000))
Spec = tuple[str, "int | str"]  # (segment name, token count) or (name, literal text)


def _system(twin: tuple[int, int, int]) -> list[Spec]:
    o, t, i = twin
    keys = {"global": "g", "org": f"o{o}", "agent": f"a{o}.{t}", "tools": f"t{t}", "profile": f"p{o}.{t}.{i}"}
    return [(f"twin:{layer}:{keys[layer]}", size) for layer, size in LAYERS]


def _tail(rng: random.Random, rid: int, twin: tuple[int, int, int]) -> list[Spec]:
    o, t, i = twin
    parts: list[Spec] = [(f"twin:mem:{o}.{t}.{i}:{rng.randrange(4)}", 1500)]
    parts += [(f"twin:doc:{rng.randrange(3000)}", 500) for _ in range(rng.randint(16, 20))]
    parts.append((f"twin:now:{rid}", f"Current time {rid // 60:02d}h{rid % 60:02d} request r{rid:06d}\n"))
    parts.append((f"twin:q:{rid}", rng.randint(40, 120)))
    return parts


def _text(bank: TextBank, spec: Spec) -> str:
    name, size = spec
    return size if isinstance(size, str) else bank.paragraph(name, size)


def _ids(bank: TextBank, cache: TokenCache, spec: Spec) -> list[int]:
    name, size = spec
    return cache.get(name, size) if isinstance(size, str) else bank.paragraph_ids(name, size)


def _builder(bank: TextBank, system: list[Spec], tail: list[Spec]):
    def body() -> dict:
        return {"model": "twin-model", "messages": [
            {"role": "system", "content": "".join(_text(bank, s) for s in system)},
            {"role": "user", "content": "".join(_text(bank, s) for s in tail)}]}
    return body


def build(
    n_requests: int = 1200, rate: float = 4.0, orgs: int = 12, types: int = 3, per_type: int = 10,
    seed: int = 1, zipf: float = 0.6,
) -> Workload:
    rng = random.Random(seed)
    bank, cache, intern = TextBank(seed), TokenCache(1 << 14), Interner()
    twins = [(o, t, i) for o in range(orgs) for t in range(types) for i in range(per_type)]
    rng.shuffle(twins)  # popularity rank independent of organisation
    weights = [1.0 / (k + 1) ** zipf for k in range(len(twins))]
    requests: list[Request] = []
    t = 0.0
    for rid in range(n_requests):
        t += rng.expovariate(rate)
        twin = rng.choices(twins, weights)[0]
        system, tail = _system(twin), _tail(rng, rid, twin)
        ids = chat_tokens(cache, [("system", [_ids(bank, cache, s) for s in system]),
                                  ("user", [_ids(bank, cache, s) for s in tail])])
        requests.append(Request(
            rid=rid, endpoint="chat", model="twin-model", namespace="twins",
            build=_builder(bank, system, tail), prompt_tokens=len(ids),
            output_tokens=rng.randint(100, 300), kv_hashes=intern(block_hashes(ids)), arrival=t,
        ))
    return Workload("twin", requests, f"digital twins: {len(twins)} twins in {orgs} orgs, "
                    f"{n_requests} requests at {rate:g}/s, ~34K-token prompts")
