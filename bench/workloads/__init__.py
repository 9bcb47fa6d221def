"""Benchmark workloads: the same request stream, replayable through any router.

A ``Workload`` is a list of ``Request`` objects. Each carries what a client
sends (``body()``, built lazily so huge prompts are not all held at once) and
what the simulated engine needs (its token count and the engine's own KV block
hashes, computed once with ``vllm_sim.kv.block_hashes`` so every policy replays
identical engine-side work).

Arrivals are absolute (``arrival`` seconds) or closed-loop: a follow-up turn
with ``after`` set arrives ``arrival`` seconds after that request completes,
as a person reads the answer before typing the next turn.

A workload can instead be replayed by a fixed number of clients
(``ClosedLoop``): each client takes the next conversation (``chains``), sends
its turns one after another, each as soon as the previous one completes, then
takes the next conversation; absolute arrivals and think times are ignored.
With ``on_s`` set the clients work in bursts: they send only during the first
``on_s`` of every ``on_s + off_s`` seconds, so every burst starts with all of
them at once. The simulator and ``bench.routing_replay`` both replay it so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

__all__ = ["Request", "Workload", "Interner", "ClosedLoop", "chains"]


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


@dataclass(frozen=True, slots=True)
class ClosedLoop:
    """``clients`` concurrent clients, each sending its next request when the previous one completes."""

    clients: int
    on_s: float | None = None  # bursts: send only during the first on_s of every on_s + off_s
    off_s: float = 0.0

    def __post_init__(self) -> None:
        if self.clients < 1:
            raise ValueError("clients must be >= 1")
        if self.on_s is not None and (self.on_s <= 0 or self.off_s < 0):
            raise ValueError("on_s must be > 0 and off_s >= 0")

    @classmethod
    def of(cls, clients: int, burst: Sequence[float] | None = None) -> "ClosedLoop | None":
        """From command-line flags: ``--clients N`` (0: open loop) and ``--burst ON_S OFF_S``."""
        if not clients:
            return None
        on, off = burst or (None, 0.0)
        return cls(clients, on, off)

    def next_start(self, now: float) -> float:
        """The earliest time at or after ``now`` a client may send (the next burst, when between bursts)."""
        if self.on_s is None or self.off_s == 0:
            return now
        cycle = self.on_s + self.off_s
        start = math.floor(now / cycle) * cycle
        return now if now - start < self.on_s else start + cycle

    def label(self) -> str:
        burst = f", bursts {self.on_s:g}s on / {self.off_s:g}s off" if self.on_s is not None else ""
        return f"closed loop, {self.clients} clients{burst}"


@dataclass(slots=True)
class Workload:
    name: str
    requests: list[Request]
    description: str
    # Replay by a fixed number of clients instead of the requests' own arrivals.
    closed_loop: ClosedLoop | None = None

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


def chains(workload: Workload) -> list[list[Request]]:
    """Conversations for closed-loop clients: each root request, then its follow-ups depth first.

    Roots in arrival order; a request whose ``after`` is not in the workload
    starts a conversation of its own.
    """
    rids = {r.rid for r in workload.requests}
    followers: dict[int, list[Request]] = {}
    roots: list[Request] = []
    for r in workload.requests:
        if r.after is not None and r.after in rids:
            followers.setdefault(r.after, []).append(r)
        else:
            roots.append(r)
    out: list[list[Request]] = []
    for root in sorted(roots, key=lambda r: (r.arrival, r.rid)):
        chain: list[Request] = []
        stack = [root]
        while stack:
            r = stack.pop()
            chain.append(r)
            stack.extend(reversed(followers.get(r.rid, ())))
        out.append(chain)
    return out
