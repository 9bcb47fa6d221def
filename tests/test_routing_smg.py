"""The real SGLang model gateway (``smg``) runs over ``vllm_sim`` replicas, as ``bench.routing_e2e`` needs.

smg only asks its workers for ``/health`` and ``/v1/models``; this checks that
the simulator is enough for it, that streamed usage (``cached_tokens``)
comes back through it, and that the replicas' own request counts see where
it sent each request.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import httpx
import pytest

from bench.chaos_fleet import start_sims
from bench.routing_e2e import max_over_mean, request_counts
from bench.smg import smg_binary, start_smg

pytestmark = pytest.mark.skipif(smg_binary() is None, reason="smg not installed (the bench extra)")


def _chat(url: str, text: str) -> dict:
    body = {"model": "sim-model", "messages": [{"role": "user", "content": text}], "max_tokens": 4}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
    r.raise_for_status()
    return r.json()["usage"]


def test_smg_cache_aware_routes_a_repeated_prefix_back_to_its_replica() -> None:
    sims = start_sims(["r1", "r2"], {"kv_blocks": 1024})
    with tempfile.TemporaryDirectory() as workdir:
        gw = start_smg("cache_aware", [s.url for s in sims], Path(workdir))
        try:
            prompt = "a shared organisation policy " * 40
            first = _chat(gw.url, prompt + "question one")
            again = [_chat(gw.url, prompt + f"question {k}") for k in range(3)]
            assert first["prompt_tokens_details"]["cached_tokens"] == 0
            assert all(u["prompt_tokens_details"]["cached_tokens"] > 0.8 * u["prompt_tokens"] for u in again)
            counts = request_counts(sims)
            assert sorted(counts) == [0, 4] and max_over_mean(counts) == 2.0
        finally:
            gw.proc.kill()
            gw.proc.wait(10)
            for s in sims:
                s.kill()
