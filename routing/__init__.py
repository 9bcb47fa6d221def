"""Routing: choose which replica serves a request.

Policies are pure functions of the request and the membership list that return
a preference order (``routing.base``); ``make_policy`` builds the configured one.
The default, ``ttft``, sends each request where its predicted time to first
token is least, in seconds at each replica's learned prefill rate, within a rail
on the wait ahead (``routing.ttft_affinity``); ``prefix_affinity``, the default
before it, prices prompt tokens within a bound on requests in flight.

What the gateway calls:

* ``make_policy(settings, truth=...)`` once at start-up (one instance per
  process; it keeps a bounded popularity estimate, block index and prefill
  backlog), with the replicas' KV events when any publish them;
* ``policy.prefer(RouteRequest(...), eligible)`` per request, with the body as
  the client sent it (``cache_control`` breakpoints are routing hints) and the
  ``x-kvgate-cache-boundary`` header as ``boundary_hint``;
* ``strip_cache_control(body)`` for the body it forwards (vLLM rejects the key;
  pure, returns the same object when there is nothing to strip);
* ``policy.observe(request, RouteFeedback(...))`` after each served request,
  with the same ``RouteRequest`` object (its ``scratch`` holds the hashes);
* ``resolve(name, port)`` to turn a headless-service name into replica URLs
  (``dns_target`` reads ``routing.dns_name`` as that name and port).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

# First: decides, before any compiled module is imported, whether they run compiled or from source.
from . import _native  # noqa: F401
from .base import ReplicaView, RouteFeedback, RouteRequest, RoutingPolicy, load_now
from .boundary import strip_cache_control
from .consistent_hash import ConsistentHash
from .least_load import LeastLoad
from .membership import dns_target, resolve
from .prefix_affinity import PrefixAffinity
from .round_robin import RoundRobin
from .settings import RoutingSettings
from .ttft_affinity import TTFTAffinity

if TYPE_CHECKING:
    from .kv_events import KVEvents

__all__ = [
    "ReplicaView", "RouteFeedback", "RouteRequest", "RoutingPolicy", "RoutingSettings", "load_now",
    "make_policy", "strip_cache_control", "resolve", "dns_target",
]


def make_policy(settings: RoutingSettings, truth: KVEvents | None = None,
                clock: Callable[[], float] = time.monotonic) -> RoutingPolicy:
    """The configured policy; each call returns a fresh instance with its own state.

    ``truth``, the replicas' KV events, goes to the policies that route on them
    (precise mode); they say so with a ``truth`` attribute (``routing.base.RoutingPolicy``).
    ``clock`` is the time the stateful policies read (a simulator passes its virtual one)."""
    if settings.policy == "least_load":
        return LeastLoad()
    if settings.policy == "round_robin":
        return RoundRobin()
    if settings.policy == "consistent_hash":
        return ConsistentHash(settings)
    policy = TTFTAffinity(settings, clock) if settings.policy == "ttft" else PrefixAffinity(settings, clock)
    policy.truth = truth
    return policy
