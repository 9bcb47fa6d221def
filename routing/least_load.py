"""Least load: the baseline and the issue-2 default. Ties break by name for determinism."""

from __future__ import annotations

from typing import Sequence

from .base import ReplicaView, RouteFeedback, RouteRequest, load_of


class LeastLoad:
    name = "least_load"

    def prefer(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
        return sorted(replicas, key=lambda r: (load_of(r), r.name))

    def observe(self, request: RouteRequest, feedback: RouteFeedback) -> None:
        return None
