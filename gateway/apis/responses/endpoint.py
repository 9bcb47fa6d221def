"""``POST /v1/responses``: OpenAI's Responses API through the chat hot path, with state affinity.

The request is the chat proxy's (tenant policy, prefix routing over the
instructions + tools + input items rendered by ``routing.hashing``, the relay,
disconnect cancellation, metrics and routing feedback), with three differences:

* Affinity. A ``previous_response_id`` names a response stored in one replica's
  memory; the id kvgate issued says which (``response_ids``), so the request goes
  to that replica and no other, or fails with ``response_replica_unavailable``
  when it cannot. ``open_pinned`` is shared with the stored-response routes.
* Ids. Every id the replica returns, in the JSON body or in any SSE event, is
  rewritten to kvgate's authenticated form; the one the client sends is
  translated back before forwarding.
* The wire. Usage is ``input_tokens`` / ``input_tokens_details.cached_tokens``;
  the stream's own events and terminal states (``responses_sse``).

The semantic cache is bypassed (reason ``responses_stateful``): a response is
addressable state on a replica (stored, retrievable, continued by id, output
items with ids of their own), which an answer replayed from a cache would not be.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from routing import RouteRequest
from routing.base import ReplicaView

from gateway.proxy.context import RequestContext
from gateway.proxy.asgi_io import Exchange
from gateway.errors import GatewayError, NotFound, UpstreamError
from gateway.proxy.disagg import LegShape
from gateway.proxy.endpoint import ProxyEndpoint
from gateway.proxy.relay import Outcome, read_whole, relay_stream
from gateway.proxy.sse import StreamObserver
from .ids import StoredAt
from .sse import IdRewriter, ResponsesObserver, responses_usage
from .validate import validate_responses
from gateway.proxy.upstream import Attempt, UpstreamCall, open_upstream

if TYPE_CHECKING:
    from gateway.proxy.pool import Replica
    from gateway.runtime import Runtime

__all__ = ["ResponsesEndpoint", "ReplicaUnavailable", "open_pinned", "response_not_found", "pinned_replica"]


# The P/D prefill leg (gateway.proxy.disagg): one output token, and not stored (only the decode
# replica's response is the client's; a stored leg would sit in the prefill replica's memory).
# A request continuing a stored response is pinned to its replica and never disaggregated.
RESPONSES_LEG = LegShape({"stream": False, "max_output_tokens": 1, "store": False}, frozenset(),
                         lambda obj: responses_usage(obj.get("usage")))

# A response's status as the finish_reason the gateway's accounting knows.
_FINISH = {"completed": "stop", "incomplete": "length"}


class ReplicaUnavailable(GatewayError):
    """The replica holding a stored response cannot be reached. 503 while it may come back
    (unhealthy, ejected, refusing connections), 404 once it has left the pool."""

    status = 503
    type = "service_unavailable"
    code = "response_replica_unavailable"


def response_not_found(param: str | None = None) -> NotFound:
    # The same answer for a garbled id, a forged tag and another tenant's id: which one
    # it was is nobody's business but the issuer's.
    return NotFound("no response with this id was issued by this gateway", param=param, code="response_not_found")


def pinned_replica(rt: "Runtime", at: StoredAt) -> "Replica":
    replica = rt.pool.replicas.get(at.replica)
    if replica is None:
        err = ReplicaUnavailable("the replica that stored this response has left the pool; the response is "
                                 "gone (start again without previous_response_id)")
        err.status = 404
        raise err
    # Draining does not stop a pinned request: only that replica can serve it.
    if replica.healthy is False or replica.ejected(rt.pool.clock()):
        raise ReplicaUnavailable("the replica that stored this response is unavailable; retry later",
                                 headers={"retry-after": "1"})
    return replica


class _Pinned:
    """A routing policy of one replica: the one holding the response."""

    name = "pinned"

    def __init__(self, replica: "Replica") -> None:
        self.replica = replica

    def prefer(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
        return [self.replica]

    def observe(self, request: RouteRequest, feedback: Any) -> None:
        pass


async def open_pinned(rt: "Runtime", at: StoredAt, route: RouteRequest, call: UpstreamCall) -> Attempt:
    replica = pinned_replica(rt, at)
    try:
        return await open_upstream(rt.pool, _Pinned(replica), route, call, rt.replica_keys)
    except UpstreamError:
        # Refused, dropped or 503 before any work: only that replica holds the response.
        raise ReplicaUnavailable("the replica that stored this response is unavailable; retry later",
                                 headers={"retry-after": "1"}) from None


@dataclass(slots=True)
class _State:
    previous: StoredAt | None = None
    previous_client_id: str | None = None


class ResponsesEndpoint(ProxyEndpoint):
    paths = {"responses": "/v1/responses"}
    prefill_legs = {"responses": RESPONSES_LEG}

    def _validate(self, body: dict[str, Any], headers: dict[str, str]) -> str:
        return validate_responses(body, max_tokens=self.rt.settings.limits.max_tokens_ceiling)

    def _upstream_body(self, ctx: RequestContext) -> dict[str, Any]:
        # No stream_options: usage is always in the terminal event of a Responses stream.
        body = dict(ctx.body)
        state = ctx.protocol = _State()
        prev = body.get("previous_response_id")
        if prev is not None:
            at = self.rt.response_ids.decode(prev, ctx.tenant.namespace)
            if at is None:
                raise response_not_found("previous_response_id")
            body["previous_response_id"] = at.upstream_id
            state.previous, state.previous_client_id = at, prev
        return body

    async def _open(self, route: RouteRequest, call: UpstreamCall, ctx: RequestContext) -> Attempt:
        state: _State = ctx.protocol
        if state.previous is None:
            return await super()._open(route, call, ctx)
        return await open_pinned(self.rt, state.previous, route, call)

    def _rewriter(self, ctx: RequestContext, replica: str) -> IdRewriter:
        """Ids issued for ``replica``'s answer (the one the attempt went to)."""
        state: _State = ctx.protocol
        ids, namespace = self.rt.response_ids, ctx.tenant.namespace
        known = {}
        if state.previous is not None and state.previous_client_id is not None:
            known[state.previous.upstream_id] = state.previous_client_id
        return IdRewriter(lambda upstream: ids.encode(replica, upstream, namespace), known)

    def _observer(self, ctx: RequestContext, replica: str) -> StreamObserver:
        return ResponsesObserver(self.endpoint, strip_usage_chunk=False, rewriter=self._rewriter(ctx, replica))

    async def _relay(self, ctx: RequestContext, exchange: Exchange, attempt: Attempt) -> Outcome:
        timeouts = self.rt.settings.timeouts
        response = attempt.response
        if ctx.stream:
            head = await self._head(ctx, attempt)
            outcome = await relay_stream(response, head, exchange, stall_s=timeouts.stall_s, started_at=ctx.started)
            # The relay times the first event after the lifecycle ones (``ResponsesObserver``); on this
            # protocol that may still precede the first token.
            observer = head.observer
            assert isinstance(observer, ResponsesObserver)
            outcome.ttft_s = None if observer.first_delta_at is None else observer.first_delta_at - ctx.started
            return outcome
        rewriter = self._rewriter(ctx, attempt.replica.name)
        body, obj = await read_whole(response, timeout_s=timeouts.non_stream_s)
        rewriter.learn(obj.get("id"))
        status = obj.get("status")
        await exchange.json(200, rewriter.apply(body))
        return Outcome(usage=responses_usage(obj.get("usage")), complete=status == "completed",
                       finish_reason=_FINISH.get(status) if isinstance(status, str) else None)
