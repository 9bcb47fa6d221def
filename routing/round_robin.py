"""Round robin: the no-knowledge baseline. Rotates a name-sorted list, so it is deterministic."""

from __future__ import annotations

from typing import Sequence

from .base import ReplicaView, RouteFeedback, RouteRequest


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def prefer(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
        if not replicas:
            return []
        ordered = sorted(replicas, key=lambda r: r.name)
        k = self._next % len(ordered)
        self._next += 1
        return ordered[k:] + ordered[:k]

    def observe(self, request: RouteRequest, feedback: RouteFeedback) -> None:
        return None
