"""One request as every stage sees it: built once by the proxy, read by the stages.

Its own module so that the proxy and the stages it calls both depend on it and
not on each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from policies import Tenant


@dataclass(slots=True)
class RequestContext:
    """Everything known about one request; built once, read by every stage."""

    request_id: str
    endpoint: str
    headers: dict[str, str]
    body: dict[str, Any]
    model: str
    tenant: "Tenant"
    stream: bool
    include_usage: bool  # what the client asked for
    started: float
    extra_headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    cache_req: Any = None  # set when the answer may be stored in the semantic cache
    cache_embedding: Any = None  # the lookup's embedding of the query, for the store to reuse
    protocol: Any = None  # a protocol's own per-request state (the Responses API's replica pin)
    # Told when the replica's first token arrives (a stream's first event): the routing
    # policy learns that the request's prefill is done there (``started``), if it asks.
    first_token: Any = None
    # The request's scheduling class (policies.priority): the tenant's, or lower by its header.
    priority_class: str = "standard"
    # Its claim on a replica slot (gateway.proxy.admission); None while admission is off.
    ticket: Any = None
    # The body the replica receives, as built once (``upstream_body``): a P/D prefill leg
    # is made from it (gateway.proxy.disagg).
    upstream: Any = None
    # Its P/D path (gateway.proxy.disagg.LegRecord); None unless the fleet has P/D roles.
    disagg: Any = None
