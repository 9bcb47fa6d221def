"""Precise mode's source of truth: every replica's KV events, one index, and what is still on its way.

``KVEvents`` owns an ``EventStream`` per replica that publishes events (from
``replicas[].kv_events`` or, for replicas found through DNS, from
``routing.kv_events_port``), the ``KVEventIndex`` they feed, and a small
overlay of this instance's own requests still in flight: a request sent a
moment ago has not produced its events yet, and the next request with the same
prefix should still find it. The overlay is this instance's only private
knowledge; it lasts until the request is served (by then its blocks' events
have been published) or ``pending_s``.

The cost model asks ``held`` per request: the tier-weighted cached blocks of
the request's prefix on every replica whose stream is ``live``. Replicas
missing from the answer are routed on the approximate index; that is the
degraded mode, reported in ``stats`` and ``degraded`` (``/readyz``), never an
error.

**Agreement.** Precise mode keys a request by the token ids kvgate computed
for it, and a replica's events by the ids the replica stored. If they differ
(a tokenizer or chat template other than the replica's, another revision, a
model name mapped to the wrong directory), every lookup misses: each replica
looks cold, so routing is blind to every cached prefix (the approximate index
is not consulted for a live replica, unless other instances' block facts come
in: ``routing.ttft_affinity``), and nothing else would say so. So each
request served where it was sent is checked: its last prompt block must appear
in that replica's events (``stale_s`` allowed for them). A replica none of
whose last ``AGREEMENT_WINDOW`` checked requests appeared is routed
approximately and named in ``degraded``, until one does.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import zmq.asyncio

from .base import RouteRequest
from .kv_consumer import EventStream
from .kv_index import KVEventIndex
from .kv_wire import Batch
from .token_keys import block_keys

__all__ = ["KVEvents", "Endpoints"]

# Where a request's token-block keys are kept once computed (its scratch).
_KEYS = "kvgate.block_keys"

# (PUB endpoint, replay endpoint or None) per replica name.
Endpoints = Mapping[str, "tuple[str, str | None]"]

# Requests checked per replica before disagreement is declared. With the right token ids
# nearly every request's blocks appear (an eviction before its event is the exception);
# with the wrong ones none does: 16 in a row without one is not chance.
AGREEMENT_WINDOW = 16


@dataclass(slots=True, eq=False)
class _Pending:
    keys: Sequence[int]
    name: str
    deadline: float
    open: bool = True
    # Served, its events not in yet (``KVEvents.done``).
    served: bool = False


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Leading keys two chains share: chained keys agree up to a point and never again, so bisect."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class KVEvents:
    def __init__(self, block_size: int = 16, *, cpu_weight: float = 0.5, stale_s: float = 5.0,
                 pending_s: float = 60.0, max_blocks: int = 1 << 21,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.index = KVEventIndex(block_size, cpu_weight=cpu_weight, max_blocks=max_blocks)
        self.block_size = block_size
        self.stale_s = stale_s
        self.pending_s = pending_s
        self._clock = clock
        self.streams: dict[str, EventStream] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._ctx: zmq.asyncio.Context | None = None
        self._pending: dict[int, list[_Pending]] = {}  # first block's key -> requests in flight
        self._queue: deque[_Pending] = deque()
        # Per replica: how many requests served there in a row did not show up in its events
        # (a count, not a window of outcomes: "none of the last N" is "N misses in a row").
        self._misses: dict[str, int] = {}
        self.confirmed: dict[str, int] = {}
        self.unconfirmed: dict[str, int] = {}

    # -- membership --------------------------------------------------------------------
    def sync(self, endpoints: Endpoints) -> None:
        """Subscribe to replicas that joined, forget the ones that left (needs a running loop)."""
        for name in list(self.streams):
            if name not in endpoints or (self.streams[name].endpoint, self.streams[name].replay_endpoint) \
                    != tuple(endpoints[name]):
                self._drop(name)
        for name, (pub, replay) in endpoints.items():
            if name not in self.streams:
                if self._ctx is None:
                    self._ctx = zmq.asyncio.Context()
                stream = EventStream(name, pub, replay, self._apply, self.index.clear, ctx=self._ctx,
                                     stale_s=self.stale_s, clock=self._clock)
                self.streams[name] = stream
                self._tasks[name] = asyncio.ensure_future(stream.run())

    def _drop(self, name: str) -> None:
        self.streams.pop(name, None)
        self._misses.pop(name, None)
        task = self._tasks.pop(name, None)
        if task is not None:
            task.cancel()
        self.index.remove_replica(name)

    async def aclose(self) -> None:
        tasks = list(self._tasks.values())
        for name in list(self.streams):
            self._drop(name)
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def _apply(self, name: str, batch: Batch) -> None:
        self.index.apply(name, batch)

    # -- what the cost model asks ----------------------------------------------------------
    def live(self, name: str) -> bool:
        stream = self.streams.get(name)
        return stream is not None and stream.live and not self.disagrees(name)

    def mode(self, name: str) -> str | None:
        """How the cost model sees ``name``: "precise", or "approximate: why"; None without a stream."""
        stream = self.streams.get(name)
        if stream is None:
            return None
        if not stream.live:
            return f"approximate: events {stream.state}"
        return "approximate: token ids disagree" if self.disagrees(name) else "precise"

    def disagrees(self, name: str) -> bool:
        """None of the last ``AGREEMENT_WINDOW`` requests served at ``name`` appeared in its events."""
        return self._misses.get(name, 0) >= AGREEMENT_WINDOW

    def request_keys(self, request: RouteRequest) -> list[int]:
        """The request's token-block keys as the events key blocks, once per request (empty
        without token ids). A LoRA adapter's blocks are not its base model's
        (``routing.token_keys``): keyed under its name once the events have shown one, as vLLM
        names it (the model requested)."""
        keys = request.scratch.get(_KEYS)
        if keys is None:
            tokens = request.token_ids
            salt = request.body.get("cache_salt")
            lora = request.model if request.model in self.index.adapters else None
            keys = block_keys(tokens, self.block_size, salt if isinstance(salt, str) else None,
                              lora=lora) if tokens else []
            request.scratch[_KEYS] = keys
        return keys  # type: ignore[no-any-return]

    def held(self, keys: Sequence[int], names: Iterable[str]) -> dict[str, float]:
        """Cached blocks of ``keys``' prefix per replica with a live stream (the others are absent)."""
        live = [n for n in names if self.live(n)]
        if not live or not keys:
            return {n: 0.0 for n in live}
        out = self.index.held(keys, live)
        self._expire()
        now = self._clock()
        for entry in list(self._pending.get(keys[0], ())):
            if entry.served and (entry.deadline < now or self.index.has(entry.name, entry.keys[-1])):
                self._settle(entry)  # its events arrived (or never will): the index speaks for it
            elif entry.open and entry.name in out:
                depth = _common_prefix(keys, entry.keys)
                if depth > out[entry.name]:
                    out[entry.name] = float(depth)
        return out

    def sent(self, name: str, keys: Sequence[int], new_blocks: bool) -> _Pending | None:
        """A request with these block keys went to ``name``: hold it there until it is served."""
        if not keys:
            return None
        stream = self.streams.get(name)
        if stream is not None and new_blocks:
            stream.expect()  # it will store blocks, so events must follow
        self._expire()
        entry = _Pending(keys, name, self._clock() + self.pending_s)
        # Filed under the first block's key: only requests sharing it can share any block.
        self._pending.setdefault(keys[0], []).append(entry)
        self._queue.append(entry)
        return entry

    def done(self, entry: Any, *, served: bool = False, replica: str | None = None) -> None:
        """The request was served (or given up): its prefix is now the events' to report.

        Served, it stays presumed on its replica until the events show its last block, for
        up to ``stale_s``: a follow-up sent between the answer and late events (a busy
        publisher thread, a congested link) must not find the context gone and move. When
        the events are in already, as usual, nothing lingers. ``replica``: the one that
        served it, when known; served elsewhere (a retry), it checks nothing.
        """
        if not (isinstance(entry, _Pending) and entry.open):
            return
        if served and replica is not None and replica != entry.name:
            self._close(entry)
            return
        if served and not self.index.has(entry.name, entry.keys[-1]):
            entry.deadline = min(entry.deadline, self._clock() + self.stale_s)
            entry.served = True
            return
        if served:
            self._check(entry.name, True)
        self._close(entry)

    def _settle(self, entry: _Pending) -> None:
        """A served request's events are in, or its time for them is up: one agreement check."""
        self._check(entry.name, self.index.has(entry.name, entry.keys[-1]))
        self._close(entry)

    def _check(self, name: str, appeared: bool) -> None:
        stream = self.streams.get(name)
        if stream is None or stream.state != "live":
            return  # events were not flowing: staleness, not disagreement, explains a miss
        self._misses[name] = 0 if appeared else self._misses.get(name, 0) + 1
        counts = self.confirmed if appeared else self.unconfirmed
        counts[name] = counts.get(name, 0) + 1

    def _close(self, entry: _Pending) -> None:
        if entry.open:
            entry.open = False
            entries = self._pending.get(entry.keys[0])
            if entries is not None:
                entries.remove(entry)
                if not entries:
                    del self._pending[entry.keys[0]]

    def _expire(self) -> None:
        now = self._clock()
        queue = self._queue
        while queue and (not queue[0].open or queue[0].deadline < now):
            entry = queue.popleft()
            if entry.open and entry.served:
                self._settle(entry)
            else:
                self._close(entry)

    # -- reporting -------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        replicas = {}
        for name, stream in sorted(self.streams.items()):
            s = stream.stats()
            replicas[name] = {"mode": "precise" if self.live(name) else "approximate", **s,
                              "index": self.index.stats(name),
                              "token_agreement": {"confirmed": self.confirmed.get(name, 0),
                                                  "unconfirmed": self.unconfirmed.get(name, 0),
                                                  "disagrees": self.disagrees(name)}}
        # "presumed": served requests whose events are not in yet, held on their replica (``done``).
        presumed = sum(1 for e in self._queue if e.open and e.served)
        return {"block_size": self.block_size, "index_blocks": len(self.index), "pending": len(self._queue),
                "presumed": presumed,
                "replicas": replicas}

    def degraded(self) -> list[str]:
        out = []
        for name, stream in sorted(self.streams.items()):
            if not stream.live:
                out.append(f"kv events {name}: {stream.state}, routed on the approximate index")
            elif self.disagrees(name):
                out.append(f"kv events {name}: none of the last {AGREEMENT_WINDOW} requests served there appeared in "
                           "its events, so kvgate's token ids are not the replica's (routing.tokenizers: the "
                           "tokenizer of the model it serves?); routed on the approximate index")
            idx = self.index.stats(name)
            if idx.get("skipped", 0) > idx.get("stored", 0):
                # Mostly blocks of another size: the replica's --block-size is not routing.block_size.
                out.append(f"kv events {name}: {idx['skipped']} blocks skipped (block size is not "
                           f"{self.block_size}?), the replica looks cold to precise routing")
        return out
