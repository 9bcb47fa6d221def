"""bench.pd runs end to end: vLLM's router in P/D mode over simulated prefill and decode processes.

A handful of requests, not timed: every request is prefilled on a prefill replica and
decoded on a decode replica that pulled its KV, every answer is the one a plain
replica gives, and the ``direct`` reference row pulls nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.pd import parse_args, run
from bench.vllm_router import vllm_router_binary

pytestmark = pytest.mark.skipif(vllm_router_binary() is None, reason="vllm-router is not installed (bench extra)")

REQUESTS = 12


def test_the_harness_runs_vllm_router_disaggregated_and_direct(tmp_path: Path) -> None:
    rows = run(parse_args(["--requests", str(REQUESTS), "--rows", "vllm-router", "direct", "--time-scale", "0.2",
                           "--out", str(tmp_path)]))
    by_row = {r["row"]: r for r in rows}
    assert set(by_row) == {"vllm-router", "direct"}
    for r in rows:
        assert r["requests"] == REQUESTS and r["errors"] == 0 and r["wrong"] == 0, r
        assert sum(r["prefill_requests"]) == REQUESTS  # each prompt prefilled once, where the row sent it
        assert min(r["prefill_requests"]) > 0  # round robin used both
    router = by_row["vllm-router"]
    assert sum(router["decode_requests"]) == REQUESTS and min(router["decode_requests"]) > 0
    assert router["pulled_tokens"] > 0
    assert by_row["direct"]["pulled_tokens"] == 0 and by_row["direct"]["decode_requests"] == []
    assert (tmp_path / "pd.json").exists()
