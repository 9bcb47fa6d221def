"""The engine's waiting queue under each of vLLM's scheduling policies (``--scheduling-policy``).

Mirrors vLLM 0.33's ``vllm/v1/core/sched/request_queue.py``:

* ``fcfs`` (``FCFSRequestQueue``): a deque; a preempted request is put back
  at the front (``prepend_request`` is ``appendleft``), so it resumes first.
* ``priority`` (``PriorityRequestQueue``): a heap ordered as ``Request.__lt__``
  orders requests, lower ``priority`` first, ties by earlier arrival. There is
  no front: a preempted request goes back in at its own (priority, arrival).

An entry's key is ``(priority, arrival, index)``: ``arrival`` is the engine's
submission counter (vLLM stamps ``time.time()`` at the API server; a counter
gives the same order without two requests ever tying), ``index`` the choice
of an ``n > 1`` request, whose choices arrive together.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Generic, Iterable, Iterator, Literal, Protocol, TypeVar

__all__ = ["Policy", "POLICIES", "Queued", "FCFSQueue", "PriorityQueue", "waiting_queue"]

Policy = Literal["fcfs", "priority"]
# vLLM's SchedulerPolicy literal (vllm/config/scheduler.py), default first as `vllm serve` has it.
POLICIES: tuple[Policy, ...] = ("fcfs", "priority")


class Queued(Protocol):
    """What the queue needs of an entry: its place in the priority order."""

    @property
    def sort_key(self) -> tuple[int, int, int]: ...


T = TypeVar("T", bound=Queued)


class FCFSQueue(Generic[T]):
    """First come, first served; a preempted entry resumes before anyone waiting."""

    def __init__(self) -> None:
        self._items: deque[T] = deque()

    def add(self, item: T) -> None:
        self._items.append(item)

    def peek(self) -> T:
        return self._items[0]

    def pop(self) -> T:
        return self._items.popleft()

    def prepend(self, item: T) -> None:
        self._items.appendleft(item)

    def remove_where(self, drop: Iterable[T]) -> None:
        gone = set(map(id, drop))
        self._items = deque(i for i in self._items if id(i) not in gone)

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[T]:
        return iter(self._items)


class PriorityQueue(Generic[T]):
    """Lowest (priority, arrival) first; prepending is adding (vLLM: "no concept of prepending")."""

    def __init__(self) -> None:
        # (key, item): the key is unique per entry, so items are never compared.
        self._heap: list[tuple[tuple[int, int, int], T]] = []

    def add(self, item: T) -> None:
        heapq.heappush(self._heap, (item.sort_key, item))

    def peek(self) -> T:
        return self._heap[0][1]

    def pop(self) -> T:
        return heapq.heappop(self._heap)[1]

    def prepend(self, item: T) -> None:
        self.add(item)

    def remove_where(self, drop: Iterable[T]) -> None:
        gone = set(map(id, drop))
        self._heap = [entry for entry in self._heap if id(entry[1]) not in gone]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[T]:
        """In the order they would be popped (vLLM's ``__iter__`` pops a copy)."""
        return (item for _, item in sorted(self._heap, key=lambda entry: entry[0]))


def waiting_queue(policy: Policy) -> FCFSQueue[T] | PriorityQueue[T]:
    """vLLM's ``create_request_queue``."""
    if policy == "priority":
        return PriorityQueue()
    if policy == "fcfs":
        return FCFSQueue()
    raise ValueError(f"Unknown scheduling policy: {policy}")
