"""vLLM's own router (``vllm-router``) runs over ``vllm_sim`` replicas, as ``bench.routing_e2e`` needs.

Its ``cache_aware`` policy tokenizes every request through the workers' render
route (``/v1/chat/completions/render``, falling back to ``/tokenize``; 0.1.17
asks every worker, each time), so this checks that a repeated prefix comes back to the replica that cached it,
that streamed usage (``cached_tokens``) comes back through it, and that the
replicas' own request counts see where it sent each request.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from bench.chaos_fleet import Sim, _kill, start_sims
from bench.routing_e2e import max_over_mean, request_counts, reset
from bench.vllm_router import start_vllm_router, vllm_router_binary

pytestmark = [pytest.mark.skipif(vllm_router_binary() is None, reason="vllm-router not installed (the bench extra)"),
              pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def sims() -> Iterator[list[Sim]]:
    fleet = start_sims(["r1", "r2"], {"kv_blocks": 1024})
    try:
        yield fleet
    finally:
        for s in fleet:
            s.kill()


def _chat(url: str, text: str) -> dict:
    body = {"model": "sim-model", "messages": [{"role": "user", "content": text}], "max_tokens": 4,
            "stream": True, "stream_options": {"include_usage": True}}
    usage: dict = {}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage") or usage
    return usage


@pytest.mark.parametrize("policy", ["cache_aware", "round_robin"])
def test_vllm_router_routes_over_the_simulator(sims: list[Sim], policy: str) -> None:
    reset(sims)
    with tempfile.TemporaryDirectory() as workdir:
        router = start_vllm_router(policy, [s.url for s in sims], Path(workdir))
        try:
            prompt = "a shared organisation policy " * 40
            first = _chat(router.url, prompt + "question one")
            again = [_chat(router.url, prompt + f"question {k}") for k in range(3)]
            counts = request_counts(sims)
            renders = sum(int(httpx.get(s.url + "/sim/stats", timeout=5).json()["renders"]) for s in sims)
        finally:
            _kill(router.proc)
    assert first["prompt_tokens_details"]["cached_tokens"] == 0 and first["prompt_tokens"] > 100
    if policy == "cache_aware":
        # Every repeat went back to the replica holding the prefix, and found it cached there.
        assert all(u["prompt_tokens_details"]["cached_tokens"] > 0.8 * u["prompt_tokens"] for u in again)
        assert sorted(counts) == [0, 4] and max_over_mean(counts) == 2.0
        # It tokenized each request through the render route of every worker (0.1.17 asks them all).
        assert renders == 4 * len(sims)
    else:
        assert sorted(counts) == [2, 2] and renders == 0
