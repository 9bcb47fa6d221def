"""The routing benchmark: workloads are exact, the simulator runs, instances agree, --quick works.

Everything here builds its own small data; nothing reads ../shared/data.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import replace
from pathlib import Path

import pytest

from bench import routing as bench_routing
from bench.pools import pool_size
from bench.routing_replay import Usage, replay, summarise
from bench.routing_sim import SimSettings, simulate
from bench.workloads import ClosedLoop, Request, Workload, shared_prefix, twin, unique
from bench.workloads.generated import LAYERED, layered_layout
from bench.workloads.generated import build as generated_build
from bench.workloads.text import TextBank
from routing import PrefixAffinity, RoutingSettings
from vllm_sim.kv import block_hashes
from vllm_sim.template import render_chat
from vllm_sim.tokenizer import tokenize


def _prompt_text(req: Request) -> str:
    body = req.body()
    return body["prompt"] if "prompt" in body else render_chat(body["messages"], body.get("tools"))


@pytest.mark.parametrize("build", [lambda: twin.build(n_requests=4), lambda: shared_prefix.build(groups=2, per_group=2),
                                   lambda: unique.build(n_requests=3)])
def test_workload_token_ids_are_exactly_the_simulators(build) -> None:
    for req in build().requests:
        ids = tokenize(_prompt_text(req))
        assert len(ids) == req.prompt_tokens
        assert block_hashes(ids) == list(req.kv_hashes)


def test_text_segments_are_prefixes_of_longer_ones() -> None:
    bank = TextBank(3)
    assert bank.run("x", 512).startswith(bank.run("x", 100))
    assert bank.run_ids("x", 512)[:100] == bank.run_ids("x", 100) == tokenize(bank.run("x", 100))


def _conversations(n_conv: int = 120, turns: int = 4) -> Workload:
    """A small synthetic chat workload: one shared system prompt, conversations of several turns."""
    bank = TextBank(11)
    requests: list[Request] = []
    system = bank.paragraph("sys", 300)
    for c in range(n_conv):
        msgs = [{"role": "system", "content": system}]
        prev = None
        for k in range(turns):
            msgs = msgs + [{"role": "user", "content": bank.paragraph(f"q{c}.{k}", 200)}]
            convo = list(msgs)
            ids = tokenize(render_chat(convo))
            rid = len(requests)
            requests.append(Request(rid, "chat", "m", "t", (lambda convo=convo: {"model": "m", "messages": convo}),
                                    len(ids), 64, block_hashes(ids), arrival=c * 0.3 if prev is None else 2.0,
                                    after=prev, prev=prev))
            msgs = msgs + [{"role": "assistant", "content": bank.paragraph(f"a{c}.{k}", 100)}]
            prev = rid
    return Workload("conversations", requests, "synthetic conversations")


def test_four_independent_instances_keep_the_single_instance_hit_ratio() -> None:
    w = _conversations()
    settings = SimSettings(replicas=8, kv_tokens=1 << 22)

    def make(clock):
        return PrefixAffinity(RoutingSettings(), clock)

    one = simulate(w, make, settings)
    four = simulate(w, make, replace(settings, instances=4, agreement=True))
    assert one.hit_ratio > 0.5
    # Measured .90 of one instance (.74 when the others' stale running counts were read
    # per replica, routing.prefix_affinity._load_view); issue 15 asks for .95.
    assert four.hit_ratio >= 0.85 * one.hit_ratio


def test_replay_drives_any_async_send_with_closed_loop_follow_ups() -> None:
    w = _conversations(n_conv=5, turns=3)
    order: list[int] = []

    async def send(req: Request) -> Usage:
        order.append(req.rid)
        await asyncio.sleep(0)
        if req.rid == 1:
            raise RuntimeError("replica down")
        return Usage(req.prompt_tokens, req.prompt_tokens // 2, 0.01)

    results = asyncio.run(replay(w, send, speed=1000.0))
    assert [r.rid for r in results] == list(range(len(w.requests)))
    assert order.index(1) < order.index(2), "a follow-up waits for its turn"
    summary = summarise(results)
    assert summary["errors"] == 1 and 0.45 < summary["hit_ratio"] <= 0.5


def test_quick_benchmark_runs(tmp_path: Path, capsys) -> None:
    code = bench_routing.main(["--quick", "--workloads", "shared_prefix", "unique", "--out", str(tmp_path)])
    assert code == 0
    out = capsys.readouterr().out
    assert "prefix_affinity" in out and "sglang_cache_aware" in out and "membership" in out
    assert "run_bounded_reference" in out and "TTFT p50" in out and "KV pool per replica" in out
    data = json.loads((tmp_path / "routing.json").read_text())
    assert {d["workload"] for d in data} == {"shared_prefix", "unique"}
    # Pools under pressure: sized from each workload (unique prompts reuse nothing: the floor).
    args = bench_routing.parse(["--quick"])
    for d in data:
        (w,) = bench_routing.build_workloads(argparse.Namespace(**{**vars(args), "workloads": [d["workload"]]}))
        pool = pool_size(w, args.replicas)
        assert d["pool_tokens"] == pool.kv_tokens and d["working_set_tokens"] == pool.working_set
    assert next(d for d in data if d["workload"] == "unique")["working_set_tokens"] == 0
    # ttft's belief of what the chosen replica held, against the cached tokens it reported: close
    # on shared prefixes, where one instance sees every placement; no belief without a policy's.
    rows = {r["label"]: r for r in next(d for d in data if d["workload"] == "shared_prefix")["rows"]}
    assert 0.0 <= rows["ttft"]["belief_gap"] < 0.1 and rows["round_robin"]["belief_gap"] is None
    assert (tmp_path / "routing.png").stat().st_size > 10_000


def test_the_tuning_set_has_one_organisation_layered_workload_of_its_own() -> None:
    args = bench_routing.parse(["--quick", "--workloads", "orgs_layered"])
    (w,) = bench_routing.build_workloads(args)
    family = bench_routing.layered_tuning(args.replicas)
    assert w.name == "orgs_layered" and len(w.requests) == 160
    assert w.closed_loop == ClosedLoop(2 * args.replicas)
    assert family.orgs_per_replica not in {f.orgs_per_replica for f in LAYERED}  # not one of the suite's
    assert len(layered_layout(family, args.layered_seed).org_weights) == 3 * args.replicas


def test_a_replica_at_half_speed_learns_half_the_rate_and_ttft_gives_it_less_cold_work() -> None:
    from bench.routing_speeds import run

    def table(family: str) -> dict[str, list[str]]:
        rows = run(family, 1, 0.5, ("round_robin", "ttft"), 300)
        return {line.split()[0]: line.split() for line in rows[2:]}

    # Round robin gives r0 its share of the prompt tokens; ttft, knowing its rate, much less.
    heavy = table("heavy4-closed8")  # short queues: the rate a replica reports is its speed
    for name in ("round_robin", "ttft"):
        assert 0.4 < float(heavy[name][3]) < 0.6  # r0 reports about half the others' rate
    assert float(heavy["round_robin"][4]) > 0.8 and float(heavy["ttft"][4]) < 0.5
    layered = table("layered-8orgs-closed8")  # and on organisation-layered traffic
    assert float(layered["round_robin"][4]) > 0.9 and float(layered["ttft"][4]) < 0.65


def test_end_to_end_runs_any_family_on_its_own_fleet_at_its_own_load_and_refuses_mixed_fleets() -> None:
    from bench import routing_e2e

    args = argparse.Namespace(requests=40)
    # The untuned suite's families run end to end by name, each seed a draw of its own.
    assert routing_e2e.replicas_for("chat-closed32") == 8 and routing_e2e.replicas_for("shared_prefix") == 4
    assert routing_e2e.family_of("orgs_layered").name == "layered-4orgs-closed8"
    two, three = (routing_e2e.build("layered-8orgs-closed8", args, seed) for seed in (2, 3))
    assert two.closed_loop is not None and two.closed_loop.clients == 8
    assert len(two.requests) == 40 and two.requests[0].kv_hashes != three.requests[0].kv_hashes
    # An open-loop family keeps its own arrivals, rescaled to its load on these replicas' timing:
    # the conversations start at the rate ``at_load`` returns, and at twice the load in half the time.
    family = routing_e2e.family_of("orgs-poisson-0.5")
    assert family is not None and family.closed_loop is None
    opened = routing_e2e.build(family.name, args, 1)
    starts = sorted(r.arrival for r in opened.requests if r.after is None)
    raw = generated_build(family, 1, 40)
    rate = routing_e2e.at_load(raw, family.replicas, family.load)
    assert opened.closed_loop is None and starts == sorted(r.arrival for r in raw.requests if r.after is None)
    per_start = len(opened.requests) / len(starts)
    assert (len(starts) - 1) / (starts[-1] - starts[0]) * per_start == pytest.approx(rate)
    routing_e2e.at_load(raw, family.replicas, 2 * family.load)
    twice = sorted(r.arrival for r in raw.requests if r.after is None)
    assert twice[-1] - twice[0] == pytest.approx((starts[-1] - starts[0]) / 2)
    with pytest.raises(SystemExit):
        routing_e2e.main(["--workloads", "chat-closed32", "heavy4-closed8"])
    # A row that reads KV events needs replicas that publish them.
    for row in routing_e2e.PRECISE_ROWS:
        with pytest.raises(SystemExit):
            routing_e2e.main(["--workloads", "heavy4-closed8", "--policies", row])


def test_end_to_end_reads_and_clears_the_routing_facts_a_run_left_in_redis(private_redis) -> None:
    import redis

    from bench import routing_e2e

    r = redis.Redis.from_url(private_redis.url)
    try:
        r.xadd("kvgate:routing:facts:abc", {"src": "x", "facts": "[]"})
        r.xadd("kvgate:routing:facts:abc", {"src": "x", "facts": "[]"})
        r.set("kvgate:sc:other", "kept")
        seen = routing_e2e.facts_stream(private_redis.url)
        assert seen["entries"] == 2 and seen["bytes"] > 0
        assert routing_e2e.facts_stream(private_redis.url) == {"entries": 0, "bytes": 0}
        assert r.get("kvgate:sc:other") == b"kept"
    finally:
        r.close()


def test_the_homes_diagnostic_runs_its_oracle_rows_interpreted() -> None:
    # bench.routing_homes replaces a routing function for its oracle rows, so it runs interpreted;
    # a renamed function once broke it unseen.
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(
        [sys.executable, "-m", "bench.routing_homes", "--families", "heavy4-closed8", "--seeds", "1",
         "--rows", "none", "index"], check=False, cwd=root, capture_output=True, text=True, timeout=300,
        env={**os.environ, "KVGATE_INTERPRETED": "1", "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line.split("|") for line in out.stdout.splitlines() if line.startswith("| heavy4-closed8 | 1 |")]
    assert [r[3].strip() for r in rows] == ["ttft", "ttft x4", "ttft x4, one index"]
    # The oracle gives the instances something: a different run from sharing nothing.
    assert rows[1][4:7] != rows[2][4:7]


def test_the_facts_cost_bench_applies_a_block_fact_and_a_done_per_request() -> None:
    from bench import facts_cost

    r = facts_cost.measure("heavy4-closed8", 1, 60)
    assert r["facts"] == 120 and r["bytes_per_request"] > 100 and r["per_request_us"] > 0
