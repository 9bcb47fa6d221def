"""Keep this instance's in-memory index in step with the shared Redis store.

Three mechanisms, each covering the previous one's gap:

1. Tail the store's change log (a Redis stream, ``XREAD BLOCK``): another
   instance's new entry is searchable here within about a second. The tail
   reads at most once per ``sync_interval_ms`` (100 ms): every write, this
   instance's own included, wakes a blocked reader, and re-arming it is one
   more socket write on the event loop. Profiled at 8 concurrent stores, that
   re-arm after each of our own writes (events the loop then ignores) took as
   much event-loop time as the writes themselves, and sat on their critical
   path: the tail's reply arrives with the write's. Between reads the stream
   buffers what arrives; a burst of writes costs one read, not one each.
2. A full resynchronisation (diff of entry ids, fetch what is missing, drop
   what is gone) at start-up, after every Redis outage (events may have been
   missed; Redis may have restarted empty), and every ``resync_interval_s``
   (the log is capped, and a slow reader can fall behind its tail). An outage
   no call saw (a restart between two calls: the client reconnects silently)
   shows as a new data-set token (``RedisStore.generation``), checked every
   ``retry_s``, the breaker's probe interval.
3. Lookups re-read the entry from Redis before serving it, so an entry deleted
   since the last sync can cost a candidate but never be served.

The loop never raises: store faults wait for the breaker's probe and force a
resynchronisation; anything unexpected is logged and retried.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

from .models import Entry
from .redis_store import RedisStore
from .store import StoreUnavailable

log = logging.getLogger("kvgate.semantic_cache")


class IndexSink(Protocol):
    """What the sync loop updates: the cache facade's catalog and index."""

    def known_ids(self) -> dict[str, str]: ...

    def remember(self, entry: Entry) -> None: ...

    async def remember_many(self, entries: list[Entry]) -> None: ...

    def forget(self, entry_id: str) -> None: ...


class IndexSync:
    def __init__(self, store: RedisStore, sink: IndexSink, *, instance_id: str, resync_interval_s: float,
                 retry_s: float, interval_s: float = 0.1) -> None:
        self._store = store
        self._sink = sink
        self._me = instance_id
        self._resync_interval = resync_interval_s
        self._retry = retry_s
        self._interval = interval_s
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self.synced = asyncio.Event()
        self.resyncs = 0
        self.events_applied = 0
        self.reads = 0  # change-log reads (XREAD round trips)
        self.lost = 0  # times Redis was found to have lost its data set (a new generation token)
        self.last_sync: float | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kvgate-sc-sync")

    async def _run(self) -> None:
        position: str | None = None
        generation = ""
        next_resync = next_check = 0.0
        # A flag as well as cancel(): a cancellation that lands while redis-py's own read
        # timeout fires can be turned into a TimeoutError, and the loop must still end.
        while not self._stopping:
            try:
                if not self._store.healthy:
                    position = None
                    await asyncio.sleep(self._retry)
                    continue
                if position is not None and time.monotonic() >= next_check:
                    next_check = time.monotonic() + self._retry
                    if await self._store.generation() != generation:
                        log.warning("semantic cache: redis lost its data (restarted or flushed); resynchronising")
                        self.lost += 1
                        position = None
                if position is None or time.monotonic() >= next_resync:
                    # Token, position, then the diff: events racing the diff are replayed
                    # (idempotent), and a restart during it shows as a new token.
                    generation = await self._store.generation()
                    position = await self._store.log_position()
                    await self.resync()
                    next_resync = time.monotonic() + self._resync_interval
                    next_check = time.monotonic() + self._retry
                started = time.monotonic()
                position, events = await self._store.read_log(position)
                self.reads += 1
                await self._apply(events)
                self.last_sync = time.time()
                # A read that blocked its full ``sync_block_ms`` found nothing and goes
                # again at once; one that returned early waits out the interval, so
                # the writes meanwhile (ours, mostly) wake no reader.
                await asyncio.sleep(max(0.0, self._interval - (time.monotonic() - started)))
            except StoreUnavailable:
                position = None
                await asyncio.sleep(self._retry)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug must not stop synchronisation for good
                log.exception("semantic cache sync failed; retrying")
                position = None
                await asyncio.sleep(self._retry)

    async def resync(self) -> None:
        remote = await self._store.ids()
        local = self._sink.known_ids()
        for entry_id in local.keys() - remote.keys():
            self._sink.forget(entry_id)
        missing = [i for i in remote if i not in local]
        for start in range(0, len(missing), 10_000):
            # In slices, so a large rebuild makes entries searchable as it goes.
            await self._sink.remember_many(await self._store.fetch(missing[start:start + 10_000], remote))
        self.resyncs += 1
        self.synced.set()

    async def _apply(self, events: list[tuple[str, list[str], str]]) -> None:
        adds: list[str] = []
        for op, ids, source in events:
            if op == "add" and source != self._me:
                adds.extend(ids)
            elif op == "del":
                for entry_id in ids:
                    self._sink.forget(entry_id)
        if adds:
            # A re-stored id replaces the old version, so fetch it even if known.
            for entry in await self._store.fetch(adds):
                self._sink.remember(entry)
        self.events_applied += len(events)

    async def aclose(self) -> None:
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait({self._task}, timeout=2.0)
