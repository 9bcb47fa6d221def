"""Savings against round robin: the sampled shadow against an exact replay, and ``GET /admin/savings``.

The exact replay here is written apart from the shadow: one LRU of every block per replica,
round-robin placement, a hit being the longest prefix of the prompt's chained blocks held
(vLLM's rule). At rate 1 the shadow must agree with it on every request; sampled, its total
within the tolerance its module doc derives.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Iterator

import httpx
import openai
import pytest
import xxhash

from routing.shadow import ENTRY_BYTES, ShadowFleet, sampled
from tests.support.stack import MODEL, Stack, start_stack

REPLICAS = ["r1", "r2", "r3", "r4"]
TOKEN = "savings-admin-token"


def _chain(parent: int, n: int, salt: str) -> list[int]:
    out, h = [], parent
    for i in range(n):
        h = xxhash.xxh3_64_intdigest(f"{salt}:{i}".encode(), h)
        out.append(h)
    return out


def _workload(seed: int) -> list[list[int]]:
    """Chats: 12 system prompts (80-300 blocks) shared by conversations of 2-6 turns, each turn
    the previous prompt plus 10-60 blocks; conversations interleaved, as clients' are."""
    rng = random.Random(seed)
    systems = [_chain(rng.getrandbits(64), rng.randint(80, 300), f"sys{i}") for i in range(12)]
    conversations = []
    for c in range(90):
        prompt = list(systems[min(int(rng.expovariate(0.3)), 11)])
        turns = []
        for t in range(rng.randint(2, 6)):
            prompt = prompt + _chain(prompt[-1], rng.randint(10, 60), f"c{c}t{t}")
            turns.append(prompt)
        conversations.append(turns)
    requests, live = [], []
    while conversations or live:
        while conversations and (len(live) < 8 or rng.random() < 0.2):
            live.append(conversations.pop())
        turns = live[rng.randrange(len(live))]
        requests.append(turns.pop(0))
        live = [c for c in live if c]
    return requests


def _exact(requests: list[list[int]], capacity: int) -> list[int]:
    """Round robin over full LRUs: each request's hit, in blocks."""
    pools: dict[str, OrderedDict[int, None]] = {r: OrderedDict() for r in REPLICAS}
    hits = []
    for i, blocks in enumerate(requests):
        pool = pools[REPLICAS[i % len(REPLICAS)]]
        h = 0
        while h < len(blocks) and blocks[h] in pool:
            h += 1
        hits.append(h)
        for b in reversed(blocks):
            pool[b] = None
            pool.move_to_end(b)
        while len(pool) > capacity:
            pool.popitem(last=False)
    return hits


def _shadow(requests: list[list[int]], capacity: int, rate: float) -> tuple[list[float], ShadowFleet]:
    fleet = ShadowFleet(rate)
    out = []
    for blocks in requests:
        replica = fleet.place(list(reversed(REPLICAS)))  # sorted by name, whatever order given
        assert replica is not None
        out.append(fleet.serve(replica, blocks, capacity))
    return out, fleet


# Pools under pressure (about a third of what round robin's copies need) and pools that never evict.
@pytest.mark.parametrize("capacity", [3000, 10**9])
def test_shadow_at_rate_one_is_the_exact_replay(capacity: int) -> None:
    requests = _workload(1)
    exact = _exact(requests, capacity)
    assert 0 < sum(exact) < sum(len(r) for r in requests)
    got, _ = _shadow(requests, capacity, 1.0)
    assert got == exact


def test_sampled_shadow_estimates_the_exact_replay() -> None:
    """At R = 1/8 the round-robin computed blocks over 5 seeds: each within 10% (the issue's bar),
    and their mean error within 3% (the midpoint is unbiased: errors of different prefix ends cancel;
    one seed's error is about half a gap per distinct prefix end, 1/(2R) = 4 blocks against ends
    a few hundred blocks deep, plus the SHARDS LRU's own)."""
    errors = []
    for seed in range(1, 6):
        requests = _workload(seed)
        total = sum(len(r) for r in requests)
        exact = total - sum(_exact(requests, 3000))
        estimate = total - sum(_shadow(requests, 3000, 1 / 8)[0])
        errors.append((estimate - exact) / exact)
    assert all(abs(e) < 0.10 for e in errors), errors
    assert abs(sum(errors) / len(errors)) < 0.03, errors


def test_shadow_memory_is_its_sample_of_the_pool() -> None:
    requests = _workload(2)
    _, fleet = _shadow(requests, 3000, 1 / 8)
    entries = fleet.entries()
    # R of the pool, and the heads (weighing R each; one per system prompt here, 12) besides.
    assert set(entries) == set(REPLICAS) and all(n <= 3000 / 8 + 12 for n in entries.values())
    assert fleet.memory_bytes() == sum(entries.values()) * ENTRY_BYTES
    # Sampling is by hash: the same blocks everywhere, about R of them.
    blocks = [b for r in requests for b in r]
    share = len(sampled(blocks, fleet.threshold)) / len(blocks)
    assert 0.08 < share < 0.17


def test_a_hit_shorter_than_the_first_sampled_block_is_seen() -> None:
    """A shared head of 20 blocks with no sampled block in it (found by hash at R = 1/16): the head
    is always kept, so the hit is estimated at the midpoint up to the first sampled block, not 0."""
    prefix = next(p for p in (_chain(s, 20, "head") for s in range(1000)) if not sampled(p, 1 << 20))
    first, second = prefix + _chain(prefix[-1], 200, "a"), prefix + _chain(prefix[-1], 200, "b")
    fleet = ShadowFleet(1 / 16)
    assert fleet.serve("r1", first, None) == 0.0
    end = sampled(second, fleet.threshold)[0]  # past the prefix: the shorter hit is in 1..end
    assert end > 20 and fleet.serve("r1", second, None) == (1 + end) / 2
    assert fleet.boundary == prefix[0]


def test_a_cold_request_is_estimated_cold() -> None:
    """The head missed: counted as computed in full, never half its first gap."""
    fleet = ShadowFleet(1 / 8)
    for i in range(8):
        assert fleet.serve("r1", _chain(i, 200, f"u{i}"), None) == 0.0


# -- the gateway -------------------------------------------------------------------------------

SYSTEM = {"role": "system", "content": "You are the support assistant of a router product. " * 40}


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    # Real (scaled) step times, so the replicas report prefill rates and streams take decode time.
    s = start_stack(2, sim={"time_scale": 0.001}, admin_token=TOKEN,
                    semantic_cache={"enabled": True, "embedder": "hash"},
                    tenants=[{"name": "acme", "api_keys": ["sk-acme"]}],
                    pool={"health_interval_s": 60, "metrics_interval_s": 0.05})
    yield s
    s.close()


def _admin(stack: Stack, path: str) -> httpx.Response:
    assert stack.admin is not None
    return httpx.get(stack.admin.url + path, headers={"authorization": f"Bearer {TOKEN}"}, timeout=10)


def test_admin_savings_after_traffic_and_a_semantic_hit(stack: Stack) -> None:
    pool = stack.runtime.pool.replicas
    # One prefill at each replica, past the gateway, so both prefill rates are known (scraped)
    # before the traffic counted below: seconds are counted only where rates are.
    for sim in stack.sims.values():
        httpx.post(sim.url + "/v1/completions", json={"model": MODEL, "prompt": "warm up", "max_tokens": 1},
                   timeout=10).raise_for_status()
    assert stack.wait_for(lambda: all(r.kv_tokens and r.prefill_rate for r in pool.values()))
    client = openai.OpenAI(base_url=stack.base_url, api_key="sk-acme", max_retries=0)
    computed = prompt = 0
    # Streams first: the decode time per token is learned from them.
    for i in range(4):
        usage = None
        for chunk in client.chat.completions.create(
                model=MODEL, max_tokens=8, stream=True, stream_options={"include_usage": True},
                messages=[SYSTEM, {"role": "user", "content": f"stream question {i}"}]):
            usage = chunk.usage or usage
        assert usage is not None
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        computed += usage.prompt_tokens - (cached or 0)
        prompt += usage.prompt_tokens
    # No max_tokens: an answer cut at the limit is not stored.
    first = client.chat.completions.create(model=MODEL, messages=[
        SYSTEM, {"role": "user", "content": "what does the router do?"}])
    assert first.usage is not None
    cached = first.usage.prompt_tokens_details.cached_tokens if first.usage.prompt_tokens_details else 0
    computed += first.usage.prompt_tokens - (cached or 0)
    prompt += first.usage.prompt_tokens
    again = client.chat.completions.with_raw_response.create(model=MODEL, messages=[
        SYSTEM, {"role": "user", "content": "what does the router do?"}])
    assert again.headers["x-kvgate-cache"] == "hit"

    body = _admin(stack, "/admin/savings").json()
    prefill = body["totals"]["prefill"]
    # Our side is exact: what the replicas reported.
    assert prefill["requests"] == 5 and prefill["prompt_tokens"] == prompt
    assert prefill["computed_tokens"] == computed
    # Round robin sends the second and later requests away from the first's replica, where the
    # shared system prompt is not yet held (two replicas: the shadow sees every block at R = 1/16
    # only in expectation, so the bound is loose): it would have computed more than the fleet did.
    assert computed < prefill["rr_computed_tokens"] <= prompt
    assert prefill["computed_s"] > 0 and prefill["rr_computed_s"] > prefill["computed_s"]
    (tenant,) = body["tenants"]
    assert tenant["name"] == "acme" and tenant["prefill"]["requests"] == 5
    cache = tenant["semantic_cache"]
    assert cache["hits"] == 1
    assert (cache["prompt_tokens"], cache["completion_tokens"]) == (first.usage.prompt_tokens,
                                                                    first.usage.completion_tokens)
    assert body["decode_s_per_token"] > 0 and cache["decode_s"] == pytest.approx(
        first.usage.completion_tokens * body["decode_s_per_token"], rel=1e-3)
    replicas = {r["name"]: r for r in body["replicas"]}
    assert set(replicas) == {"r1", "r2"}
    assert sum(r["computed_tokens"] for r in replicas.values()) == computed
    assert sum(r["rr_computed_tokens"] for r in replicas.values()) == pytest.approx(prefill["rr_computed_tokens"],
                                                                                    abs=0.01)
    assert body["shadow"]["memory_bytes"] > 0 and body["shadow"]["cpu_us_per_request"] > 0

    metrics = httpx.get(stack.base_url.removesuffix("/v1") + "/metrics", timeout=10).text
    assert 'kvgate_prefill_computed_tokens_total{placement="round_robin"' in metrics
    assert 'kvgate_prefill_computed_tokens_total{placement="actual",replica=' in metrics
    assert (f'kvgate_semantic_cache_saved_tokens_total{{kind="completion",tenant="acme"}} '
            f'{float(first.usage.completion_tokens)}') in metrics


def test_entry_bytes_is_what_an_entry_costs() -> None:
    import tracemalloc

    fleet = ShadowFleet(1.0)
    rng = random.Random(3)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for _ in range(200):
        fleet.serve("r1", [rng.getrandbits(64) for _ in range(100)], None)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert fleet.entries() == {"r1": 20_000}
    # An estimate, not a measurement: a hash table doubles as it grows and the allocator keeps its
    # own slack, so what one entry costs moves with the process's state (0.80 of ENTRY_BYTES was seen
    # once beside the rest of the suite, 1.0 alone). Within 1.5x either way is what the figure claims.
    assert 1 / 1.5 < used / 20_000 / ENTRY_BYTES < 1.5, used / 20_000


def test_budget_rate_bounds_memory_and_samples_per_prompt() -> None:
    from routing.savings import SAMPLES_PER_PROMPT, budget_rate

    assert budget_rate(8192, 5000) == 1.0  # a small pool fits whole
    assert budget_rate(8192, 8192 * 3) == 1 / 4  # the largest power of 1/2 within the budget
    assert budget_rate(8192, None, 2048) == 1 / 64  # 32 samples of a 2,048-block prompt
    assert budget_rate(8192, 8192 * 100, 2048) == 1 / 128  # the tighter of the two
    assert budget_rate(8192, None, 2 * SAMPLES_PER_PROMPT) == 1.0  # short prompts: every block


def test_an_unhashed_tail_takes_its_room() -> None:
    """A prompt longer than routing hashes still fills the pool: its first prompt is evicted for it."""
    first, second = _chain(1, 100, "a"), _chain(2, 100, "b")
    # Capacity 300 blocks: a tail of 150 evicts half of the first prompt (its tail end: heads are
    # evicted last), one of 250 all of it.
    for tail, expect in ((0.0, 100.0), (150.0, 50.0), (250.0, 0.0)):
        fleet = ShadowFleet(1.0)
        fleet.serve("r1", first, 300)
        fleet.serve("r1", second, 300, tail=tail)
        assert fleet.serve("r1", first, 300) == expect


def test_ledger_at_rate_one_with_token_ids_is_the_exact_replay() -> None:
    """The ledger end to end, fed as the gateway feeds it: requests with token ids served where an
    affinity policy put them, with the cached tokens an exact replica model reports there. Its
    round-robin figure must be the exact round-robin replay's, and its own side what was reported."""
    from dataclasses import dataclass

    from routing import RouteRequest
    from routing.savings import SavingsLedger
    from routing.token_keys import block_keys

    @dataclass
    class View:
        name: str
        prefill_rate: float | None = 1000.0
        kv_tokens: float | None = 3000 * 16.0

    fleet = [View(n) for n in REPLICAS]
    rng = random.Random(4)
    systems = [[rng.randrange(50_000) for _ in range(rng.randint(300, 2000))] for _ in range(10)]
    prompts = []
    for _ in range(300):
        s = rng.randrange(len(systems))
        prompts.append((s, systems[s] + [rng.randrange(50_000) for _ in range(rng.randint(5, 400))]))

    def replay(place) -> list[int]:  # type: ignore[no-untyped-def]
        pools: dict[str, OrderedDict[int, None]] = {r: OrderedDict() for r in REPLICAS}
        out = []
        for i, (s, tokens) in enumerate(prompts):
            pool, blocks = pools[place(i, s)], block_keys(tokens, 16)
            h = 0
            while h < len(blocks) and blocks[h] in pool:
                h += 1
            out.append(min(h * 16, (len(tokens) - 1) // 16 * 16))
            for b in reversed(blocks):
                pool[b] = None
                pool.move_to_end(b)
            while len(pool) > 3000:
                pool.popitem(last=False)
        return out

    def affinity(i: int, s: int) -> str:
        return REPLICAS[s % len(REPLICAS)]

    served = replay(affinity)
    exact_rr = sum(len(t) for _, t in prompts) - sum(replay(lambda i, s: REPLICAS[i % len(REPLICAS)]))
    ledger = SavingsLedger(rate=1.0)
    for i, ((s, tokens), cached) in enumerate(zip(prompts, served)):
        request = RouteRequest("completions", "m", "ns", {"prompt": tokens}, token_ids=tokens)
        ledger.served(request, "acme", affinity(i, s), fleet, len(tokens), cached)  # type: ignore[arg-type]
    totals = ledger.totals()
    assert totals.computed_tokens == sum(len(t) for _, t in prompts) - sum(served)
    assert ledger.correction == pytest.approx(1.0)
    assert totals.rr_computed_tokens == pytest.approx(exact_rr)
    assert totals.rr_computed_tokens > 1.3 * totals.computed_tokens  # affinity saves: the test has teeth
    assert totals.rr_computed_s == pytest.approx(exact_rr / 1000.0)


def test_the_trend_is_the_share_saved_in_each_interval() -> None:
    from gateway.observe.metrics import Metrics
    from gateway.observe.trends import Trends
    from tests.support.clock import Clock

    clock, wall = Clock(), Clock(1_800_000_000.0)
    metrics = Metrics()
    trends = Trends(metrics, interval_s=10, samples=4, clock=clock, wall=wall)

    def next_interval() -> None:
        clock.t += 10
        wall.t += 10
        trends.tick()

    trends.tick()
    metrics.prefill_tokens.labels("actual", "r1", "acme").inc(300)
    metrics.prefill_tokens.labels("round_robin", "r2", "acme").inc(1000)
    next_interval()
    assert trends.samples[-1].prefill_saved_share == pytest.approx(0.7)
    # The next interval counts only its own: round robin would have computed what we did.
    metrics.prefill_tokens.labels("actual", "r1", "acme").inc(500)
    metrics.prefill_tokens.labels("round_robin", "r1", "acme").inc(500)
    next_interval()
    assert trends.samples[-1].prefill_saved_share == pytest.approx(0.0)
    next_interval()  # nothing served: a gap
    assert trends.samples[-1].prefill_saved_share is None
    assert trends.to_dict()["samples"][0]["prefill_saved_share"] == pytest.approx(0.7)
