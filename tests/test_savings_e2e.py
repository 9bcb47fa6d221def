"""``bench.savings_e2e`` over real processes: kvgate's round-robin estimate against a real round-robin replay.

A tiny generated workload (groups of prompts sharing a system prompt) on two ``vllm_sim`` replicas
whose pools hold it all, one request at a time: both runs then send the same requests in the same
order, and round robin's real cost is what the shadow models with nothing left to chance but its
conversion of routing blocks to tokens.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench.chaos_fleet import start_sims
from bench.routing_e2e import SIM_FLAGS
from bench.savings_e2e import HEADER, check, row
from bench.workloads.shared_prefix import build

POOL_BLOCKS = 4096  # 65,536 tokens a replica: the workload (about 6,000 distinct tokens) is never evicted


def test_the_estimate_is_the_real_round_robin_replay() -> None:
    # Four system prompts of 512 tokens, six questions each, shuffled: under round robin on two
    # replicas every group's prompt is computed on both (about 8 x 512 tokens), under prefix
    # affinity on one.
    w = build(groups=4, per_group=6, system_tokens=512, question_tokens=32, output_tokens=4, seed=5)
    sims = start_sims(["r1", "r2"], {"kv_blocks": POOL_BLOCKS, **SIM_FLAGS})
    try:
        with tempfile.TemporaryDirectory(prefix="kvgate-savings-e2e-test-") as workdir:
            c = check(w, POOL_BLOCKS, sims, Path(workdir), argparse.Namespace(concurrency=1, speed=1e6))
    finally:
        for s in sims:
            s.kill()
    print(HEADER + "\n" + row(c))
    assert c.errors == 0 and c.requests == 24
    # kvgate's own side is what the replicas counted.
    assert c.actual == c.actual_replicas
    # Round robin really computed more: the second copy of at least two groups' system prompt
    # (all four when prefix affinity keeps each group on one replica, as it does here unless the
    # load it reads says otherwise).
    assert c.real_rr - c.actual > 2 * 512
    # The estimate against the real replay (the bound).
    assert abs(c.error) <= 0.10, row(c)
