"""What one gateway instance tells the others about where keys live (optional, through Redis).

Without shared state, instances agree on a key's replica through hashing and
the load view they all scrape. What only one instance knows is where *it* sent
a key that the hash did not decide: a new conversation placed on the shortest
prefill queue, a key that spilled under load. With ``routing.share_index`` (and
a ``redis_url``), each instance publishes those facts and applies the others',
so the next turn of a conversation, arriving at any instance, follows it.

Three kinds of fact, kept apart as the policies keep them:

* ``HELD``: a replica served a request with this key, so it holds the prefix
  (the block index; published only when new to this instance);
* ``PLACED``: a new key was just sent to a replica whose answer has not come
  back yet (the young-key memory);
* ``BLOCKS`` (``ttft``): a request was sent to a replica, with the prompt's
  chained block hashes at the positions the block index records
  (``BlockIndex.positions``) and the chain's length, so the receiver records
  exactly what the sender's ``index.add`` and pool model did. A key alone says
  nothing of the prompt's depth or of the layers it shares with other keys (an
  organisation's policies under each person's profile): with key facts, four
  ``ttft`` instances did little better than sharing nothing (.769 against
  .778 on ``layered-4orgs-closed8`` seed 2); with block facts they keep 0.95
  of one instance's reuse in 14 of ``bench.routing_homes``'s 15 runs, against
  7 sharing nothing (docs/benchmarks/routing-ttft.md, seventh stop).
  Published for every placement, not only news: each one moves the
  receiver's LRU model of that pool. It also carries the prompt tokens the
  sender expects the replica to compute (``uncached``) and a number naming
  the request (``token``): the receiver queues them in its backlog of that
  replica's prefill (``routing.backlog``), as if it had sent them;
* ``DONE`` (``ttft``): the request ``token`` names had its first token from
  the replica, so its prefill is done there, and (prefill is first come,
  first served) so is everything queued before it, whoever sent it: the
  receiver clears its backlog up to where it queued that request. Without
  it, the others' tokens drained only at a rate learned from histograms
  that batching skews, and the tail barely moved (the seventh stop).

Facts are typed (``KeyFact``, ``BlockFact``: tuples, so a key fact compares
equal to its ``(kind, key, replica)``). A block fact is bounded: at most
``MAX_HASHES`` hashes (199 at the default ``max_blocks`` of 2048, about 3.3 KB
on the wire); past it the sender keeps the recorded positions of a shorter
chain (a prefix of the positions is the positions of a prefix).

This module is the pure part: a bounded outbox that the hot path appends to,
and the wire format. ``gateway.routing_sync`` carries the facts through a Redis
stream; ``bench.routing_sim`` through a simulated delay. Facts are hints: a
lost or late one costs a cache miss, never a wrong answer. They carry hashes
and replica names, never prompt text.
"""

from __future__ import annotations

import re
import struct
from collections import deque
from typing import NamedTuple, Sequence, Union

import orjson

__all__ = ["HELD", "PLACED", "BLOCKS", "DONE", "MAX_HASHES", "KeyFact", "BlockFact", "Fact", "Gossip", "encode",
           "decode"]

HELD, PLACED, BLOCKS, DONE = "h", "p", "b", "d"
# Hashes one block fact may carry (and a chain length it may name): bounds a fact on the wire
# and what a malformed one could make a receiver record.
MAX_HASHES = 512
_MAX_BLOCKS = 1 << 22
_MAX_NAME = 256
# A prompt's uncached tokens on the wire: far above any context window, so garbage stays bounded.
_MAX_TOKENS = 1 << 24
_HEX = re.compile(r"[0-9a-f]*")
_MASK = 0xFFFFFFFFFFFFFFFF


class KeyFact(NamedTuple):
    """``HELD`` or ``PLACED``: the prefix ``key`` names is (or is about to be) at ``replica``.
    ``DONE``: the request ``key`` (a block fact's ``token``) had its first token from ``replica``."""

    kind: str
    key: int
    replica: str


class BlockFact(NamedTuple):
    """``BLOCKS``: ``replica`` was sent a prompt with routing key ``key``, whose chain is
    ``blocks`` long and has ``hashes`` at the positions ``BlockIndex.positions(blocks)`` names."""

    kind: str
    key: int
    replica: str
    blocks: int
    hashes: tuple[int, ...]
    uncached: int = 0  # prompt tokens the sender expects the replica to compute
    token: int = 0  # names the request for its DONE fact (0: none follows)


Fact = Union[KeyFact, BlockFact]


class Gossip:
    """The facts this instance has not published yet (oldest dropped past ``capacity``).

    ``listening``: whether another instance is there to hear them. The carrier clears it while
    it hears no other (``gateway.routing_sync``): then nothing is noted, and a lone instance with
    a Redis pays nothing for facts nobody would read (0.2-0.3 ms of CPU a request,
    publishing and reading its own facts back: docs/benchmarks/routing-ttft.md, ninth stop)."""

    __slots__ = ("_out", "published", "applied", "listening")

    def __init__(self, capacity: int = 10_000) -> None:
        self._out: deque[Fact] = deque(maxlen=capacity)
        self.published = 0
        self.applied = 0
        self.listening = True

    def __len__(self) -> int:
        return len(self._out)

    def note(self, kind: str, key: int, replica: str) -> None:
        if self.listening:
            self._out.append(KeyFact(kind, key, replica))

    def note_blocks(self, key: int, replica: str, blocks: int, hashes: Sequence[int], uncached: int = 0,
                    token: int = 0) -> None:
        """A block fact; ``hashes`` are the chain's at ``BlockIndex.positions(blocks)``. Past
        ``MAX_HASHES`` the positions of a shorter chain are kept (the same recorded prefix)."""
        if not 0 < len(hashes) <= MAX_HASHES:
            # Only the index knows which shorter chain a prefix of the positions stands for.
            raise ValueError("hashes: 1 to MAX_HASHES, capped by BlockIndex.recorded")
        if not self.listening:
            return
        self._out.append(BlockFact(BLOCKS, key, replica, blocks, tuple(hashes),
                                   min(max(0, uncached), _MAX_TOKENS), token & _MASK))

    def drain(self, limit: int = 1000) -> list[Fact]:
        out: list[Fact] = []
        while self._out and len(out) < limit:
            out.append(self._out.popleft())
        self.published += len(out)
        return out

    def clear(self) -> None:
        """Drop what is pending, unpublished (the last other instance went away)."""
        self._out.clear()


def encode(facts: Sequence[Fact]) -> str:
    """Facts as one JSON document (one stream entry carries a batch). A key fact is
    ``[kind, key, replica]``; a block fact adds the chain's length and its hashes as one string
    of 16 hex digits each (no separators: a third of the bytes of a list of strings), then,
    when it names its request, its uncached tokens and its token."""
    out: list[list[object]] = []
    for fact in facts:  # indexed, not by name: a plain (kind, key, replica) tuple is a key fact too
        item: list[object] = [fact[0], f"{fact[1] & _MASK:016x}", fact[2]]
        if isinstance(fact, BlockFact):
            hashes = fact[4]
            item += [fact[3], struct.pack(f">{len(hashes)}Q", *(h & _MASK for h in hashes)).hex()]
            if fact.token:
                item += [fact.uncached, f"{fact.token & _MASK:016x}"]
        out.append(item)
    return orjson.dumps(out).decode()


def decode(text: str | bytes) -> list[Fact]:
    """The well-formed facts of ``encode``'s output; anything else (another version's, garbage) is skipped."""
    try:
        items = orjson.loads(text)
    except (orjson.JSONDecodeError, RecursionError):
        return []
    out: list[Fact] = []
    for item in items if isinstance(items, list) else ():
        fact = _fact(item)
        if fact is not None:
            out.append(fact)
    return out


def _fact(item: object) -> Fact | None:
    if not isinstance(item, list) or len(item) not in (3, 5, 7):
        return None
    kind, digits, replica = item[:3]
    if not (isinstance(kind, str) and isinstance(digits, str) and isinstance(replica, str)):
        return None
    if len(digits) != 16 or not _HEX.fullmatch(digits) or not 0 < len(replica) <= _MAX_NAME:
        return None
    key = int(digits, 16)
    if len(item) == 3:
        return KeyFact(kind, key, replica) if kind in (HELD, PLACED, DONE) else None
    blocks, packed = item[3:5]
    if kind != BLOCKS or not isinstance(blocks, int) or isinstance(blocks, bool) or not isinstance(packed, str):
        return None
    count, rest = divmod(len(packed), 16)
    if rest or not 0 < blocks <= _MAX_BLOCKS or not 0 < count <= min(MAX_HASHES, blocks) \
            or not _HEX.fullmatch(packed):
        return None
    uncached, token = 0, 0
    if len(item) == 7:
        uncached, tag = item[5:]
        if not (_count(uncached) and isinstance(tag, str) and len(tag) == 16 and _HEX.fullmatch(tag)):
            return None
        token = int(tag, 16)
    # Checked hex digits above (bytes.fromhex alone would take spaces between pairs).
    return BlockFact(BLOCKS, key, replica, blocks, struct.unpack(f">{count}Q", bytes.fromhex(packed)), uncached, token)


def _count(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= _MAX_TOKENS
