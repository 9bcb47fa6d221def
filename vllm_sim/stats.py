"""Counters the engine keeps, for ``GET /sim/stats``, ``/metrics`` and tests.

Bounded by construction: per-request records keep only the most recent
``RECENT`` entries, so a benchmark pushing millions of requests through one
replica does not grow its memory.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

__all__ = ["EngineStats"]

RECENT = 1024


@dataclass(slots=True)
class EngineStats:
    requests: int = 0
    completed: int = 0
    aborted: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished_by_reason: dict[str, int] = field(default_factory=dict)
    last_cached_tokens: int | None = None
    # request id -> cached prompt tokens, most recent last.
    cached_tokens: OrderedDict[str, int] = field(default_factory=OrderedDict)
    # (request id, wall-clock time of the abort), most recent last.
    aborts: deque[tuple[str, float]] = field(default_factory=lambda: deque(maxlen=RECENT))

    def record_cached(self, request_id: str, tokens: int) -> None:
        self.last_cached_tokens = tokens
        self.cached_tokens[request_id] = tokens
        if len(self.cached_tokens) > RECENT:
            self.cached_tokens.popitem(last=False)

    def record_finish(self, reason: str) -> None:
        self.completed += 1
        self.finished_by_reason[reason] = self.finished_by_reason.get(reason, 0) + 1

    def record_abort(self, request_id: str) -> None:
        self.aborted += 1
        self.aborts.append((request_id, time.time()))

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "completed": self.completed,
            "aborted": self.aborted,
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
            "finished_by_reason": dict(self.finished_by_reason),
            "last_cached_tokens": self.last_cached_tokens,
            "cached_tokens": dict(self.cached_tokens),
            "aborts": [{"id": rid, "time": t} for rid, t in self.aborts],
        }
