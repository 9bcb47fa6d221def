"""bench.pd_kvgate runs end to end: kvgate's P/D rows over simulated prefill and decode processes.

A handful of requests, not timed: every answer is the one a plain replica gives; always
disaggregating, every prompt is prefilled on a prefill replica and pulled by a decode one.
"""

from __future__ import annotations

from pathlib import Path

from bench.pd import parse_args, run
from bench.pd_kvgate import main  # noqa: F401  (registers kvgate's rows)

REQUESTS = 12


def test_kvgates_rows_run_always_and_selective(tmp_path: Path) -> None:
    rows = run(parse_args(["--requests", str(REQUESTS), "--rows", "kvgate-always", "kvgate-selective",
                           "--time-scale", "0.2", "--out", str(tmp_path)]))
    by_row = {r["row"]: r for r in rows}
    for r in rows:
        assert r["requests"] == REQUESTS and r["errors"] == 0 and r["wrong"] == 0, r
    always = by_row["kvgate-always"]
    assert sum(always["prefill_requests"]) == REQUESTS and sum(always["decode_requests"]) == REQUESTS
    assert always["pulled_tokens"] > 0
    # Selective: every request decoded on a decode replica, some prefilled there (none pulled for those).
    assert sum(by_row["kvgate-selective"]["decode_requests"]) >= REQUESTS
