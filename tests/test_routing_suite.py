"""The generated suite, closed-loop replay, pool sizing, the references and the load-bound accounting.

Everything here builds its own small data; nothing reads ../shared/data.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest

from bench import routing_suite
from bench.pools import floor_concurrency, pool_size, reused_working_set
from bench.routing import POLICIES, calibrate, ideal_hit_ratio
from bench.routing_reference import (
    REFERENCE, RUN_REFERENCE, TTFT_BOUNDED, TTFT_UNBOUNDED, RunBoundedReference, TTFTReference)
from bench.routing_replay import Usage, replay
from bench.routing_sim import SimEngine, SimSettings, SimView, load_bound, simulate
from bench.routing_stats import RunStats
from bench.workloads import ClosedLoop, Request, Workload, chains
from bench.workloads.generated import FAMILIES, LAYERED, Family, build, layered_layout, layout
from vllm_sim.kv import block_hashes
from vllm_sim.template import render_chat
from vllm_sim.tokenizer import tokenize

HEAVY = next(f for f in FAMILIES if f.name == "heavy4-closed8")


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_generated_token_ids_are_exactly_the_simulators(family: Family) -> None:
    w = build(family, seed=3, n_requests=8)
    assert len(w.requests) == 8 and w.closed_loop == family.closed_loop
    for req in w.requests:
        ids = tokenize(render_chat(req.body()["messages"]))
        assert len(ids) == req.prompt_tokens
        assert block_hashes(ids) == list(req.kv_hashes)


def test_a_heavy_family_has_exactly_as_many_heavy_organisations_as_replicas() -> None:
    for seed in range(1, 6):
        lay = layout(HEAVY, seed)
        weights = sorted(lay.org_weights, reverse=True)
        assert lay.heavy_orgs == HEAVY.replicas
        assert sum(weights[: HEAVY.replicas]) >= 0.7 - 1e-9
        assert abs(sum(weights) - 1) < 1e-9
    assert len({layout(HEAVY, s).global_tokens for s in range(1, 6)}) > 1, "layer sizes differ by seed"


def test_a_follow_up_turn_extends_its_previous_turn() -> None:
    family = next(f for f in FAMILIES if f.name == "chat-closed32")
    w = build(family, seed=1, n_requests=60)
    by_rid = {r.rid: r for r in w.requests}
    follow = [r for r in w.requests if r.prev is not None]
    assert follow, "this family has multi-turn conversations"
    for r in follow:
        prev = by_rid[r.prev]
        assert list(r.kv_hashes[: len(prev.kv_hashes) - 1]) == list(prev.kv_hashes[:-1])


def test_load_bound_is_ceil_of_one_and_a_quarter_times_the_mean() -> None:
    assert [load_bound(n, 4) for n in (1, 4, 8, 9, 16)] == [1, 2, 3, 3, 5]
    assert load_bound(12, 8) == 2 and load_bound(0, 8) == 1
    assert load_bound(8, 4, epsilon=0.5) == 3 and load_bound(10, 4, epsilon=0.3) == 4
    with pytest.raises(ValueError):
        load_bound(1, 0)


def test_closed_loop_bursts_wait_for_the_next_window() -> None:
    assert ClosedLoop(4).next_start(7.3) == 7.3
    burst = ClosedLoop(4, on_s=1.0, off_s=2.0)
    assert [burst.next_start(t) for t in (0.0, 0.5, 1.0, 2.9, 3.2)] == [0.0, 0.5, 3.0, 3.0, 3.2]
    with pytest.raises(ValueError):
        ClosedLoop(0)
    assert ClosedLoop.of(0, [1.0, 2.0]) is None and ClosedLoop.of(8) == ClosedLoop(8)
    assert ClosedLoop.of(8, [1.0, 2.0]) == ClosedLoop(8, 1.0, 2.0)


def _req(rid: int, arrival: float, after: int | None = None) -> Request:
    return Request(rid, "chat", "m", "t", dict, 32, 4, [], arrival, after=after, prev=after)


def test_chains_are_conversations_in_arrival_order() -> None:
    w = Workload("w", [_req(0, 5.0), _req(1, 1.0), _req(2, 0.5, after=0), _req(3, 0.5, after=2)], "")
    assert [[r.rid for r in c] for c in chains(w)] == [[1], [0, 2, 3]]


class _Recorder:
    """Round robin that records the simulated time of every decision."""

    name = "recorder"

    def __init__(self, clock) -> None:
        self.clock, self.times, self.k = clock, [], 0

    def prefer(self, request, replicas):
        self.times.append(self.clock())
        self.k += 1
        return [*replicas[self.k % len(replicas):], *replicas[: self.k % len(replicas)]]

    def observe(self, request, feedback) -> None:
        return None


def _keeping(cls):  # type: ignore[no-untyped-def]
    """A policy factory for ``simulate`` that keeps what it made (the last is the run's)."""
    made: list = []

    def make(clock):  # type: ignore[no-untyped-def]
        made.append(cls(clock))
        return made[-1]
    return make, made


def test_simulated_closed_loop_keeps_exactly_its_clients_in_flight_and_sends_only_in_bursts() -> None:
    w = build(HEAVY, seed=2, n_requests=120)
    make, made = _keeping(_Recorder)

    stats = simulate(w, make, SimSettings(replicas=4, closed_loop=ClosedLoop(8)))
    assert stats.max_in_flight == 8 and len(stats.ttfts) == 120
    assert sum(stats.requests_per_replica) == 120
    bursty = simulate(w, make, SimSettings(replicas=4, closed_loop=ClosedLoop(8, on_s=0.5, off_s=1.5)))
    assert bursty.max_in_flight == 8 and len(bursty.ttfts) == 120
    assert all(t % 2.0 < 0.5 + 1e-9 for t in made[-1].times)
    assert bursty.makespan > stats.makespan


def _heavy_run(policy: str) -> tuple[RunStats, Workload]:
    w = build(HEAVY, seed=1, n_requests=200)
    return simulate(w, POLICIES[policy], SimSettings(replicas=4, kv_tokens=1 << 20)), w


def test_the_bounded_reference_never_passes_the_bound_and_the_metric_sees_who_does() -> None:
    ref, w = _heavy_run(REFERENCE)
    assert ref.over_bound == 0 and ref.max_bound_ratio <= 1.0
    assert ref.hit_ratio >= 0.9 * ideal_hit_ratio(w)
    unbounded, _ = _heavy_run("consistent_hash")
    assert unbounded.max_bound_ratio > 1.0 and unbounded.over_bound > 0
    rr, _ = _heavy_run("round_robin")
    assert rr.max_over_mean_requests == pytest.approx(1.0) and ref.hit_ratio > rr.hit_ratio


def test_replay_closed_loop_runs_conversations_with_exactly_its_clients() -> None:
    w = build(next(f for f in FAMILIES if f.name == "chat-closed32"), seed=1, n_requests=40)
    in_flight, peak, order = [0], [0], []

    async def send(req: Request) -> Usage:
        in_flight[0] += 1
        peak[0] = max(peak[0], in_flight[0])
        order.append(req.rid)
        await asyncio.sleep(0.001)
        in_flight[0] -= 1
        return Usage(req.prompt_tokens, 0, 0.001)

    results = asyncio.run(replay(w, send, closed_loop=ClosedLoop(3)))
    assert [r.rid for r in results] == list(range(40)) and peak[0] == 3
    for r in w.requests:
        if r.prev is not None:
            assert order.index(r.prev) < order.index(r.rid)


def test_sizing_aims_a_run_at_its_length() -> None:
    family = next(f for f in FAMILIES if f.name == "orgs-poisson-0.5")
    settings = SimSettings(replicas=family.replicas)
    short = routing_suite.requests_for(build(family, 1, 100), family, settings, 10)
    long = routing_suite.requests_for(build(family, 1, 100), family, settings, 40)
    assert 3.5 < long / short < 4.5
    w = build(family, 1, long)
    calibrate(w, ideal_hit_ratio(w), settings, family.load)
    stats = simulate(w, POLICIES["least_load"], settings)
    assert 20 < stats.makespan < 80


def test_spread_and_p95_ties() -> None:
    assert routing_suite.spread([3.0, 1.0, float("nan"), 2.0]) == (1.0, 2.0, 3.0)
    runs = [{"rows": {"a": {"ttft_p95_s": 1.0}, "b": {"ttft_p95_s": 1.04}, REFERENCE: {"ttft_p95_s": 0.5}}},
            {"rows": {"a": {"ttft_p95_s": 2.0}, "b": {"ttft_p95_s": 1.0}, REFERENCE: {"ttft_p95_s": 0.5}}}]
    assert routing_suite.best_p95(runs, "a", 0.05) == 1 and routing_suite.best_p95(runs, "b", 0.05) == 2


def test_quick_suite_runs(tmp_path: Path, capsys) -> None:
    code = routing_suite.main(["--quick", "--families", "heavy4-closed8", "--seeds", "1", "2", "--jobs", "1",
                               "--policies", "round_robin", "prefix_affinity", "--out", str(tmp_path)])
    assert code == 0
    out = capsys.readouterr().out
    assert "## heavy4-closed8" in out and RUN_REFERENCE in out and "if/bound" in out
    assert "TTFT p50" in out and " hit " in out and "KV pool per replica" in out and "reused working set" in out
    data = json.loads((tmp_path / "routing_suite.json").read_text())
    assert {d["seed"] for d in data} == {1, 2}
    assert set(data[0]["rows"]) == {"round_robin", "prefix_affinity", RUN_REFERENCE}
    assert data[0]["rows"][RUN_REFERENCE]["of_reference"] == 1.0
    for d in data:  # each run's pool is the workload's own sizing
        w = build(HEAVY, d["seed"], d["requests"])
        assert d["pool_tokens"] == pool_size(w, HEAVY.replicas, clients=HEAVY.clients).kv_tokens
        assert d["working_set_tokens"] == reused_working_set(w)


def test_the_suite_runs_a_policy_as_independent_instances_beside_its_single_instance(tmp_path: Path, capsys) -> None:
    code = routing_suite.main(["--quick", "--families", "heavy4-closed8", "--seeds", "1", "--jobs", "1",
                               "--policies", "round_robin", "prefix_affinity", "--instances", "2",
                               "--out", str(tmp_path)])
    assert code == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    single = next(i for i, line in enumerate(lines) if line.startswith("prefix_affinity "))
    assert lines[single + 1].startswith("prefix_affinity x2 ")  # read beside the single instance
    assert "x1 share" in out and "round_robin x2" not in out  # round robin has no multi-instance row
    rows = json.loads((tmp_path / "routing_suite.json").read_text())[0]["rows"]
    assert set(rows) == {"round_robin", "prefix_affinity", "prefix_affinity x2", RUN_REFERENCE}
    multi = rows["prefix_affinity x2"]
    assert multi["instances"] == 2 and "of_single" not in rows["prefix_affinity"]
    assert multi["of_single"] == pytest.approx(multi["hit_ratio"] / rows["prefix_affinity"]["hit_ratio"])
    # A multi-instance row is a real policy: it can be the p95 best.
    runs = [{"rows": rows}]
    assert sum(routing_suite.best_p95(runs, p, 0.0) for p in rows if p != RUN_REFERENCE) >= 1


def test_the_suite_runs_instances_sharing_block_facts_below_those_sharing_nothing(tmp_path: Path, capsys) -> None:
    code = routing_suite.main(["--quick", "--families", "heavy4-closed8", "--seeds", "1", "--jobs", "1",
                               "--policies", "ttft", "--instances", "2", "--share-index", "--out", str(tmp_path)])
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    single = next(i for i, line in enumerate(lines) if line.startswith("ttft "))
    assert lines[single + 1].startswith("ttft x2 ") and lines[single + 2].startswith("ttft x2, shared index ")
    rows = json.loads((tmp_path / "routing_suite.json").read_text())[0]["rows"]
    shared = rows["ttft x2, shared index"]
    assert shared["instances"] == 2
    assert shared["of_single"] == pytest.approx(shared["hit_ratio"] / rows["ttft"]["hit_ratio"])


def test_the_table_rows_put_each_multi_instance_row_below_its_single_instance() -> None:
    assert routing_suite.table_rows(["round_robin", "ttft", RUN_REFERENCE], 1) == ["round_robin", "ttft", RUN_REFERENCE]
    assert routing_suite.table_rows(["round_robin", "ttft", RUN_REFERENCE], 4) == [
        "round_robin", "ttft", "ttft x4", RUN_REFERENCE]
    # Sharing facts (--share-index): kvgate's policies only, below the row sharing nothing.
    assert routing_suite.table_rows(["round_robin", "ttft", "prefix_affinity"], 4, share_index=True) == [
        "round_robin", "ttft", "ttft x4", "ttft x4, shared index",
        "prefix_affinity", "prefix_affinity x4", "prefix_affinity x4, shared index"]


def test_the_ttft_oracle_knows_each_request_s_time_to_first_token_and_keeps_the_bound_only_when_asked() -> None:
    # One client: every request finds nothing queued, so its time to first token
    # is exactly the oracle's figure for where it sent it.
    w = build(HEAVY, seed=1, n_requests=60)
    make, made = _keeping(TTFTReference)

    alone = simulate(w, make, SimSettings(replicas=4, kv_tokens=1 << 20, closed_loop=ClosedLoop(1)))
    assert alone.ttfts == pytest.approx(made[-1].predicted, abs=1e-9)
    assert len(set(round(t, 6) for t in alone.ttfts)) > 5  # cached prefixes make them differ
    bounded, _ = _heavy_run(TTFT_BOUNDED)
    assert bounded.over_bound == 0 and bounded.max_bound_ratio <= 1.0
    unbounded, _ = _heavy_run(TTFT_UNBOUNDED)
    assert unbounded.over_bound > 0


def test_suite_pools_can_be_shrunk_and_replicas_can_publish_events(tmp_path: Path, capsys) -> None:
    def run(*extra: str) -> dict:
        assert routing_suite.main(["--quick", "--families", "heavy4-closed8", "--seeds", "1", "--jobs", "1",
                                   "--policies", "prefix_affinity", "--out", str(tmp_path), *extra]) == 0
        return json.loads((tmp_path / "routing_suite.json").read_text())[0]["rows"]["prefix_affinity"]

    roomy = run("--kv-tokens", str(1 << 20))
    assert "KV wait" not in capsys.readouterr().out  # roomy pools: nobody waits for blocks, no column
    small = run("--kv-tokens", "2048")
    out = capsys.readouterr().out
    assert "every replica's KV pool: 2,048 tokens" in out and "KV wait" in out
    # A pool smaller than the organisations' layers together evicts what the next request needs,
    # and the slowest requests wait for blocks the running ones hold.
    assert small["hit_ratio"] < roomy["hit_ratio"] - 0.05
    assert roomy["kv_wait_tail_s"] == 0.0 < small["kv_wait_tail_s"]
    precise = run("--kv-events")
    assert "precise mode" in capsys.readouterr().out
    assert precise["max_in_flight_over_bound"] <= 1.0 and precise["hit_ratio"] > 0.5


def test_kv_wait_is_the_time_queued_behind_a_request_holding_the_blocks() -> None:
    # One replica whose pool holds one request's prompt and output at a time, and two unrelated
    # prompts arriving together: the second waits for the first's prefill step (not a KV wait),
    # then for its blocks, exactly while the first decodes and until it frees them.
    def body(i: int) -> dict:
        return {"model": "m", "messages": [{"role": "user", "content": f"prompt {i}"}]}

    reqs = [Request(rid=i, endpoint="chat", model="m", namespace="default", build=lambda i=i: body(i),
                    prompt_tokens=128, output_tokens=16, kv_hashes=[bytes([i, b]) for b in range(8)], arrival=0.0)
            for i in range(2)]
    w = Workload("two", reqs, "two unrelated prompts")
    stats = simulate(w, POLICIES["round_robin"], SimSettings(replicas=1, kv_tokens=160))
    first, second = sorted(zip(stats.ttfts, stats.kv_waits))
    assert first[1] == 0.0 and second[1] > 0
    t = SimSettings().timing
    decode = 15 * t.decode_step_time(1)  # its first token came with the prefill
    assert second[1] == pytest.approx(decode, rel=1e-6)
    assert second[0] == pytest.approx(t.prefill_time(128) + decode + t.prefill_time(128), rel=1e-6)


def _blocks(*names: str) -> list[bytes]:
    return [n.encode() for n in names]


def _sized(hashes: list[list[bytes]], prompt: int, output: int) -> Workload:
    reqs = [Request(i, "chat", "m", "t", dict, prompt, output, h, float(i)) for i, h in enumerate(hashes)]
    return Workload("sizing", reqs, "")


def test_pool_size_is_ratio_times_the_reused_working_set_per_replica_floored_and_overridable() -> None:
    # Four groups of a 10-block prefix, three requests each, every request one block of its own:
    # the reused working set is the 40 prefix blocks (a block seen once does not count).
    hashes = [[f"g{g}.{b}".encode() for b in range(10)] + _blocks(f"own{g}.{k}") for g in range(4) for k in range(3)]
    w = _sized(hashes, prompt=180, output=20)
    assert reused_working_set(w) == 40 * 16
    assert reused_working_set(_sized([_blocks("a", "b", "a")], 48, 1)) == 0  # one request: nothing reused
    two = pool_size(w, replicas=2)  # default ratio 2: 2 x 640 / 2
    assert (two.kv_tokens, two.working_set, two.floor, two.overridden) == (640, 640, 400, False)
    assert two.blocks == 40 and "640 tokens" in two.describe() and "2 x reused working set" in two.describe()
    assert pool_size(w, replicas=2, ratio=3.0).kv_tokens == 960
    assert pool_size(w, replicas=3, ratio=2.5).kv_tokens == 544  # 2.5 x 640 / 3 = 533.3, up to whole blocks
    # The floor: two of the largest request (prompt + output) at once, or a closed loop's clients per replica.
    assert pool_size(w, replicas=4, ratio=1.5).kv_tokens == 400
    assert floor_concurrency(4) == 2 and floor_concurrency(4, clients=8) == 2 and floor_concurrency(2, clients=12) == 6
    assert pool_size(w, replicas=2, clients=12).kv_tokens == 6 * 200
    assert pool_size(w, replicas=2, max_output=4).floor == 2 * 184  # the output the client really asks for
    # An explicit size wins, whatever the floor.
    given = pool_size(w, replicas=2, kv_tokens=100)
    assert given.kv_tokens == 100 and given.overridden and "--kv-tokens" in given.describe()
    with pytest.raises(ValueError):
        pool_size(w, replicas=0)


class _CheckedRunReference(RunBoundedReference):
    """The run-level reference, checked against its definition at every decision, recomputed independently."""

    name = RUN_REFERENCE

    def __init__(self, clock=None) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        self.decisions = 0
        self.warm_not_least = 0  # decisions where the longest prefix beat the least-placed replica

    def choose_sim(self, request, engines, views):  # type: ignore[no-untyped-def]
        before = {v.name: self.placed.get(v.name, 0) for v in views}
        total = sum(before.values()) + 1
        bound = math.ceil(1.3 * total / len(views) - 1e-9)
        eligible = [v.name for v in views if before[v.name] + 1 <= bound]
        match = {e.name: e.pool.match(request.kv_hashes) for e in engines}
        order = super().choose_sim(request, engines, views)
        chosen = order[0].name
        assert sorted(v.name for v in order) == sorted(v.name for v in views)
        assert chosen in eligible and self.placed[chosen] == before[chosen] + 1 <= bound
        best = max(match[n] for n in eligible)
        assert match[chosen] == best
        # Ties: the least placed, then the name.
        assert (before[chosen], chosen) == min((before[n], n) for n in eligible if match[n] == best)
        self.decisions += 1
        self.warm_not_least += before[chosen] > min(before.values())
        return order


def test_the_run_level_reference_keeps_its_bound_at_every_decision_and_takes_the_longest_cached_prefix() -> None:
    family = next(f for f in LAYERED if f.orgs_per_replica == 2)
    w = build(family, seed=1, n_requests=160)
    made: list[_CheckedRunReference] = []

    def make(clock):  # type: ignore[no-untyped-def]
        made.append(_CheckedRunReference())
        return made[-1]

    pool = pool_size(w, family.replicas, clients=family.clients)
    stats = simulate(w, make, SimSettings(replicas=family.replicas, kv_tokens=pool.kv_tokens))
    ref = made[-1]
    assert ref.decisions == 160 and sum(stats.requests_per_replica) == 160
    assert ref.warm_not_least > 0, "some decisions followed a warm prefix past the least-placed replica"
    assert max(stats.requests_per_replica) <= math.ceil(1.3 * 160 / family.replicas)
    rr = simulate(w, POLICIES["round_robin"], SimSettings(replicas=family.replicas, kv_tokens=pool.kv_tokens))
    assert stats.hit_ratio > rr.hit_ratio


def test_the_run_level_reference_on_a_hand_built_fleet() -> None:
    settings = SimSettings(replicas=3, kv_tokens=16 * 64)
    engines = [SimEngine(f"r{i}", settings) for i in range(3)]
    views = [SimView(e.name) for e in engines]
    warm = [f"p{b}".encode() for b in range(8)]
    engines[1].pool.release(engines[1].pool.allocate(warm[:6], 6 * 16 + 1))  # r1 holds 6 blocks of the prefix
    engines[2].pool.release(engines[2].pool.allocate(warm[:2], 2 * 16 + 1))  # r2 holds 2
    ref = RunBoundedReference()
    req = Request(0, "chat", "m", "t", dict, 8 * 16, 1, warm, 0.0)
    picks = [ref.choose_sim(req, engines, views)[0].name for _ in range(9)]
    # The n-th request's bound, ceil(1.3 x n / 3): 1, 1, 2, 2, 3, 3, 4, 4, 4. The longest prefix (r1) whenever
    # it is within it, else the next longest (r2); the 9th finds both at 4: the cold r0 takes it.
    assert ref.bound(3) == 5  # the 10th: ceil(1.3 x 10 / 3)
    assert picks == ["r1", "r2", "r1", "r2", "r1", "r2", "r1", "r2", "r0"]
    assert ref.placed == {"r0": 1, "r1": 4, "r2": 4}


@pytest.mark.parametrize("family", LAYERED, ids=lambda f: f.name)
def test_layered_families_build_deterministically_per_seed(family: Family) -> None:
    def fingerprint(seed: int) -> list[tuple]:
        w = build(family, seed, 24)
        return [(r.prompt_tokens, r.output_tokens, r.arrival, tuple(r.kv_hashes), r.body()["messages"][0]["content"])
                for r in w.requests]

    assert fingerprint(5) == fingerprint(5)
    assert fingerprint(5) != fingerprint(6)
    lay = layered_layout(family, 5)
    assert lay == layered_layout(family, 5)
    assert len(lay.org_weights) == family.orgs_per_replica * family.replicas
    assert abs(sum(lay.org_weights) - 1) < 1e-9
    if len(lay.org_weights) > 1:
        assert max(lay.org_weights) > 1.5 * min(lay.org_weights), "some organisations are heavier"


def test_layered_prompts_share_exactly_their_common_layers() -> None:
    family = LAYERED[0]
    lay = layered_layout(family, 2)
    w = build(family, 2, 80)
    sysmsg = [r.body()["messages"][0]["content"] for r in w.requests]
    global_blocks = lay.global_tokens // 16 - 1
    # Every prompt starts with the global layer: all share at least its blocks.
    first = w.requests[0].kv_hashes
    assert all(list(r.kv_hashes[:global_blocks]) == list(first[:global_blocks]) for r in w.requests)
    # Two requests with the same system message (same org, agent, person) share all of it and differ in the tail.
    same = [(a, b) for a in range(80) for b in range(a + 1, 80) if sysmsg[a] == sysmsg[b]]
    assert same
    a, b = same[0]
    common = 0
    for x, y in zip(w.requests[a].kv_hashes, w.requests[b].kv_hashes):
        if x != y:
            break
        common += 1
    assert common * 16 >= sum((lay.global_tokens, min(lay.org_tokens), min(lay.tool_tokens))) - 16
    assert w.requests[a].kv_hashes[-1] != w.requests[b].kv_hashes[-1]


def test_the_suite_shows_replicas_left_without_a_request() -> None:
    # One prompt, sent again and again, to two replicas: hashing its key keeps every copy on one
    # replica and leaves the other idle for the whole run, which max/mean alone does not say (three
    # replicas, one of them taking two thirds of the traffic, give the same 2.00); round robin uses both.
    body = {"model": "m", "messages": [{"role": "user", "content": "the same question every time"}]}
    reqs = [Request(rid=i, endpoint="chat", model="m", namespace="default", build=lambda: body,
                    prompt_tokens=64, output_tokens=4, kv_hashes=[b"a", b"b", b"c", b"d"], arrival=i * 0.05)
            for i in range(20)]
    w = Workload("same", reqs, "one prompt repeated")
    hashed = simulate(w, POLICIES["consistent_hash"], SimSettings(replicas=2))
    spread = simulate(w, POLICIES["round_robin"], SimSettings(replicas=2))
    assert sorted(hashed.requests_per_replica) == [0, 20] and hashed.idle_replicas == 1
    assert spread.idle_replicas == 0

    family = next(f for f in FAMILIES if f.name == "heavy4-closed8")
    run = {"family": family.name, "seed": 1, "requests": 20, "ideal": 1.0, "reference": 1.0, "pool_tokens": 1 << 20,
           "working_set_tokens": 64, "pool_floor_tokens": 64, "pool_ratio": 2.0, "pool_overridden": False,
           "rows": {"consistent_hash": routing_suite._row(hashed, 1.0, 1.0),
                    "round_robin": routing_suite._row(spread, 1.0, 1.0)}}
    shown = routing_suite.format_family(family, [run], ["consistent_hash", "round_robin"], 0.05)
    lines = shown.splitlines()
    header = next(line for line in lines if line.startswith("policy"))
    at = header.index(" idle") + len(" idle")  # the cells are right-aligned under it
    cells = {line.split()[0]: line[:at].rsplit("  ", 1)[-1].strip() for line in lines
             if line.startswith(("consistent_hash", "round_robin"))}
    assert cells == {"consistent_hash": "1 / 1 / 1", "round_robin": "0 / 0 / 0"}  # min / median / max
    run["rows"] = {"round_robin": run["rows"]["round_robin"]}
    assert "idle" not in routing_suite.format_family(family, [run], ["round_robin"], 0.05)
