"""Vectors on their way: entries stored for the exact tier whose embedding is pending.

A context seen for the first time has no index partition until its first vector
lands. A paraphrase asked in that window would find nothing to search and miss,
although the vector it needs is one embedding away, queued ahead of its own. The
cache asks ``pending(partition)`` and, if so, waits for ``wait(partition)``
after embedding its query: the paraphrase is served as soon as the first answer's
embedding is ready.
"""

from __future__ import annotations

import asyncio
from collections import Counter


class Inflight:
    """Counts pending vectors per partition; events fire when a partition, or all, drain."""

    def __init__(self) -> None:
        self._count: Counter[str] = Counter()
        self._drained: dict[str, asyncio.Event] = {}
        self._idle = asyncio.Event()
        self._idle.set()

    def __len__(self) -> int:
        return sum(self._count.values())

    def add(self, partition: str) -> None:
        self._count[partition] += 1
        self._drained.setdefault(partition, asyncio.Event())
        self._idle.clear()

    def done(self, partition: str) -> None:
        self._count[partition] -= 1
        if self._count[partition] <= 0:
            del self._count[partition]
            event = self._drained.pop(partition, None)
            if event is not None:
                event.set()
        if not self._count:
            self._idle.set()

    def pending(self, partition: str) -> bool:
        return partition in self._count

    async def wait(self, partition: str, timeout_s: float) -> None:
        """Until ``partition`` has no pending vector, at most ``timeout_s``."""
        event = self._drained.get(partition)
        if event is None:
            return
        try:
            async with asyncio.timeout(timeout_s):
                await event.wait()
        except TimeoutError:
            pass

    async def idle(self) -> None:
        """Until no vector is pending anywhere."""
        await self._idle.wait()
