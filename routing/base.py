"""The seam between the replica pool and routing policies.

A policy is a pure function of the request and the membership list (plus the
load view it is given): it returns a preference order over the eligible
replicas. The pool walks that order when it must retry, and acquiring a
replica returns a release, so in-flight accounting lives in one place
(``gateway.proxy.pool``) and policies never mutate counters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence, runtime_checkable


@runtime_checkable
class ReplicaView(Protocol):
    """What a policy may read about a replica. ``gateway.proxy.pool.Replica`` implements it."""

    name: str
    weight: float
    # This gateway instance's requests in flight to the replica.
    in_flight: int
    # From the replica's own /metrics (vllm:num_requests_waiting / _running /
    # kv_cache_usage_perc): the view every gateway instance shares. None when
    # not scraped yet.
    waiting: float | None
    running: float | None
    kv_usage: float | None
    # This instance's in-flight count when those metrics were read.
    in_flight_at_scrape: int
    # Learned from the same /metrics (routing.rates): prompt tokens the replica computes per
    # second of prefill, and the size of its KV pool in tokens (vllm:cache_config_info's
    # num_gpu_blocks x block_size). None until the replica has said.
    prefill_rate: float | None
    kv_tokens: float | None

    # The requests it runs at once (vLLM's --max-num-seqs), where the operator said
    # (``max_in_flight``): vLLM does not report it. None: unknown.
    @property
    def seats(self) -> float | None: ...


def reported(replica: ReplicaView) -> float | None:
    """The replica's own queue (running + waiting) at its last scrape; None before any."""
    if replica.running is None and replica.waiting is None:
        return None
    return (replica.running or 0.0) + (replica.waiting or 0.0)


def others_reported(replica: ReplicaView) -> float:
    """Requests at the replica by its last scrape that were not this instance's (other instances,
    other clients): running and waiting, less ours at that scrape; 0 before any scrape."""
    queue = reported(replica)
    return 0.0 if queue is None else max(0.0, queue - replica.in_flight_at_scrape)


def load_now(replica: ReplicaView) -> float:
    """The replica's queue right now, as best this instance alone can tell (per unit weight).

    The scrape is up to a second old. Of it, everything but our own requests of
    that moment is other clients' work, taken as still there; our own part we
    know exactly, now. So: others as last reported plus our in-flight now.
    Counting our arrivals *and completions* since the scrape is what keeps a
    burst from herding onto the replica whose stale figure looks lowest; but
    it differs between instances; prefix affinity reads the others' part as
    spread evenly (``routing.prefix_affinity._load_view``).
    """
    return (others_reported(replica) + replica.in_flight) / replica.weight


# What a policy keeps in a request's ``scratch`` about one placement (where it went, its marks in
# the backlog and among the requests in flight, its prediction); the rest of ``scratch`` (the
# prompt's analysis, its key, its block keys) is about the request, whichever replica serves it.
PLACEMENT_KEYS = frozenset({"kvgate.sent", "kvgate.pending", "kvgate.backlog_mark", "kvgate.predicted",
                            "kvgate.gossip_token"})


@dataclass(slots=True)
class RouteRequest:
    """What routing needs to know about one request; built once per request."""

    endpoint: str  # "chat" | "completions" | "embeddings"
    model: str
    namespace: str  # tenant cache namespace (the cache_salt seed)
    body: dict[str, Any]
    # Explicit stable-prefix boundary from the ``x-kvgate-cache-boundary`` header,
    # when the client gave one: the number of leading messages that are stable
    # (``routing.boundary.parse_boundary_hint``; anything else is ignored).
    boundary_hint: str | None = None
    # The token ids vLLM will prefill (routing.tokens), filled once per request by the
    # gateway before routing when the model has a tokenizer; None: route approximately.
    token_ids: list[int] | None = None
    # Filled in lazily by prefix policies; cached here so hashing happens once.
    scratch: dict[str, Any] = field(default_factory=dict)
    # A P/D prefill leg (``leg``): the replica computes the prompt and one token, and a decode
    # replica does the rest. Nothing decodes beside it there, so a policy prices no decode load.
    prefill_only: bool = False

    def leg(self) -> "RouteRequest":
        """The same request for its P/D prefill leg: what was computed about the request is shared,
        so it is hashed once; the placement marks are each leg's own."""
        return RouteRequest(self.endpoint, self.model, self.namespace, self.body, self.boundary_hint,
                            self.token_ids, {k: v for k, v in self.scratch.items() if k not in PLACEMENT_KEYS},
                            prefill_only=True)

    def adopt(self, other: "RouteRequest") -> None:
        """Take what ``other``, a leg of this request, computed about it (not its placement)."""
        for k, v in other.scratch.items():
            if k not in PLACEMENT_KEYS:
                self.scratch.setdefault(k, v)


@dataclass(slots=True)
class RouteFeedback:
    """What the gateway learned after a replica served a request."""

    replica: str
    prompt_tokens: int | None
    cached_tokens: int | None
    ok: bool
    # Seconds from sending the request to its first token, where the gateway saw it (a stream).
    ttft_s: float | None = None
    # The tokens it generated (usage.completion_tokens), where the replica said.
    completion_tokens: int | None = None


class RoutingPolicy(Protocol):
    """A routing policy. One that routes on the replicas' KV events (precise mode) also has a
    ``truth`` attribute, the events ``make_policy`` gave it (None without any); the gateway reads
    ``getattr(policy, "truth", None)`` to say whether routing is precise."""

    name: str

    def prefer(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
        """Every eligible replica, best first. Must not mutate anything it is given."""
        ...

    def observe(self, request: RouteRequest, feedback: RouteFeedback) -> None:
        """Learn from a served request (block index, cached_tokens). May be a no-op."""
        ...
