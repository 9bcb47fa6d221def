"""A seeded mix of requests through a routing policy, printed as its decisions (one process each).

    python -m tests.support.decisions SEED N [POLICY]     # prefix_affinity (the default) or ttft

Conversations growing turn by turn behind shared and per-organisation system
prompts, flat completions prompts, Anthropic breakpoints and boundary markers,
tool lists, the Messages protocol; replicas that report queues; requests held
for random times, some failing; two instances, one of them told the other's
facts (``share_index``). For ``ttft``, replicas also report prefill rates and
pool sizes and have known seats or not, replies report cached tokens, a first
token's time and the tokens generated, and streams their first tokens (what it learns from), all drawn
from a second generator so that ``prefix_affinity``'s sequence, and its
decisions' digest in the docs, stay as they were. Run by
``tests/test_routing_native.py`` once compiled and once interpreted
(``KVGATE_INTERPRETED=1``): the outputs must be equal.
"""

from __future__ import annotations

import random
import sys
from typing import Any

from routing import RouteFeedback, RouteRequest, RoutingSettings
from routing.prefix_affinity import PrefixAffinity
from routing.ttft_affinity import TTFTAffinity

from bench.routing_sim import SimView
from tests.support.clock import Clock

MARKER = RoutingSettings().boundary_marker


def _request(rng: random.Random, convs: dict[int, int]) -> RouteRequest:
    kind = rng.random()
    org = rng.randrange(5)
    system = f"Organisation {org} handbook, section {org}. " * rng.choice((4, 40, 400))
    if kind < 0.1:  # a flat prompt, growing by appending
        c = rng.randrange(30)
        convs[c] = convs.get(c, 0) + 1
        prompt = system + "".join(f" turn {c}.{t} " * 20 for t in range(convs[c]))
        return RouteRequest("completions", "m", "t", {"model": "m", "prompt": prompt})
    c = rng.randrange(60)
    turns = convs[c] = convs.get(c, 0) + 1
    messages: list[dict[str, object]] = [{"role": "system", "content": system}]
    if kind < 0.2:  # a breakpoint after the system prompt, Anthropic style
        messages = [{"role": "system", "content": [{"type": "text", "text": system,
                                                     "cache_control": {"type": "ephemeral"}}]}]
    elif kind < 0.25:
        messages[0]["content"] = system + MARKER + f" user {c} profile"
    messages.append({"role": "user", "content": f"conversation {c}: " + "question " * rng.randrange(1, 60)})
    for t in range(1, turns):
        messages += [{"role": "assistant", "content": f"answer {t}"}, {"role": "user", "content": f"more {t}"}]
    body: dict[str, object] = {"model": "m", "messages": messages}
    if kind > 0.9:
        body["tools"] = [{"type": "function", "function": {"name": f"tool{org}", "parameters": {}}}]
    if kind > 0.95:
        return RouteRequest("messages", "m", "a", {"model": "m", "max_tokens": 8, "system": system,
                                                   "messages": messages[1:]})
    return RouteRequest("chat", "m", rng.choice(("t", "u")), body, boundary_hint=rng.choice((None, None, "1")))


POLICIES = {"prefix_affinity": PrefixAffinity, "ttft": TTFTAffinity}


def run(seed: int, n: int, policy: str = "prefix_affinity") -> list[str]:
    rng, learnt = random.Random(seed), random.Random(seed + 1) if policy == "ttft" else None
    clock = Clock()
    make = POLICIES[policy]
    policies: list[Any] = [make(RoutingSettings(share_index=True), clock), make(RoutingSettings(), clock)]
    fleets = [[SimView(f"r{i}", weight=1.0 + (i == 2)) for i in range(5)] for _ in policies]
    held: list[tuple[int, RouteRequest, SimView]] = []
    convs: dict[int, int] = {}
    out = []
    for step in range(n):
        clock.t += rng.random() * 0.05
        if held and (rng.random() < 0.45 or len(held) > 30):
            p, request, replica = held.pop(rng.randrange(len(held)))
            replica.in_flight -= 1
            ok = rng.random() > 0.05
            prompt = learnt.randrange(100, 4000) if learnt else None
            policies[p].observe(request, RouteFeedback(
                replica.name, prompt, learnt.randrange(prompt) if learnt and prompt else None, ok,
                ttft_s=learnt.random() * 0.2 if learnt else None,
                completion_tokens=learnt.randrange(1, 2000) if learnt else None))
            continue
        if step % 50 == 0:
            for fleet in fleets:  # a scrape: every replica reports its queue
                for r in fleet:
                    r.running, r.waiting = float(rng.randrange(6)), float(rng.randrange(3))
                    if learnt:
                        r.prefill_rate = learnt.choice((5000.0, 10000.0))
                        r.kv_tokens = float(learnt.randrange(20_000, 80_000))
                        r.seats = learnt.choice((None, 4.0, 8.0))
                    r.in_flight_at_scrape = r.in_flight
        if learnt and held and learnt.random() < 0.3:  # a held request's first token (ttft's seat hold)
            q, started, where = held[learnt.randrange(len(held))]
            policies[q].started(started, where.name)
        p = rng.randrange(2)
        request = _request(rng, convs)
        order = policies[p].prefer(request, fleets[p])
        order[0].in_flight += 1
        held.append((p, request, order[0]))
        out.append(f"{p} {' '.join(r.name for r in order)}")
        if policies[0].gossip is not None:  # instance 0's facts reach instance 1
            for fact in policies[0].gossip.drain():
                policies[1].learn_remote(fact)
    return out


if __name__ == "__main__":
    print("\n".join(run(int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:4])))
