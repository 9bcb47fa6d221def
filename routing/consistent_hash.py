"""Consistent hashing without a load bound: the key's rendezvous order, nothing else.

The same key as ``prefix_affinity`` (so the comparison isolates what the load
bound and the warm-prefix index add); a hot key melts its first choice.
"""

from __future__ import annotations

from typing import Sequence

from .base import ReplicaView, RouteFeedback, RouteRequest
from .keys import PrefixKeyer
from .rendezvous import Rendezvous
from .settings import RoutingSettings


class ConsistentHash:
    name = "consistent_hash"

    def __init__(self, settings: RoutingSettings | None = None) -> None:
        self.settings = settings or RoutingSettings()
        self.keyer = PrefixKeyer(self.settings)
        self._orders = Rendezvous()

    def prefer(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
        if len(replicas) < 2:
            return list(replicas)
        return self._orders.order(self.keyer.key_for(request, len(replicas)).key, replicas)

    def observe(self, request: RouteRequest, feedback: RouteFeedback) -> None:
        return None
