"""Open a response from the best replica, retrying only when the first did no work.

Walks the routing policy's preference order. A retry happens only before any
byte reached the client, when the replica did no work for this request (the
connection was refused, or it answered 429 / 503) or lost it (it dropped the
connection, or its stream failed before the first event: ``first_event``), and
within the pool's retry budget, except the one retry of a request whose replica
is gone (``take_retry`` says why). Connect errors, 5xx and a stream failing
before its first event count towards ejection; 429 never does (it is
back-pressure). The caller owns the returned response and lease and must
close/release both (``Attempt.close``); a stream's first event is in
``Attempt.head``, read and not yet sent.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, cast

import httpx
import orjson

from routing import RouteRequest, RoutingPolicy

from gateway.errors import BadRequest, GatewayError, NoReplica, NotFound, RateLimited, UpstreamError, UpstreamTimeout
from .admission import Ticket
from .first_event import FirstEvent, Head, NoFirstEvent, media_type, read_first_event
from .pool import Lease, Replica, ReplicaPool
from .transport import ReplicaGone

log = logging.getLogger("kvgate.upstream")

_RETRYABLE_STATUS = {429, 503}
_CONNECT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError,
                   httpx.WriteError, httpx.PoolTimeout)
# Of those, the ones where the request never reached the replica (nothing was sent).
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
# Of those, the ones that show the replica gone: no connection to it could be made, for this request
# or just after its connection dropped (kvgate's transport tries one then). Not a timeout: an
# overloaded replica is slow to accept too.
_GONE = (httpx.ConnectError, ReplicaGone)


class SentAndDropped(UpstreamError):
    """A replica dropped the connection after the request was sent, or its stream failed before
    the first event, for a call that must not be sent twice as it is (``UpstreamCall.once``): the
    caller decides what to send next."""

    def __init__(self, replica: str, gone: bool, what: str = "dropped the connection") -> None:
        super().__init__(f"replica {replica} {what}")
        self.replica = replica
        self.gone = gone  # and no new connection to it could be made (``_GONE``)


class TimedOut(UpstreamTimeout):
    """A replica sent no response, or no first event of its stream, in time. Not retried (it may be
    working on the request: never duplicate generation); the replica is named for a caller that
    counts its legs (gateway.proxy.disagg)."""

    def __init__(self, replica: str, message: str) -> None:
        super().__init__(message)
        self.replica = replica


@dataclass
class Attempt:
    response: httpx.Response
    lease: Lease
    retries: int
    budget_held: int = 0
    pool: ReplicaPool | None = field(default=None, repr=False)
    # What choosing the replica cost (the policy's ``prefer``), for the routing-cost figures.
    prefer_s: float = 0.0
    # The request's admission ticket, whose slot this attempt holds (None: admission is off).
    ticket: Ticket | None = None
    # A stream's first event, read before the attempt was returned (``UpstreamCall.first``).
    head: Head | None = None

    @property
    def replica(self) -> Replica:
        return self.lease.replica

    async def close(self) -> None:
        try:
            await self.response.aclose()
        finally:
            if self.ticket is not None:
                self.ticket.done()  # before the lease ends: the slot's hand-on sees who let it go
            self.lease.release()
            if self.pool is not None:
                for _ in range(self.budget_held):
                    self.pool.budget.release()
                self.budget_held = 0


@dataclass(slots=True)
class Moved:
    """Whether a request has had its one retry off a gone replica (``take_retry``). One per client
    request, shared by the calls of its legs (gateway.proxy.disagg)."""

    done: bool = False


@dataclass(slots=True)
class UpstreamCall:
    path: str
    payload: bytes  # a JSON object when ``priority`` is set
    headers: dict[str, str]
    read_timeout_s: float
    connect_timeout_s: float
    max_attempts: int
    # vLLM's ``priority`` for the request's class (policies.priority); sent only to replicas
    # started with --scheduling-policy priority: under fcfs it is refused or ignored.
    priority: int = 0
    # Sent to at most one replica once it may have arrived (a decode leg's kv_transfer_params:
    # the replica that took them may have pulled the blocks, which the prefill replica then frees).
    once: bool = False
    moved: Moved = field(default_factory=Moved)
    # A stream: an attempt is open once its first event is in hand, not at its headers (vLLM sends
    # a stream's before its first token), so a replica failing in between is retried like one that
    # failed before them (``first_event``). None: open at the headers.
    first: FirstEvent | None = None
    # An answer read whole, which a replica sends as JSON: a 200 that is not JSON (an ingress's
    # page in its place) is a failure before any byte reached the client, retried like a 5xx.
    json: bool = False

    def payload_for(self, replica: Replica) -> bytes:
        if not self.priority or replica.scheduling_policy != "priority":
            return self.payload
        # The body is an object whose client-set priority was stripped (policies.salt), so the
        # field goes in before the closing brace, without parsing the body again.
        sep = b"," if len(self.payload) > 2 else b""  # b"{}" has no field to follow
        return b"%s%s\"priority\":%d}" % (self.payload[:-1], sep, self.priority)


def take_retry(pool: ReplicaPool, call: UpstreamCall, gone: bool) -> int | None:
    """Whether ``call``'s request, failed before any byte reached its client, may go to another replica:
    the retries of the pool's budget it holds for that (0 or 1), or None (no: the client gets the error).

    The budget (Envoy's: retries in flight at most 20% of the requests in flight, or 3) is there so that
    retries do not add load an overloaded fleet cannot carry: a replica that answered 429, 503, 5xx or
    nothing in time is alive, may be overloaded, and may have done the work; a retry puts a second
    copy of the request on the fleet. A replica that is gone (``gone``: no connection to it could be
    made, for this request or just after its connection dropped) carries nothing any more: whatever
    it held for the request died with it, and sending the request elsewhere moves that load, it does
    not add to it. When a replica with many requests in flight dies, all of them fail at once, past
    the budget's share, and the budget refused those past it though the healthy replicas could serve
    every one (the P/D chaos run's ``decode_killed``: d1 killed with 17 requests in flight, 9 of them
    before their first byte; the budget took 5 retries and refused 4, each a 502). So that retry
    takes no budget.

    Why a dropped connection alone is not enough: an overloaded replica, or a proxy in front of it,
    may reset connections and still hold the work. Only a failed connect right after shows it gone.
    What bounds the exemption: once per request (``Moved``, across its legs), so a request meeting
    a second gone replica takes the budget like any other retry; and it only ever moves requests
    that were on the dead replica, at most once each. Before any byte reached the client only: every
    caller retries before the relay starts."""
    if gone and not call.moved.done:
        call.moved.done = True
        return 0
    return 1 if pool.budget.try_acquire(pool.active_requests) else None


async def open_upstream(
    pool: ReplicaPool, policy: RoutingPolicy, route: RouteRequest, call: UpstreamCall,
    replica_keys: dict[str, str] | None = None, ticket: Ticket | None = None,
    roles: frozenset[str] | None = None, exclude: set[str] | None = None,
) -> Attempt:
    """``roles``: only replicas of these P/D roles (gateway.proxy.disagg; None: any), less ``exclude``
    (the names a leg already failed on)."""
    candidates = pool.eligible(route.model, roles)
    if exclude:
        candidates = [r for r in candidates if r.name not in exclude]
    if not candidates:
        if not pool.known_model(route.model):
            raise NotFound(f"model '{route.model}' is not served here", param="model")
        raise NoReplica(f"no healthy replica serves model '{route.model}'")
    if ticket is not None:
        # Admission (gateway.proxy.admission): route among the replicas with a free slot, or wait
        # in the fair queue for one. From here to the first lease nothing awaits, so the slot
        # seen free is the slot taken.
        candidates = ticket.free(candidates) or await ticket.wait(route.model, roles)
        ticket.hold()
    try:
        return await _attempts(pool, policy, route, call, candidates, replica_keys, ticket)
    except BaseException:
        if ticket is not None:
            ticket.done()
        raise


async def _attempts(
    pool: ReplicaPool, policy: RoutingPolicy, route: RouteRequest, call: UpstreamCall,
    candidates: list[Replica], replica_keys: dict[str, str] | None, ticket: Ticket | None,
) -> Attempt:
    """The replicas in the policy's order until one answers (at most ``max_attempts``)."""
    started = time.perf_counter()
    order = policy.prefer(route, candidates)
    prefer_s = time.perf_counter() - started
    timeout = {"connect": call.connect_timeout_s, "read": call.read_timeout_s, "write": call.connect_timeout_s,
               "pool": call.connect_timeout_s}
    retry_after: float | None = None
    last_error: GatewayError | None = None
    budget_held = 0
    gone = False  # whether the replica last tried is gone (``_GONE``)
    try:
        for attempt_no, view in enumerate(order[: call.max_attempts]):
            replica = cast(Replica, view)  # the pool hands policies its own Replica objects
            if attempt_no > 0:
                held = take_retry(pool, call, gone)
                if held is None:
                    break
                budget_held += held
            gone = False
            lease = pool.acquire(replica, stream=call.first is not None)
            try:
                response = await pool.transport.handle_async_request(_request(replica, call, replica_keys, timeout))
            except httpx.TimeoutException as e:
                lease.release()
                if isinstance(e, (httpx.ConnectTimeout, httpx.PoolTimeout)):
                    pool.record_failure(replica, "connect_timeout")
                    last_error = UpstreamError(f"replica {replica.name} did not accept the connection")
                    continue
                # It may be working on the request: never duplicate generation.
                raise TimedOut(replica.name, f"replica {replica.name} sent no response in time") from None
            except _CONNECT_ERRORS as e:
                lease.release()
                pool.record_failure(replica, "connect")
                gone = isinstance(e, _GONE)
                if call.once and not isinstance(e, _NOT_SENT):
                    raise SentAndDropped(replica.name, gone) from None
                last_error = UpstreamError(f"replica {replica.name} refused or dropped the connection")
                continue
            except BaseException:
                lease.release()
                raise
            if response.status_code in _RETRYABLE_STATUS:
                retry_after = _max_retry_after(retry_after, response)
                if response.status_code == 503:
                    pool.record_failure(replica, "http_503")
                last_error = await _status_error(response, replica)
                await response.aclose()
                lease.release()
                continue
            if response.status_code >= 500 and not call.once:
                # (A call sent once carries another replica's work: its caller says whose failure it is.)
                pool.record_failure(replica, f"http_{response.status_code}")
            if call.json and response.status_code == 200 and media_type(response) != "application/json":
                pool.record_failure(replica, "not_json")
                await response.aclose()
                lease.release()
                if call.once:
                    # Carrying another replica's params: they are never sent again (its caller decides).
                    raise SentAndDropped(replica.name, False, "answered 200 without JSON")
                last_error = UpstreamError(f"replica {replica.name} answered 200 without JSON")
                continue
            head = None
            if call.first is not None and call.first.awaited(response):
                try:
                    head = await read_first_event(response, call.first.observer(replica.name), call.first.timeout_s)
                except BaseException as e:
                    await response.aclose()  # not cleanly finished: the connection is aborted
                    lease.release()
                    last_error = _no_first_event(pool, replica, call, e)
                    gone = isinstance(e, _GONE)
                    continue
            lease.started()  # a stream's first event is its first token (Replica.unstarted)
            attempt = Attempt(response, lease, retries=attempt_no, budget_held=budget_held, pool=pool,
                              prefer_s=prefer_s, ticket=ticket, head=head)
            if ticket is not None:
                ticket.replica = replica
            budget_held = 0
            return attempt
    finally:
        for _ in range(budget_held):
            pool.budget.release()
    if isinstance(last_error, RateLimited):
        raise RateLimited("every replica is at capacity; retry later", retry_after_s=retry_after or 1.0)
    raise last_error or NoReplica(f"no replica could take the request for '{route.model}'")


def _request(replica: Replica, call: UpstreamCall, replica_keys: dict[str, str] | None,
             timeout: dict[str, float]) -> httpx.Request:
    headers = call.headers
    if replica_keys and replica.name in replica_keys:
        headers = {**headers, "authorization": f"Bearer {replica_keys[replica.name]}"}
    return httpx.Request("POST", replica.url_for(call.path), content=call.payload_for(replica), headers=headers,
                         extensions={"timeout": timeout})


def _no_first_event(pool: ReplicaPool, replica: Replica, call: UpstreamCall, exc: BaseException) -> GatewayError:
    """A stream that failed after its headers and before its first event (``exc``): the error to
    retry past, or raised. Nothing has reached the client, so the rules are those of a failure before
    the headers: a dropped connection (or a stream ended or garbled, the same to the client) is
    retried, a call sent ``once`` goes back to its caller, and a timeout is not retried (the replica
    may be working on it: never duplicate generation). Each counts against the replica, as a broken
    reply (``response``); whether it is gone, ``transport.ReplicaGone`` says."""
    if not isinstance(exc, (TimeoutError, httpx.HTTPError, NoFirstEvent)):
        raise exc  # cancelled (the client went away), or a bug: not the replica's failure
    pool.record_failure(replica)
    if isinstance(exc, (TimeoutError, httpx.TimeoutException)):
        raise TimedOut(replica.name, "replica produced no first token in time") from None
    if call.once:
        raise SentAndDropped(replica.name, isinstance(exc, _GONE), "failed before its first token") from None
    return UpstreamError(f"replica {replica.name} failed before the first token")


def _max_retry_after(current: float | None, response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after")
    try:
        seconds = float(value) if value is not None else None
    except ValueError:
        seconds = None
    if seconds is None:
        return current
    seconds = min(max(seconds, 0.0), 120.0)
    return seconds if current is None else max(current, seconds)


async def _status_error(response: httpx.Response, replica: Replica) -> GatewayError:
    if response.status_code == 429:
        return RateLimited(f"replica {replica.name} is at capacity", retry_after_s=1.0)
    return UpstreamError(f"replica {replica.name} is unavailable ({response.status_code})")


async def read_error_body(response: httpx.Response, replica: Replica, limit: int = 64 * 1024) -> GatewayError:
    """Translate a non-2xx answer into our error. Client errors keep the replica's message."""
    raw = b""
    try:
        async with asyncio.timeout(5):
            async for chunk in response.aiter_raw():
                raw += chunk
                if len(raw) > limit:
                    break
    except (TimeoutError, httpx.HTTPError):
        pass
    status = response.status_code
    if 400 <= status < 500:
        message, param = _upstream_message(raw)
        err: GatewayError = BadRequest(message or f"replica rejected the request ({status})", param=param,
                                       code="upstream_rejected")
        err.status = status if status in (400, 404, 413, 422) else 400
        return err
    return UpstreamError(f"replica {replica.name} failed ({status})")


def _upstream_message(raw: bytes) -> tuple[str | None, str | None]:
    try:
        obj: Any = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None, None
    err = obj.get("error", obj) if isinstance(obj, dict) else None
    if not isinstance(err, dict):
        return None, None
    message = err.get("message")
    param = err.get("param")
    return (message[:1000] if isinstance(message, str) else None,
            param if isinstance(param, str) else None)
