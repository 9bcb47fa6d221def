"""Carry routing facts between gateway instances through a Redis stream (``routing.share_index``).

Off the hot path. Routing appends facts to the policy's outbox
(``routing.gossip``; policies that share nothing have none, and the loop idles);
this loop publishes them every ``flush_s`` as one stream
entry per batch, and tails the stream with a blocking ``XREAD`` on a
connection of its own, applying the other instances' facts. The stream is
capped (``MAXLEN ~``): facts are hints about the last seconds, not a log. They
hold routing-key and block hashes and replica names, never prompt text.

``ttft``'s block facts (``routing.gossip.BLOCKS``) carry a prompt's block
hashes at the positions the index records, up to 199 at the default
``max_blocks`` (about 3.3 KB; a key fact is about 50 bytes), one per request
routed: batches are sized for them, and every flush publishes all that is
pending, a batch per entry.

Facts are published only while another instance is there to read them. Each
instance adds an entry without facts (a heartbeat) every ``heartbeat_s``, and
the tail notes which other instances it heard; while none was heard within
three heartbeats, the policy notes no facts (``Gossip.listening``) and nothing
but the heartbeat is published. A lone instance with a Redis then costs what
it did sharing nothing: publishing every placement and reading it back cost it
0.2-0.3 ms of CPU a request (docs/benchmarks/routing-ttft.md,
ninth stop). A second instance is heard within a heartbeat and a read.

A Redis fault costs only the sharing: the loop logs once per outage, drops
what it could not send (the outbox is bounded anyway) and retries; routing
goes on from what this instance knows, as it does without Redis.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import Any, Callable, Iterable

import xxhash

from routing.gossip import Gossip, decode, encode

log = logging.getLogger("kvgate.routing")

STREAM = "kvgate:routing:facts"


def stream_for(fleet: Iterable[str]) -> str:
    """The stream of one fleet's facts, named by its replicas' addresses (and DNS name) as the
    configuration gives them: every instance of a deployment shares it, and another deployment
    on the same Redis, whose replicas may carry the same names, neither reads nor pollutes it
    (a fact names a replica by name, and a foreign backlog would look like a queue here)."""
    digest = xxhash.xxh64_hexdigest("\n".join(sorted(fleet)).encode())
    return f"{STREAM}:{digest[:12]}"


class RoutingSync:
    def __init__(self, policy: Callable[[], Any], client: Any, tail: Any, *, stream: str = STREAM,
                 flush_s: float = 0.05, block_ms: int = 1000, maxlen: int = 200, batch: int = 100,
                 retry_s: float = 1.0, heartbeat_s: float = 2.0) -> None:
        self.stream = stream
        self._heartbeat = heartbeat_s
        self._next_beat = 0.0
        # The other instances heard (their id -> when, monotonic): facts go out while any is.
        self._peers: dict[str, float] = {}
        self._policy = policy  # the runtime's current policy (an admin change replaces it)
        self._r = client  # publishes (the runtime's client; the runtime closes it)
        self._tail = tail  # blocks in XREAD: owned here, with a read timeout above block_ms
        self._flush = flush_s
        self._block = block_ms
        # Entries are batches of at most ``batch`` facts: an entry stays under about
        # 100 x 3.3 KB (block facts at the longest prompts), the stream under 200 such
        # however busy the fleet, and some seconds of facts at ordinary rates: at 50 ms
        # flushes an entry holds what one instance routed in 50 ms (the tail only ever
        # reads what is new, and a fact older than a second is worth little).
        self._maxlen = maxlen
        self._batch = batch
        self._retry = retry_s
        self.me = secrets.token_hex(8)
        self.failing = False

    def _gossip(self) -> Gossip | None:
        return getattr(self._policy(), "gossip", None)

    async def run(self) -> None:
        await asyncio.gather(self._publish_loop(), self._tail_loop())

    def heard(self) -> int:
        """Other instances heard within three heartbeats (a lost one or two is not a departure)."""
        since = time.monotonic() - 3 * self._heartbeat
        for src in [s for s, at in self._peers.items() if at < since]:
            del self._peers[src]
        return len(self._peers)

    async def _publish_loop(self) -> None:
        while True:
            await asyncio.sleep(self._flush)
            gossip = self._gossip()
            if gossip is None:
                continue
            listening = self.heard() > 0
            if listening != gossip.listening:
                # Once per change, not per flush (a fresh policy starts listening, and is told).
                log.info("routing facts: %s", f"{len(self._peers)} other instance(s) heard, sharing" if listening
                         else "no other instance heard, nothing shared")
            gossip.listening = listening
            if not listening:
                gossip.clear()  # noted before the last other instance went quiet
            if time.monotonic() >= self._next_beat:
                self._next_beat = time.monotonic() + self._heartbeat
                await self._add(encode([]))
            # All that is pending, a batch per entry: one batch a flush would cap an instance
            # at batch / flush_s facts a second, and block facts come one per request.
            while facts := gossip.drain(self._batch):
                if not await self._add(encode(facts)):
                    break

    async def _add(self, facts: str) -> bool:
        """One entry on the stream; False (after a pause) if Redis failed."""
        try:
            await self._r.xadd(self.stream, {"src": self.me, "facts": facts}, maxlen=self._maxlen, approximate=True)
            self._recovered()
            return True
        except Exception as e:  # the loop never dies: sharing is a hint
            self._fault("publish", e)
            await asyncio.sleep(self._retry)
            return False

    async def _tail_loop(self) -> None:
        last = "$"  # facts from before this instance started are not worth replaying
        while True:
            if self._gossip() is None:
                last = "$"
                await asyncio.sleep(self._retry)
                continue
            try:
                # At most 50 entries a read (5,000 facts; under 17 MB however large the block
                # facts): a backlog is caught up over several reads, none of them huge.
                reply = await self._tail.xread({self.stream: last}, count=50, block=self._block)
                self._recovered()
            except Exception as e:
                self._fault("tail", e)
                await asyncio.sleep(self._retry)
                continue
            learn = getattr(self._policy(), "learn_remote", None)
            for _, items in reply or []:
                for event_id, fields in items:
                    last = event_id.decode() if isinstance(event_id, bytes) else str(event_id)
                    src = fields.get(b"src", b"").decode(errors="replace")
                    if src == self.me:
                        continue
                    self._peers[src] = time.monotonic()
                    if learn is None:
                        continue
                    for fact in decode(fields.get(b"facts", b"[]")):
                        learn(fact)

    async def aclose(self) -> None:
        await self._tail.aclose()

    def _fault(self, what: str, e: BaseException) -> None:
        if not self.failing:
            # The exception's type only: a Redis error message may carry the URL.
            log.warning("routing facts: Redis %s failed (%s); routing on local knowledge", what, type(e).__name__)
        self.failing = True

    def _recovered(self) -> None:
        if self.failing:
            log.info("routing facts: Redis reachable again; sharing resumed")
        self.failing = False
