"""Generated organisation-layered chat workloads: a family of shapes, one draw per seed. Reporting only.

Nothing in ``routing/`` is tuned on these (``bench.routing``'s workloads are
the tuning set; ``bench.routing_suite`` reports this one). A ``Family`` fixes
the kind of traffic (fleet size, arrival process, run length, whether there
are exactly as many heavy organisations as replicas); the seed draws
everything else (``Layout``):

    system:  GLOBAL | ORGANISATION | USER PROFILE     (one system message)
    turns:   user 1 | assistant 1 | user 2 | ...      (a conversation, one request per user turn)

* layer sizes: the global prompt 50-3,000 tokens, organisation layers around
  a per-seed size of 300-8,000 (each organisation 0.5-1.5x it), profiles
  20-1,500, questions 10-400, answers 10-400 (log-uniform draws);
* organisations: 0.5-4 per replica, Zipf popularity of a per-seed exponent;
  in a ``heavy`` family exactly as many heavy organisations as replicas carry
  70-95% of the traffic, the rest spread over 0-1 light ones per replica;
* users per organisation 2-40 (Zipf), turns per conversation 1..max (per seed).

Organisation-layered families (``orgs_per_replica`` set: 1, 2, 4 or 8
organisations per replica) are single-turn requests whose prompt is layered
as a digital twin's (``twin.py``), every size drawn per seed (``LayeredLayout``):

    system:  GLOBAL | ORGANISATION | AGENT | TOOLS | PERSON    (one system message)
    user:    RETRIEVED TAIL | question                        (unique to the request)

* the global prompt 300-4,000 tokens; organisation layers around a per-seed
  size of 1,000-7,000 (each 0.5-1.5x it); 1-3 agents per organisation, each
  with its own definition (around 300-3,000) and the tool schemas of its
  type (around 500-6,000; the same for agent k of every organisation, but
  coming after the organisation, shared only within it); 2-30 persons per
  organisation (Zipf within it), profiles 50-2,000; a retrieved tail of
  200-6,000 tokens and a question of 10-200;
* organisation traffic skewed: Zipf over the organisations, exponent 0.6-1.2
  per seed, so some are several times heavier than others.

Each replica's KV pool is not part of the draw: the benchmarks size it from
the workload (``bench.pools``).

Open-loop families start conversations as a Poisson process (the benchmark
rescales it to a fleet load) with follow-up turns a think time after the
previous answer; closed-loop families are replayed by a fixed number of
clients (``ClosedLoop``), optionally in bursts. Prompts are real text from
``TextBank``, so the same requests run through a real kvgate
(``bench.routing_e2e``) and the simulator alike.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from vllm_sim.kv import block_hashes

from . import ClosedLoop, Interner, Request, Workload
from .text import TextBank, TokenCache, chat_tokens

__all__ = ["Family", "Layout", "LayeredLayout", "FAMILIES", "LAYERED", "layout", "layered_layout", "build"]


@dataclass(frozen=True)
class Family:
    name: str
    replicas: int
    seconds: float  # intended simulated run length (the suite sizes the run to it; 0: sized by the caller)
    load: float = 0.7  # open loop: fleet utilisation at the ideal hit ratio
    clients: int = 0  # > 0: closed loop with this many clients
    burst: tuple[float, float] | None = None  # closed loop: (on_s, off_s)
    heavy: bool = False  # exactly ``replicas`` heavy organisations
    max_turns: tuple[int, int] = (1, 4)  # the per-seed maximum turns per conversation is drawn from this
    output: tuple[int, int] = (10, 400)  # answers (output tokens) are clipped to this
    think_s: float = 2.0  # open loop: mean think time before a follow-up turn
    # > 0: organisation-layered single-turn prompts (global > org > agent > tools > person > retrieved tail)
    # with this many organisations per replica.
    orgs_per_replica: int = 0

    @property
    def closed_loop(self) -> ClosedLoop | None:
        if not self.clients:
            return None
        on, off = self.burst or (None, 0.0)
        return ClosedLoop(self.clients, on, off)

    def describe(self) -> str:
        arrival = self.closed_loop.label() if self.closed_loop else f"Poisson open loop at load {self.load:g}"
        heavy = f", {self.replicas} heavy orgs on {self.replicas} replicas" if self.heavy else ""
        if self.orgs_per_replica:
            heavy = (f", {self.orgs_per_replica * self.replicas} orgs (skewed) in layered prompts "
                     "global > org > agent > tools > person > retrieved tail")
        length = f", ~{_duration(self.seconds)} runs" if self.seconds > 0 else ""
        return f"{self.replicas} replicas{heavy}, {arrival}{length}"


def _duration(s: float) -> str:
    return f"{s / 60:g} min" if s >= 60 else f"{s:g} s"


# The suite's families. Reporting only: do not tune routing on these.
FAMILIES: tuple[Family, ...] = (
    # The case: as many heavy organisations as replicas, 8 in flight, a few hundred requests in under 10 s.
    Family("heavy4-closed8", replicas=4, seconds=8, clients=8, heavy=True, max_turns=(1, 2), output=(4, 32)),
    Family("heavy4-burst16", replicas=4, seconds=45, clients=16, burst=(1.0, 2.0), heavy=True, output=(8, 128)),
    Family("heavy8-poisson-5s", replicas=8, seconds=5, load=0.9, heavy=True, output=(8, 128)),
    Family("orgs-poisson-0.5", replicas=4, seconds=60, load=0.5),
    Family("orgs-poisson-0.85", replicas=8, seconds=30, load=0.85),
    Family("chat-closed32", replicas=8, seconds=60, clients=32, max_turns=(2, 6), output=(16, 200)),
    # Long answers keep a 10-minute run to a few thousand requests (the suite's time budget).
    Family("mixed-poisson-10min", replicas=4, seconds=600, load=0.7, output=(300, 1500)),
    # Organisation-layered prompts on 4 replicas: 1, 2, 4 and 8 organisations per replica,
    # a closed loop of 2 clients per replica, and one Poisson variant.
    # (Open loop at 0.6 of the fleet at the ideal hit ratio: under pressure even good routing
    # reuses well below the ideal, and a fleet past saturation measures its queue, not routing.)
    *(Family(f"layered-{4 * k}orgs-closed8", replicas=4, seconds=60, clients=8, output=(8, 64), orgs_per_replica=k)
      for k in (1, 2, 4, 8)),
    Family("layered-8orgs-poisson-0.6", replicas=4, seconds=60, load=0.6, output=(8, 64), orgs_per_replica=2),
)
LAYERED = tuple(f for f in FAMILIES if f.orgs_per_replica)


@dataclass(frozen=True)
class Layout:
    """What one seed draws for a family."""

    global_tokens: int
    org_tokens: tuple[int, ...]
    org_weights: tuple[float, ...]
    heavy_orgs: int
    users: tuple[int, ...]  # users per organisation
    user_zipf: float
    profile: tuple[int, int]
    question: tuple[int, int]
    answer: tuple[int, int]
    max_turns: int


@dataclass(frozen=True)
class LayeredLayout:
    """What one seed draws for an organisation-layered family."""

    global_tokens: int
    org_tokens: tuple[int, ...]
    org_weights: tuple[float, ...]
    agents: tuple[int, ...]  # agents per organisation
    agent_tokens: tuple[tuple[int, ...], ...]  # per organisation, per agent
    tool_tokens: tuple[int, ...]  # per agent type (agent k of every organisation)
    persons: tuple[int, ...]  # per organisation
    person_zipf: float
    profile: tuple[int, int]
    tail: tuple[int, int]
    question: tuple[int, int]
    answer: tuple[int, int]


def _log_uniform(rng: random.Random, lo: float, hi: float) -> float:
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def _range(rng: random.Random, lo: int, hi: int) -> tuple[int, int]:
    """A per-seed size range inside [lo, hi]: a centre drawn log-uniformly, then /2 .. x2 around it."""
    centre = _log_uniform(rng, lo, hi)
    return max(lo, int(centre / 2)), min(hi, max(lo + 1, int(centre * 2)))


def layout(family: Family, seed: int) -> Layout:
    rng = random.Random(f"{family.name}:{seed}")
    n = family.replicas
    if family.heavy:
        light = rng.randint(0, n)
        heavy_share = rng.uniform(0.70, 0.95)
        hw = [rng.uniform(0.7, 1.3) for _ in range(n)]
        lw = [1.0 / (k + 1) for k in range(light)]
        weights = [heavy_share * w / sum(hw) for w in hw]
        weights += [(1 - heavy_share) * w / sum(lw) for w in lw] if light else []
        if not light:
            weights = [w / heavy_share for w in weights]
        heavy = n
    else:
        orgs = max(1, round(rng.choice((0.5, 1.0, 2.0, 4.0)) * n))
        zipf = rng.uniform(0.3, 1.2)
        raw = [1.0 / (k + 1) ** zipf for k in range(orgs)]
        weights, heavy = [w / sum(raw) for w in raw], 0
    org_centre = _log_uniform(rng, 300, 8000)
    out_lo, out_hi = family.output
    answer = _range(rng, 10, 400)
    return Layout(
        global_tokens=int(_log_uniform(rng, 50, 3000)),
        org_tokens=tuple(max(20, int(org_centre * rng.uniform(0.5, 1.5))) for _ in weights),
        org_weights=tuple(weights),
        heavy_orgs=heavy,
        users=tuple(rng.randint(2, 40) for _ in weights),
        user_zipf=rng.uniform(0.5, 1.2),
        profile=_range(rng, 20, 1500),
        question=_range(rng, 10, 400),
        answer=(max(out_lo, min(out_hi, answer[0])), max(out_lo, min(out_hi, answer[1]))),
        max_turns=rng.randint(*family.max_turns),
    )


def layered_layout(family: Family, seed: int) -> LayeredLayout:
    """The draw of an organisation-layered family (``family.orgs_per_replica`` > 0) under ``seed``."""
    if not family.orgs_per_replica:
        raise ValueError(f"{family.name} is not organisation-layered")
    rng = random.Random(f"{family.name}:{seed}:layered")
    orgs = family.orgs_per_replica * family.replicas
    zipf = rng.uniform(0.6, 1.2)
    raw = [1.0 / (k + 1) ** zipf for k in range(orgs)]
    rng.shuffle(raw)  # which organisations are heavy: not the first ones
    org_centre, agent_centre = _log_uniform(rng, 1000, 7000), _log_uniform(rng, 300, 3000)
    agents = tuple(rng.randint(1, 3) for _ in range(orgs))
    tool_centre = _log_uniform(rng, 500, 6000)
    out_lo, out_hi = family.output
    answer = _range(rng, 10, 400)
    return LayeredLayout(
        global_tokens=int(_log_uniform(rng, 300, 4000)),
        org_tokens=tuple(max(20, int(org_centre * rng.uniform(0.5, 1.5))) for _ in range(orgs)),
        org_weights=tuple(w / sum(raw) for w in raw),
        agents=agents,
        agent_tokens=tuple(tuple(max(20, int(agent_centre * rng.uniform(0.5, 1.5))) for _ in range(a))
                           for a in agents),
        tool_tokens=tuple(max(20, int(tool_centre * rng.uniform(0.5, 1.5))) for _ in range(max(agents))),
        persons=tuple(rng.randint(2, 30) for _ in range(orgs)),
        person_zipf=rng.uniform(0.5, 1.2),
        profile=_range(rng, 50, 2000),
        tail=_range(rng, 200, 6000),
        question=_range(rng, 10, 200),
        answer=(max(out_lo, min(out_hi, answer[0])), max(out_lo, min(out_hi, answer[1]))),
    )


def build(family: Family, seed: int, n_requests: int) -> Workload:
    """``n_requests`` requests of ``family`` under ``seed`` (a longer run starts with the same conversations)."""
    if family.orgs_per_replica:
        return _build_layered(family, seed, n_requests)
    lay = layout(family, seed)
    rng = random.Random(f"{family.name}:{seed}:requests")
    bank, cache, intern = TextBank(seed), TokenCache(1 << 12), Interner()
    tag = f"gen{seed}"
    orgs = list(range(len(lay.org_weights)))
    user_weights = {o: [1.0 / (u + 1) ** lay.user_zipf for u in range(lay.users[o])] for o in orgs}
    requests: list[Request] = []
    start, c = 0.0, 0
    while len(requests) < n_requests:
        o = rng.choices(orgs, lay.org_weights)[0]
        u = rng.choices(range(lay.users[o]), user_weights[o])[0]
        system = [(f"{tag}:global", lay.global_tokens), (f"{tag}:org:{o}", lay.org_tokens[o]),
                  (f"{tag}:profile:{o}.{u}", rng.randint(*lay.profile))]
        start += rng.expovariate(1.0)
        turns = rng.randint(1, lay.max_turns)
        history: list[tuple[str, list[tuple[str, int]]]] = [("system", system)]
        prev: int | None = None
        for k in range(min(turns, n_requests - len(requests))):
            history.append(("user", [(f"{tag}:q:{c}.{k}", rng.randint(*lay.question))]))
            answer = rng.randint(*lay.answer)
            ids = chat_tokens(cache, [(role, [bank.paragraph_ids(n, t) for n, t in segs]) for role, segs in history])
            rid = len(requests)
            requests.append(Request(
                rid=rid, endpoint="chat", model="gen-model", namespace="gen", build=_builder(bank, list(history)),
                prompt_tokens=len(ids), output_tokens=answer, kv_hashes=intern(block_hashes(ids)),
                arrival=start if prev is None else rng.expovariate(1.0 / family.think_s), after=prev, prev=prev,
            ))
            history.append(("assistant", [(f"{tag}:a:{c}.{k}", answer)]))
            prev = rid
        c += 1
    heavy = f"{lay.heavy_orgs} heavy of " if lay.heavy_orgs else ""
    return Workload(
        f"{family.name}/s{seed}", requests,
        f"{family.describe()}; {heavy}{len(orgs)} orgs, global {lay.global_tokens} tok, orgs ~{lay.org_tokens[0]} tok, "
        f"up to {lay.max_turns} turns, {n_requests} requests",
        closed_loop=family.closed_loop)


def _build_layered(family: Family, seed: int, n_requests: int) -> Workload:
    lay = layered_layout(family, seed)
    rng = random.Random(f"{family.name}:{seed}:layered-requests")
    bank, cache, intern = TextBank(seed), TokenCache(1 << 12), Interner()
    tag = f"lay{seed}"
    orgs = range(len(lay.org_weights))
    person_weights = {o: [1.0 / (p + 1) ** lay.person_zipf for p in range(lay.persons[o])] for o in orgs}
    profiles: dict[tuple[int, int], int] = {}
    requests: list[Request] = []
    start = 0.0
    for rid in range(n_requests):
        o = rng.choices(orgs, lay.org_weights)[0]
        a = rng.randrange(lay.agents[o])
        p = rng.choices(range(lay.persons[o]), person_weights[o])[0]
        profile = profiles.setdefault((o, p), rng.randint(*lay.profile))
        system = [(f"{tag}:global", lay.global_tokens), (f"{tag}:org:{o}", lay.org_tokens[o]),
                  (f"{tag}:agent:{o}.{a}", lay.agent_tokens[o][a]), (f"{tag}:tools:{a}", lay.tool_tokens[a]),
                  (f"{tag}:person:{o}.{p}", profile)]
        user = [(f"{tag}:tail:{rid}", rng.randint(*lay.tail)), (f"{tag}:q:{rid}", rng.randint(*lay.question))]
        start += rng.expovariate(1.0)
        history = [("system", system), ("user", user)]
        ids = chat_tokens(cache, [(role, [bank.paragraph_ids(n, t) for n, t in segs]) for role, segs in history])
        requests.append(Request(
            rid=rid, endpoint="chat", model="gen-model", namespace="gen", build=_builder(bank, history),
            prompt_tokens=len(ids), output_tokens=rng.randint(*lay.answer), kv_hashes=intern(block_hashes(ids)),
            arrival=start))
    return Workload(
        f"{family.name}/s{seed}", requests,
        f"{family.describe()}; global {lay.global_tokens} tok, orgs ~{lay.org_tokens[0]}, "
        f"tools ~{lay.tool_tokens[0]}, tails {lay.tail[0]}-{lay.tail[1]} tok, {n_requests} requests",
        closed_loop=family.closed_loop)


def _builder(bank: TextBank, history: list[tuple[str, list[tuple[str, int]]]]):
    def body() -> dict:
        return {"model": "gen-model", "messages": [
            {"role": role, "content": "".join(bank.paragraph(n, t) for n, t in segs)} for role, segs in history]}
    return body
