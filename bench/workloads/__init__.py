"""Benchmark workloads: the same request stream, replayable through any router.

A ``Workload`` is a list of ``Request`` objects. Each carries what a client
sends (``body()``, built lazily so huge prompts are not all held at once) and
what the simulated engine needs (its token count and the engine's own KV block
hashes, computed once with ``vllm_sim.kv.block_hashes`` so every policy replays
identical engine-side work).

Arrivals are absolute (``arrival`` seconds) or closed-loop: a follow-up turn
with ``after`` set arrives ``arrival`` seconds after that request completes,
as a person reads the answer before typing the next turn.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

__all__ = ["Request", "Workload", "Interner"]


@dataclass(slots=True)
class Request:
    rid: int
    endpoint: str  # "chat" | "completions"
    model: str
    namespace: str
    build: Callable[[], dict[str, Any]]
    prompt_tokens: int
    output_tokens: int
    kv_hashes: Sequence[bytes]
    arrival: float
    after: int | None = None
    # The previous turn of the same conversation (for "follow-ups land warm").
    prev: int | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def body(self) -> dict[str, Any]:
        return self.build()


@dataclass(slots=True)
class Workload:
    name: str
    requests: list[Request]
    description: str
    # Replicas' KV pool size (tokens) the workload is meant to stress by default.
    kv_tokens: int = 1 << 20

    @property
    def follow_ups(self) -> int:
        return sum(1 for r in self.requests if r.prev is not None)


class Interner:
    """Shares equal block-hash objects between requests (a long shared prefix is stored once)."""

    __slots__ = ("_seen",)

    def __init__(self) -> None:
        self._seen: dict[bytes, bytes] = {}

    def __call__(self, hashes: list[bytes]) -> list[bytes]:
        seen = self._seen
        return [seen.setdefault(h, h) for h in hashes]
