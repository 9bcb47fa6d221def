"""What one gateway instance tells the others about where keys live (optional, through Redis).

Without shared state, instances agree on a key's replica through hashing and
the load view they all scrape. What only one instance knows is where *it* sent
a key that the hash did not decide: a new conversation placed on the shortest
prefill queue, a key that spilled under load. With ``routing.share_index`` (and
a ``redis_url``), each instance publishes those facts and applies the others',
so the next turn of a conversation, arriving at any instance, follows it.

Two kinds of fact, kept apart as the policy keeps them:

* ``HELD``: a replica served a request with this key, so it holds the prefix
  (the block index; published only when new to this instance);
* ``PLACED``: a new key was just sent to a replica whose answer has not come
  back yet (the young-key memory).

This module is the pure part: a bounded outbox that the hot path appends to,
and the wire format. ``gateway.routing_sync`` carries the facts through a Redis
stream; ``bench.routing_sim`` through a simulated delay. Facts are hints: a
lost or late one costs a cache miss, never a wrong answer.
"""

from __future__ import annotations

import json
from collections import deque

__all__ = ["HELD", "PLACED", "Fact", "Gossip", "encode", "decode"]

HELD, PLACED = "h", "p"
Fact = tuple[str, int, str]  # (kind, routing key, replica name)
_MAX_NAME = 256


class Gossip:
    """The facts this instance has not published yet (oldest dropped past ``capacity``)."""

    __slots__ = ("_out", "published", "applied")

    def __init__(self, capacity: int = 10_000) -> None:
        self._out: deque[Fact] = deque(maxlen=capacity)
        self.published = 0
        self.applied = 0

    def __len__(self) -> int:
        return len(self._out)

    def note(self, kind: str, key: int, replica: str) -> None:
        self._out.append((kind, key, replica))

    def drain(self, limit: int = 1000) -> list[Fact]:
        out: list[Fact] = []
        while self._out and len(out) < limit:
            out.append(self._out.popleft())
        self.published += len(out)
        return out


def encode(facts: list[Fact]) -> str:
    """Facts as one JSON document (one stream entry carries a batch)."""
    return json.dumps([[kind, f"{key & 0xFFFFFFFFFFFFFFFF:016x}", replica] for kind, key, replica in facts],
                      separators=(",", ":"))


def decode(text: str | bytes) -> list[Fact]:
    """The well-formed facts of ``encode``'s output; anything else (another version's, garbage) is skipped."""
    try:
        items = json.loads(text)
    except ValueError:
        return []
    out: list[Fact] = []
    for item in items if isinstance(items, list) else ():
        if not (isinstance(item, list) and len(item) == 3 and all(isinstance(x, str) for x in item)):
            continue
        kind, digits, replica = item
        if kind not in (HELD, PLACED) or len(digits) != 16 or not 0 < len(replica) <= _MAX_NAME:
            continue
        try:
            out.append((kind, int(digits, 16), replica))
        except ValueError:
            continue
    return out
