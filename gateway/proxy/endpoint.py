"""The hot path: parse, run policies, route, forward, stream back.

One ASGI endpoint per route of OpenAI's chat family. It holds no business
logic of its own: validation (``validate``), tenant policy (``stages.admit``),
the semantic cache, routing (``upstream.open_upstream``) and relaying
(``relay``) are each behind a narrow call. Errors become responses in the
route's shape (``Exchange.shape``) here and nowhere else.

Another API is a subclass in ``gateway.apis`` that overrides the class
attributes and hooks below (its paths, error shape and unary routes; body
checks, upstream body and headers, stream observers); this module never
branches on which API it serves.
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar, Mapping

import orjson

from routing import RouteFeedback, RouteRequest

from .context import RequestContext
from .disagg import CHAT_LEG, COMPLETIONS_LEG, LegShape
from .asgi_io import ClientDisconnected, Exchange, Receive, Scope, Send, read_body, request_id, \
    run_unless_disconnected
from . import stages
from gateway.errors import OPENAI_SHAPE, BadRequest, ErrorShape, GatewayError, UpstreamError, UpstreamTimeout, \
    internal_error
from .first_event import FirstEvent, Head
from .relay import Outcome, WholeObserver, open_stream, relay_stream, relay_whole
from .sse import StreamObserver
from .transport import UPSTREAM_HEADERS
from .upstream import Attempt, UpstreamCall, open_upstream, read_error_body
from .validate import parse_json, validate

if TYPE_CHECKING:
    from gateway.runtime import Runtime

log = logging.getLogger("kvgate.access")

PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "embeddings": "/v1/embeddings"}


class ProxyEndpoint:
    # What a subclass for another API overrides (class defaults, so a subclass with its own
    # __init__, the utility routes, keeps OpenAI's).
    paths: ClassVar[Mapping[str, str]] = PATHS  # endpoint name -> the client's path (and the replica's)
    shape: ClassVar[ErrorShape] = OPENAI_SHAPE
    # The path prefix whose other errors (unknown route, wrong method) answer in ``shape``.
    claims: ClassVar[str | None] = None
    unary: ClassVar[frozenset[str]] = frozenset({"embeddings"})  # never streamed, whatever the body says
    # Whether serving leaves prompt blocks on the replica that routing should learn from.
    prefills = True
    # Per endpoint, the prefill leg vLLM takes on a P/D fleet (gateway.proxy.disagg); an
    # endpoint not listed is never disaggregated.
    prefill_legs: ClassVar[Mapping[str, LegShape]] = {"chat": CHAT_LEG, "completions": COMPLETIONS_LEG}

    def __init__(self, endpoint: str, runtime: "Runtime") -> None:
        self.endpoint = endpoint
        self.path = self.paths[endpoint]
        self.rt = runtime

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = time.perf_counter()
        headers = _headers(scope)
        rid = scope.get("kvgate.request_id") or request_id(headers.get("x-request-id"))
        exchange = Exchange(send, [], self.shape)
        if self.shape.request_id_header is not None:
            exchange.add_header(self.shape.request_id_header, rid)
        status, replica, tenant, outcome, ctx = 0, "-", "-", None, None
        try:
            ctx = await self._prepare(scope, receive, headers, rid, started)
            tenant = ctx.tenant.name
            disconnected, result = await run_unless_disconnected(receive, self._serve(ctx, exchange))
            if disconnected:
                self.rt.metrics.disconnects.labels(self.endpoint).inc()
                status = 499
            else:
                replica, outcome = result  # type: ignore[misc]
                status = exchange.status
        except ClientDisconnected:
            status = 499
        except GatewayError as err:
            status = err.status
            if not exchange.started:
                await exchange.error(err)
        except Exception:
            log.exception("unhandled error", extra={"request_id": rid})
            status = 500
            if not exchange.started:
                await exchange.error(internal_error())
        finally:
            self._record(rid, status, replica, tenant, started, outcome)
            if self.rt.tracing.enabled:
                self._trace(rid, status, replica, tenant, started, outcome, ctx, exchange)

    async def _prepare(self, scope: Scope, receive: Receive, headers: dict[str, str], rid: str,
                       started: float) -> RequestContext:
        rt = self.rt
        tenant = stages.authenticate(rt, headers, scope.get("query_string", b""))
        limits = rt.settings.limits
        ctype = headers.get("content-type", "application/json").split(";", 1)[0].strip().lower()
        if ctype != "application/json" and not ctype.endswith("+json"):
            raise BadRequest("Content-Type must be application/json", code="invalid_content_type")
        raw = await read_body(receive, limit=limits.max_body_bytes, content_length=headers.get("content-length"),
                              deadline_s=rt.settings.timeouts.body_receive_s)
        body = parse_json(raw, max_depth=limits.max_json_depth)
        model = self._validate(body, headers)
        if rt.settings.log_prompts and log.isEnabledFor(logging.DEBUG):
            # Only with log_prompts: true AND debug level, both set on purpose by an operator.
            log.debug("request body", extra={"request_id": rid, "body": body})
        stream = bool(body.get("stream")) and self.endpoint not in self.unary
        so = body.get("stream_options")
        include_usage = bool(isinstance(so, dict) and so.get("include_usage"))
        ctx = RequestContext(rid, self.endpoint, headers, body, model, tenant, stream, include_usage, started)
        await stages.admit(rt, ctx)
        return ctx

    async def _serve(self, ctx: RequestContext, exchange: Exchange) -> tuple[str, Outcome | None]:
        rt = self.rt
        for name, value in ctx.extra_headers:
            exchange.headers.append((name, value))
        if await stages.serve_from_cache(rt, ctx, exchange):
            return "cache", None
        body = ctx.upstream = self._upstream_body(ctx)
        route = RouteRequest(ctx.endpoint, ctx.model, ctx.tenant.namespace, ctx.body,
                             boundary_hint=ctx.headers.get("x-kvgate-cache-boundary"))
        if rt.tokenization.enabled:
            # Once per request, from the body the replica will see (None: route approximately).
            route.token_ids = await rt.tokenization.token_ids(ctx.model, ctx.endpoint, body)
        timeouts = rt.settings.timeouts
        call = UpstreamCall(
            path=self.path, payload=orjson.dumps(body),
            headers={**UPSTREAM_HEADERS, "content-type": "application/json", "x-request-id": ctx.request_id,
                     **self._upstream_headers(ctx)},
            read_timeout_s=max(timeouts.first_byte_s, timeouts.stall_s) if ctx.stream else timeouts.non_stream_s,
            connect_timeout_s=timeouts.connect_s, max_attempts=rt.settings.pool.max_attempts,
            priority=stages.vllm_priority(ctx),
            # A stream is open at its first event: a replica failing before it is retried (first_event).
            first=FirstEvent(partial(self._stream_observer, ctx), timeouts.first_byte_s) if ctx.stream else None,
            json=not ctx.stream,
        )
        stages.claim_slot(rt, ctx, call.payload, route.token_ids)
        stages.place_round_robin(rt, ctx, route)
        attempt = await self._open(route, call, ctx)
        started = getattr(rt.policy, "started", None)
        if started is not None:
            ctx.first_token = partial(started, route, attempt.replica.name)
        try:
            replica = attempt.replica
            outcome = await self._forward(ctx, exchange, attempt)
            if ctx.disagg is not None:
                rt.disagg.finished(ctx, replica.name, outcome.ttft_s)
            if self.prefills:
                started = time.perf_counter()
                usage = outcome.usage
                rt.policy.observe(route, RouteFeedback(
                    replica.name, usage.prompt_tokens if usage else None, usage.cached_tokens if usage else None,
                    outcome.failure is None, ttft_s=outcome.ttft_s,
                    completion_tokens=usage.completion_tokens if usage else None))
                rt.decision_times.add(attempt.prefer_s + time.perf_counter() - started)
                stages.account_savings(rt, ctx, route, replica.name, outcome)
            stages.after_response(rt, ctx, replica.name, outcome)
            return replica.name, outcome
        finally:
            await attempt.close()

    async def _forward(self, ctx: RequestContext, exchange: Exchange, attempt: Attempt) -> Outcome:
        """The replica's answer relayed to the client, and the replica's health told what it did."""
        rt = self.rt
        replica = attempt.replica
        exchange.add_header("x-kvgate-replica", replica.name)
        if attempt.retries:
            rt.metrics.retries.inc()
        decision = "retried" if attempt.retries else "first_choice"
        rt.metrics.routing.labels(decision).inc()
        rt.routing_counts[decision] += 1
        response = attempt.response
        if response.status_code != 200:
            raise await read_error_body(response, replica)
        try:
            outcome = await self._relay(ctx, exchange, attempt)
        except (UpstreamError, UpstreamTimeout):
            # The replica failed us before the first byte (garbage, text/html, silence):
            # that counts towards ejection, as Envoy counts the 502/504s it generates itself.
            rt.pool.record_failure(replica)
            raise
        rt.pool.record_success(replica) if outcome.failure is None else rt.pool.record_failure(replica)
        return outcome

    # Per-API hooks: an API with its own body rules, wire or routing overrides these.
    def _validate(self, body: dict[str, Any], headers: dict[str, str]) -> str:
        """Check the body (and any header the API defines); returns the model name."""
        limits = self.rt.settings.limits
        return validate(self.endpoint, body, max_n=limits.max_n, max_tokens=limits.max_tokens_ceiling)

    def _upstream_body(self, ctx: RequestContext) -> dict[str, Any]:
        return stages.upstream_body(ctx)

    def _upstream_headers(self, ctx: RequestContext) -> dict[str, str]:
        """Client headers the API passes on (credentials never: upstream headers are built from scratch)."""
        return {}

    def _observer(self, ctx: RequestContext, replica: str) -> StreamObserver:
        """What reads the stream of ``replica`` (the one the attempt went to) as it passes through
        (usage, text, the end)."""
        return StreamObserver(self.endpoint, strip_usage_chunk=not ctx.include_usage)

    def _stream_observer(self, ctx: RequestContext, replica: str) -> StreamObserver:
        """A fresh observer for each attempt at the stream (``first_event.FirstEvent``)."""
        observer = self._observer(ctx, replica)
        stages.hand_on_early(self.rt, ctx, observer)
        return observer

    def _whole_observer(self) -> WholeObserver | None:
        """What reads a whole answer; None: the chat family's (``relay.observe_choices``)."""
        return None

    async def _open(self, route: RouteRequest, call: UpstreamCall, ctx: RequestContext) -> Attempt:
        rt = self.rt
        if rt.pool.disaggregated:
            leg = self.prefill_legs.get(self.endpoint)
            if leg is not None and leg.applies(ctx.upstream):
                return await rt.disagg.open(ctx, route, call, leg, ctx.upstream)
        return await open_upstream(self.rt.pool, self.rt.policy, route, call, self.rt.replica_keys, ctx.ticket)

    async def _head(self, ctx: RequestContext, attempt: Attempt) -> Head:
        """The stream's first event: read in the retry loop (``UpstreamCall.first``), or here."""
        if attempt.head is not None:
            return attempt.head
        observer = self._stream_observer(ctx, attempt.replica.name)
        return await open_stream(attempt.response, observer, self.rt.settings.timeouts.first_byte_s)

    async def _relay(self, ctx: RequestContext, exchange: Exchange, attempt: Attempt) -> Outcome:
        timeouts = self.rt.settings.timeouts
        on_complete = None if ctx.cache_req is None else partial(stages.store_answer, self.rt, ctx)
        response = attempt.response
        if ctx.stream:
            return await relay_stream(response, await self._head(ctx, attempt), exchange, stall_s=timeouts.stall_s,
                                      started_at=ctx.started, on_complete=on_complete, on_first=ctx.first_token)
        return await relay_whole(response, exchange, endpoint=self.endpoint, timeout_s=timeouts.non_stream_s,
                                 on_complete=on_complete, observe=self._whole_observer())

    def _record(self, rid: str, status: int, replica: str, tenant: str, started: float,
                outcome: Outcome | None) -> None:
        elapsed = time.perf_counter() - started
        m = self.rt.metrics
        m.requests.labels(self.endpoint, str(status), replica, tenant).inc()
        m.latency.labels(self.endpoint).observe(elapsed)
        ttft = outcome.ttft_s if outcome is not None else None
        if ttft is not None:
            m.ttft.labels(self.endpoint).observe(ttft)
        self.rt.endpoint_stats.record(self.endpoint, status, elapsed, ttft)
        if log.isEnabledFor(logging.INFO):
            extra: dict[str, Any] = {"request_id": rid, "endpoint": self.endpoint, "status": status,
                                     "replica": replica, "tenant": tenant, "duration_ms": round(elapsed * 1000, 2)}
            if outcome is not None and outcome.usage is not None:
                extra.update(prompt_tokens=outcome.usage.prompt_tokens, cached_tokens=outcome.usage.cached_tokens,
                             completion_tokens=outcome.usage.completion_tokens)
            log.info("request", extra=extra)


    def _trace(self, rid: str, status: int, replica: str, tenant: str, started: float, outcome: Outcome | None,
               ctx: RequestContext | None, exchange: Exchange) -> None:
        usage = outcome.usage if outcome is not None else None
        cache = next((v.decode() for k, v in exchange.headers if k == b"x-kvgate-cache"), None)
        self.rt.tracing.record(f"kvgate {self.endpoint}", started, {
            "kvgate.request_id": rid, "kvgate.endpoint": self.endpoint, "http.response.status_code": status,
            "kvgate.tenant": tenant, "gen_ai.request.model": ctx.model if ctx else None,
            "kvgate.replica": replica, "kvgate.cache": cache, "kvgate.stream": ctx.stream if ctx else None,
            "gen_ai.usage.input_tokens": usage.prompt_tokens if usage else None,
            "kvgate.cached_tokens": usage.cached_tokens if usage else None,
            "gen_ai.usage.output_tokens": usage.completion_tokens if usage else None,
            "kvgate.ttft_ms": round(outcome.ttft_s * 1000, 3) if outcome and outcome.ttft_s else None,
        }, error=status >= 500)


def _headers(scope: Scope) -> dict[str, str]:
    # Lower-cased names; a repeated header keeps its last value (as most proxies do).
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
