"""Concurrent single calls turned into batched calls, with no timer.

A call that finds nothing running starts a batch at once, so a lone caller waits
for nothing but its own call. Calls that arrive while a batch runs queue up and
go together as the next batch (up to ``max_batch``). The batch size follows the
load by itself: one under light load, everything that arrived during the
previous call under heavy load, so the resource is never idle while work waits
and never waits for a timer. Two users:

* embeddings: one model call per batch, in the model's worker thread;
* Redis writes: one pipelined round trip per batch instead of one each.

A batch that fails fails each of its callers with the same exception; an item's
result that is itself an exception is raised to that caller only. The batch
runs in a task of its own: a caller that gives up (a timeout, a client gone)
neither cancels the others' batch nor leaves its item in it for nothing: items
whose caller has gone are dropped before the next batch runs.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Awaitable, Callable, Generic, Sequence, TypeVar

T = TypeVar("T")
R = TypeVar("R")

RunBatch = Callable[[list[T]], Awaitable[Sequence[R | BaseException]]]


class Batcher(Generic[T, R]):
    """``submit`` one item, get its result; concurrent submits share ``run`` calls."""

    def __init__(self, run: "RunBatch[T, R]", max_batch: int, *, name: str = "kvgate-batcher") -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        self._run = run
        self._max = max_batch
        self._name = name
        self._queue: deque[tuple[T, asyncio.Future[R]]] = deque()
        self._drain: asyncio.Task[None] | None = None
        self.batches = 0  # calls of ``run`` that returned
        self.items = 0  # items those calls carried

    @property
    def queued(self) -> int:
        return len(self._queue)

    async def submit(self, item: T) -> R:
        return (await self.submit_many([item]))[0]

    async def submit_many(self, items: Sequence[T]) -> list[R]:
        """Results in the order of ``items`` (which may land in different batches)."""
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[R]] = []
        for item in items:
            fut: asyncio.Future[R] = loop.create_future()
            self._queue.append((item, fut))
            futures.append(fut)
        if self._drain is None or self._drain.done():
            self._drain = loop.create_task(self._drain_queue(), name=self._name)
        return list(await asyncio.gather(*futures))

    async def _drain_queue(self) -> None:
        while self._queue:
            batch: list[tuple[T, asyncio.Future[R]]] = []
            while self._queue and len(batch) < self._max:
                item, fut = self._queue.popleft()
                if not fut.done():  # its caller gave up: don't do its work
                    batch.append((item, fut))
            if batch:
                await self._run_one(batch)

    async def _run_one(self, batch: list[tuple[T, "asyncio.Future[R]"]]) -> None:
        try:
            results = await self._run([item for item, _ in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"{self._name}: {len(results)} results for {len(batch)} items")
        except asyncio.CancelledError:
            for _, fut in batch:
                fut.cancel()
            raise
        except Exception as exc:  # this batch fails, never the ones after it
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(exc)
            return
        self.batches += 1
        self.items += len(batch)
        for (_, fut), result in zip(batch, results):
            if fut.done():
                continue
            if isinstance(result, BaseException):
                fut.set_exception(result)
            else:
                fut.set_result(result)

    async def aclose(self) -> None:
        """Cancel the running batch and every queued caller."""
        while self._queue:
            self._queue.popleft()[1].cancel()
        if self._drain is not None and not self._drain.done():
            self._drain.cancel()
            await asyncio.wait({self._drain}, timeout=2.0)
        self._drain = None
