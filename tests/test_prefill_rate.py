"""Each replica's prefill rate, learned from vLLM's per-request prefill histograms, and its KV pool's size.

Real servers over loopback: a vllm_sim replica's ``/metrics`` carries
``vllm:request_prefill_time_seconds`` and ``vllm:request_prefill_kv_computed_tokens``
as vLLM 0.33 does, and a kvgate's pool scrapes them (``routing.rates``). The
fleet simulator keeps the same two sums.
"""

from __future__ import annotations

import argparse
import functools
import random
from typing import Any, Sequence

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.routing import POLICIES
from bench.routing_sim import SimSettings, simulate
from bench.workloads import ClosedLoop, Request, Workload
from routing.base import ReplicaView, RouteRequest
from routing.round_robin import RoundRobin
from tests.support.servers import ServerThread
from tests.support.stack import MODEL, start_stack
from vllm_sim.cli import add_arguments, config_from_args
from vllm_sim.config import SimConfig
from vllm_sim.kv import block_hashes
from vllm_sim.process import sim_flags
from vllm_sim.server import build_app as build_sim
from vllm_sim.timing import TimingModel

TIME = "vllm:request_prefill_time_seconds"
TOKENS = "vllm:request_prefill_kv_computed_tokens"


def _prompts(seed: int, n: int) -> list[list[int]]:
    """Prompts of 100-1,500 token ids, half of them behind one of three shared 320-token prefixes."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 50_000) for _ in range(320)] for _ in range(3)]
    out = []
    for _ in range(n):
        tail = [rng.randrange(1, 50_000) for _ in range(rng.randrange(100, 1200))]
        out.append(rng.choice(prefixes) + tail if rng.random() < 0.5 else tail)
    return out


def _complete(url: str, prompt: list[int], max_tokens: int = 2) -> dict[str, Any]:
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens},
                   timeout=10)
    r.raise_for_status()
    return r.json()["usage"]  # type: ignore[no-any-return]


def _histogram(text: str, name: str) -> tuple[list[tuple[float, float]], float, float]:
    """(cumulative buckets by upper bound, _sum, _count) of one histogram, read by prometheus_client's parser."""
    family = next(f for f in text_string_to_metric_families(text) if f.name == name)
    assert family.type == "histogram"
    buckets = [(float(s.labels["le"]), s.value) for s in family.samples if s.name == name + "_bucket"]
    total = next(s.value for s in family.samples if s.name == name + "_sum")
    count = next(s.value for s in family.samples if s.name == name + "_count")
    for s in family.samples:
        assert s.labels["model_name"] == MODEL and s.labels["engine"] == "0"
    return buckets, total, count


def test_sim_prefill_histograms_sum_the_prefills_done() -> None:
    timing = TimingModel(time_scale=0.001)
    app = build_sim(SimConfig(model=MODEL, timing=timing, max_model_len=4096))
    server = ServerThread(app).start()
    try:
        empty = httpx.get(server.url + "/metrics", timeout=5).text
        assert _histogram(empty, TIME)[1:] == (0.0, 0.0) and _histogram(empty, TOKENS)[1:] == (0.0, 0.0)
        computed, seconds = [], 0.0
        for prompt in _prompts(1, 12):
            # One at a time: each prefill is a step of its own, with nothing decoding beside it.
            usage = _complete(server.url, prompt)
            uncached = usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]
            computed.append(uncached)
            seconds += timing.prefill_time(uncached)
        assert any(c < len(p) for c, p in zip(computed, _prompts(1, 12))), "some prompt hit the prefix cache"
        text = httpx.get(server.url + "/metrics", timeout=5).text
        buckets, total, count = _histogram(text, TOKENS)
        assert (total, count) == (sum(computed), 12)
        # vLLM's 1-2-5 series up to max_model_len, then +Inf; cumulative.
        assert [b for b, _ in buckets] == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, float("inf")]
        assert buckets == [(b, float(sum(c <= b for c in computed))) for b, _ in buckets]
        buckets, total, count = _histogram(text, TIME)
        assert count == 12 and total == pytest.approx(seconds, rel=1e-9)
        assert buckets[0] == (0.3, 12.0) and buckets[-1] == (float("inf"), 12.0)  # vLLM's latency bounds
        assert [b for b, _ in buckets][:4] == [0.3, 0.5, 0.8, 1.0]
        stats = httpx.get(server.url + "/sim/stats", timeout=5).json()
        assert stats["prefills"] == 12 and stats["prefill_computed_tokens_sum"] == sum(computed)
    finally:
        server.stop()


def _sim_from_cli(**flags: Any) -> ServerThread:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = config_from_args(parser.parse_args(sim_flags(model=MODEL, time_scale=0.001, **flags)))
    return ServerThread(build_sim(config)).start()


def test_gateway_pool_learns_half_the_rate_on_a_replica_at_half_prefill_speed() -> None:
    slow = _sim_from_cli(name="slow", prefill_speed=0.5, kv_blocks=1000, block_size=32)
    fast = _sim_from_cli(name="fast", prefill_speed=1.0)
    sims = {"slow": slow, "fast": fast}
    stack = start_stack(0, admin_token="admin-token",
                        replicas=[{"name": name, "url": s.url} for name, s in sims.items()],
                        pool={"health_interval_s": 60, "metrics_interval_s": 0.05})
    stack.extra += sims.values()
    try:
        for prompt in _prompts(2, 16):
            for s in sims.values():  # the same traffic, in the same order, to both
                _complete(s.url, prompt, max_tokens=3)
        expected = {}
        for name, s in sims.items():
            st = httpx.get(s.url + "/sim/stats", timeout=5).json()
            assert st["prefills"] == 16
            expected[name] = st["prefill_computed_tokens_sum"] / st["prefill_seconds_sum"]

        def rows() -> dict[str, dict[str, Any]]:
            r = httpx.get(stack.admin.url + "/admin/replicas", timeout=5,  # type: ignore[union-attr]
                          headers={"authorization": "Bearer admin-token"})
            return {row["name"]: row for row in r.json()["replicas"]}

        # Scraped after the traffic: the pool's figure is the replica's own.
        assert stack.wait_for(lambda: all(rows()[n]["prefill_rate"] == pytest.approx(expected[n], rel=1e-9)
                                          for n in sims))
        got = rows()
        assert got["slow"]["prefill_rate"] / got["fast"]["prefill_rate"] == pytest.approx(0.5, rel=0.15)
        assert got["slow"]["kv_tokens"] == 1000 * 32 and got["fast"]["kv_tokens"] == 8192 * 16
        pool = stack.runtime.pool.replicas
        assert pool["slow"].prefill_rate == got["slow"]["prefill_rate"] and pool["fast"].kv_tokens == 8192 * 16
    finally:
        stack.close()


def _body(ids: list[int]) -> dict[str, Any]:
    return {"model": MODEL, "prompt": ids}


def _workload(seed: int, n: int, block_size: int = 16) -> Workload:
    """Org-layered prompts (eight shared 1-3K-token prefixes, 200-2K-token tails), eight output tokens."""
    rng = random.Random(seed)
    orgs = [[rng.randrange(1, 50_000) for _ in range(rng.randrange(1000, 3000))] for _ in range(8)]
    requests = []
    for rid in range(n):
        ids = rng.choice(orgs) + [rng.randrange(1, 50_000) for _ in range(rng.randrange(200, 2000))]
        requests.append(Request(rid, "completions", MODEL, "default", functools.partial(_body, ids),
                                len(ids), 8, block_hashes(ids, block_size), arrival=0.0))
    # One client per replica: the rate is per request, so a replica that batches several
    # prefills into one step reports less than its speed (routing.rates); four keep batches rare.
    return Workload("orgs", requests, "org-layered prompts", closed_loop=ClosedLoop(4))


class _Watching(RoundRobin):
    """Round robin that keeps the views it is given (the instance's own, updated by every scrape)."""

    def __init__(self) -> None:
        super().__init__()
        self.views: Sequence[ReplicaView] = ()

    def prefer(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
        self.views = replicas
        return super().prefer(request, replicas)


@pytest.mark.parametrize("policy", ["round_robin", "least_load"])
def test_fleet_sim_replica_at_half_speed_learns_half_the_rate(policy: str) -> None:
    settings = SimSettings(replicas=4, kv_tokens=1 << 18, speeds=(0.5, 1.0, 1.0, 1.0))
    stats = simulate(_workload(3, 400), POLICIES[policy], settings)
    slow, *others = stats.prefill_rates
    assert slow is not None and all(r is not None for r in others)
    mean = sum(others) / len(others)  # type: ignore[arg-type]
    assert slow / mean == pytest.approx(0.5, rel=0.15)
    for r in others:
        assert r == pytest.approx(mean, rel=0.15)  # type: ignore[arg-type]
    assert stats.hit_ratio > 0.3  # the prefixes were reused: the rate counts computed tokens only


def test_fleet_sim_scrape_gives_every_instance_the_rates_and_pool_sizes() -> None:
    routers: list[_Watching] = []

    def make(clock: object) -> _Watching:
        routers.append(_Watching())
        return routers[-1]

    settings = SimSettings(replicas=4, kv_tokens=1 << 18, speeds=(0.5, 1.0, 1.0, 1.0), instances=2, scrape_s=0.5)
    simulate(_workload(4, 300), make, settings)
    seen = [{v.name: (v.prefill_rate, v.kv_tokens) for v in r.views} for r in routers]
    assert seen[0] == seen[1] and set(seen[0]) == {"r0", "r1", "r2", "r3"}
    rates = {name: rate for name, (rate, _) in seen[0].items()}
    assert all(rate is not None for rate in rates.values())
    assert rates["r0"] / rates["r1"] == pytest.approx(0.5, rel=0.15)  # type: ignore[operator]
    assert {kv for _, kv in seen[0].values()} == {float(1 << 18)}


def test_fleet_sim_speeds_must_match_the_replicas() -> None:
    with pytest.raises(ValueError, match="speeds"):
        simulate(_workload(3, 10), POLICIES["round_robin"], SimSettings(replicas=4, speeds=(0.5, 1.0)))
    with pytest.raises(ValueError, match="prefill_speed"):
        TimingModel(prefill_speed=0)
