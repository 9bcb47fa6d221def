"""The Mooncake conversation trace (Kimi, FAST'25), replayed as text.

Each ``hash_id`` (one per 512-token block, prefix-chained) becomes a
deterministic run of 512 one-token pseudo-words, so two requests share exactly
the leading blocks the trace says they share; a request's last block is the
first ``input_length - 512 x (blocks - 1)`` words of its block's run. Requests
are sent as completions (the trace has no message structure), so kvgate sees a
flat prompt whose first 512 tokens are in every request.

Subsampling, stated: by default the first ``minutes`` of the trace (all its
requests, so the reuse between them is exactly the trace's), with arrivals
compressed by the benchmark to put the fleet under load. A follow-up
(``prev``) is a request that continues an earlier request's full blocks beyond
the shared first one (33% of the whole trace).
"""

from __future__ import annotations

import json
from pathlib import Path

from vllm_sim.kv import block_hashes

from . import Interner, Request, Workload
from .text import TextBank

__all__ = ["build"]

FILE = "traces/mooncake_conversation.jsonl"
BLOCK = 512


def _load(data: Path, minutes: float) -> list[dict]:
    rows = []
    with open(data / FILE) as fh:
        for line in fh:
            row = json.loads(line)
            if row["timestamp"] >= minutes * 60_000:
                break
            rows.append(row)
    return rows


def _previous(rows: list[dict]) -> list[int | None]:
    """For each request, the latest earlier one whose full blocks (two or more) it continues.

    Ids are prefix-chained, so a chain of full blocks is identified by its last id.
    """
    latest: dict[int, int] = {}
    out: list[int | None] = []
    for rid, row in enumerate(rows):
        ids = row["hash_ids"]
        prev = None
        for i in range(len(ids) - 1, 1, -1):
            if ids[i - 1] in latest:
                prev = latest[ids[i - 1]]
                break
        out.append(prev)
        if len(ids) >= 3:
            latest[ids[-2]] = rid
    return out


def _pieces(row: dict) -> list[tuple[int, int]]:
    ids = row["hash_ids"]
    tail = min(BLOCK, max(1, row["input_length"] - BLOCK * (len(ids) - 1)))
    return [(h, BLOCK) for h in ids[:-1]] + [(ids[-1], tail)]


def build(data: Path, minutes: float = 10.0) -> Workload:
    bank, intern = TextBank(5, memo=1 << 15), Interner()
    rows = _load(data, minutes)
    prevs = _previous(rows)
    requests: list[Request] = []
    for rid, row in enumerate(rows):
        pieces = _pieces(row)
        ids: list[int] = []
        for h, n in pieces:
            ids += bank.run_ids(f"mc:{h}", n)

        def body(pieces: list[tuple[int, int]] = pieces, out: int = row["output_length"]) -> dict:
            prompt = "".join(bank.run(f"mc:{h}", n) for h, n in pieces)
            return {"model": "mooncake", "prompt": prompt, "max_tokens": out}

        requests.append(Request(
            rid=rid, endpoint="completions", model="mooncake", namespace="kimi", build=body,
            prompt_tokens=len(ids), output_tokens=max(1, row["output_length"]),
            kv_hashes=intern(block_hashes(ids)), arrival=row["timestamp"] / 1000.0, prev=prevs[rid],
        ))
    follow = sum(1 for p in prevs if p is not None)
    return Workload("mooncake", requests, f"Mooncake conversation trace, first {minutes:g} min: "
                    f"{len(requests)} requests, {follow / max(1, len(requests)):.0%} follow-ups")
