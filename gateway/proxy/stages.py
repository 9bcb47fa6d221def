"""The per-request stages around forwarding: tenant policy, the semantic cache, and
what happens once an answer is complete. Each is a small function over the runtime
and the request context, called by the proxy in a fixed order.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from policies import AuthError, PolicyError
from policies.priority import PRIORITY_HEADER, TAKES_PRIORITY, VLLM_PRIORITY, request_class
from routing import strip_cache_control
from routing.backlog import CHARS_PER_TOKEN

from .asgi_io import Exchange
from gateway.errors import from_policy
from .relay import SSE_HEADERS, Outcome

if TYPE_CHECKING:
    from policies import Tenant
    from routing import RouteRequest

    from .context import RequestContext
    from .sse import StreamObserver
    from gateway.runtime import Runtime

log = logging.getLogger("kvgate.stages")
# Looked up by the cache: responses and messages only to be bypassed, their reason counted in
# metrics (x-kvgate-cache: bypass). semantic_cache keys and replays chat and completions answers only.
_CACHEABLE = ("chat", "completions", "responses", "messages")
# Requests that run no model, so take no seat in a replica's batch: never queued for one.
_NO_SEAT = frozenset({"tokenize", "detokenize", "count_tokens"})


def authenticate(rt: "Runtime", headers: dict[str, str], query_string: bytes) -> "Tenant":
    try:
        return rt.engine.authenticate(headers, query_string)
    except (AuthError, PolicyError) as err:
        raise from_policy(err) from None


async def admit(rt: "Runtime", ctx: "RequestContext") -> None:
    """Tenant policy: the request's class, model allow-list, salt, client-field stripping,
    hygiene, rate limits."""
    try:
        # First: a refused header must not spend rate budget.
        ctx.priority_class = request_class(ctx.tenant.priority, ctx.headers.get(PRIORITY_HEADER))
    except PolicyError as err:
        raise from_policy(err) from None
    decision = await rt.engine.admit(ctx.tenant, ctx.endpoint, ctx.body)  # type: ignore[arg-type]
    if decision.rejection is not None:
        rej = decision.rejection
        if rej.status == 429:
            rt.metrics.rate_limited.labels(ctx.tenant.name, rej.code).inc()
        raise from_policy(rej, headers=dict(rej.headers))
    ctx.body = dict(decision.body)
    for name, value in decision.response_headers:
        ctx.extra_headers.append((name.encode("latin-1"), value.encode("latin-1")))
    if decision.warnings:
        row = rt.tenant_stats.row(ctx.tenant.name)
        for w in decision.warnings:
            rt.metrics.hygiene.labels(ctx.tenant.name, w.kind).inc()
            row.warnings += 1


def vllm_priority(ctx: "RequestContext") -> int:
    """vLLM's ``priority`` for the request, on the routes that take one (else 0: none sent)."""
    return VLLM_PRIORITY[ctx.priority_class] if ctx.endpoint in TAKES_PRIORITY else 0


def claim_slot(rt: "Runtime", ctx: "RequestContext", payload: bytes, token_ids: list[int] | None = None) -> None:
    """The request's ticket for admission (None while it is off), its work in prompt tokens:
    exact when routing tokenized the request, else estimated from the body's size."""
    if ctx.endpoint in _NO_SEAT or not rt.admission.active:
        return
    cost = len(token_ids) if token_ids else len(payload) / CHARS_PER_TOKEN
    ctx.ticket = rt.admission.ticket(ctx.tenant, ctx.priority_class, cost)


def hand_on_early(rt: "Runtime", ctx: "RequestContext", observer: StreamObserver) -> None:
    """Let the request's slot go at its answer's last decode step (``Ticket.last_step``): only for a
    stream of the chat family with a single choice whose length is bounded by ``max_tokens``.
    Other answers end when they end, which nothing here can foresee."""
    if (ctx.ticket is None or not ctx.stream or ctx.endpoint not in ("chat", "completions")
            or not rt.settings.pool.hand_on_at_last_step):
        return
    body = ctx.body
    if body.get("n") not in (None, 1) or body.get("best_of") not in (None, 1) or body.get("use_beam_search"):
        return  # several sequences share the slot
    bound = body.get("max_completion_tokens") if ctx.endpoint == "chat" else None
    if bound is None:
        bound = body.get("max_tokens")
    if isinstance(bound, int) and not isinstance(bound, bool) and bound >= 2:
        observer.tokens_left = bound
        observer.on_last_step = ctx.ticket.last_step


def upstream_body(ctx: "RequestContext") -> dict[str, Any]:
    """What the replica receives: no routing hints it would reject; usage always on for streams."""
    body = strip_cache_control(ctx.body) if ctx.endpoint == "chat" else dict(ctx.body)
    if ctx.stream and not ctx.include_usage:
        so = body.get("stream_options")
        body["stream_options"] = {**(so if isinstance(so, dict) else {}), "include_usage": True}
    return body


async def serve_from_cache(rt: "Runtime", ctx: "RequestContext", exchange: Exchange) -> bool:
    """Answer from the semantic cache when it can; marks the request for storing when it can't."""
    cache = rt.cache
    if cache is None or ctx.endpoint not in _CACHEABLE:
        return False
    from semantic_cache import cache_request, completion_body, sse_events

    req = cache_request(ctx.endpoint, ctx.tenant.namespace, ctx.body, ctx.headers,
                        enabled_for_tenant=ctx.tenant.semantic_cache, settings=rt.settings.semantic_cache)
    lookup = await cache.lookup(req)
    exchange.add_header("x-kvgate-cache", lookup.status)
    row = rt.tenant_stats.row(ctx.tenant.name)
    if lookup.status != "bypass":
        row.semantic_lookups += 1
    rt.metrics.cache.labels(lookup.status, lookup.tier or "-", ctx.tenant.name).inc()
    if lookup.status != "hit" or lookup.answer is None:
        if req.bypass_reason is None or req.store_ok:
            ctx.cache_req = req
            ctx.cache_embedding = lookup.embedding
        return False
    row.semantic_hits += 1
    row.requests += 1
    if rt.savings is not None:
        rt.savings.cache_hit(ctx.tenant.name, lookup.answer.prompt_tokens, lookup.answer.completion_tokens)
    exchange.add_header("x-kvgate-cache-similarity", f"{lookup.similarity if lookup.similarity is not None else 1:.4f}")
    exchange.add_header("x-kvgate-replica", "cache")
    if ctx.stream:
        await exchange.start(200, SSE_HEADERS)
        for event in sse_events(lookup.answer, request_id=ctx.request_id, model=ctx.model, endpoint=ctx.endpoint,
                                include_usage=ctx.include_usage):
            await exchange.body(event)
        await exchange.body(b"", more=False)
    else:
        await exchange.json(200, completion_body(lookup.answer, request_id=ctx.request_id, model=ctx.model,
                                                 endpoint=ctx.endpoint))
    return True


def after_response(rt: "Runtime", ctx: "RequestContext", replica: str, outcome: Outcome) -> None:
    """Account for a served answer (``store_answer`` already cached it, if it could)."""
    row = rt.tenant_stats.row(ctx.tenant.name)
    row.requests += 1
    usage = outcome.usage
    tenant = ctx.tenant.name
    if usage is not None:
        tokens = rt.metrics.tokens
        if usage.prompt_tokens:
            tokens.labels("prompt", replica, tenant).inc(usage.prompt_tokens)
            row.prompt_tokens += usage.prompt_tokens
        if usage.completion_tokens:
            tokens.labels("completion", replica, tenant).inc(usage.completion_tokens)
        if usage.cached_tokens:
            tokens.labels("cached", replica, tenant).inc(usage.cached_tokens)
            row.cached_tokens += usage.cached_tokens
        total = (usage.prompt_tokens or 0) + (usage.completion_tokens or 0)
        if total and (ctx.tenant.tpm is not None):
            rt.spawn(rt.engine.record_usage(ctx.tenant, total))


def place_round_robin(rt: "Runtime", ctx: "RequestContext", route: "RouteRequest") -> None:
    """Round robin's replica for this request, chosen as it is routed (``account_savings`` reads it)."""
    if rt.savings is None:
        return
    try:
        rt.savings.routed(route, rt.pool.eligible(ctx.model))
    except Exception:  # as in account_savings: the figures may suffer, never the request
        log.exception("savings placement failed", extra={"request_id": ctx.request_id})


def account_savings(rt: "Runtime", ctx: "RequestContext", route: "RouteRequest", replica: str,
                    outcome: Outcome) -> None:
    """What routing saved on this answer against round robin (``gateway.observe.savings``), over the
    replicas round robin would have rotated over: the ones eligible for the model now."""
    if rt.savings is None:
        return
    try:
        rt.savings.served(route, ctx.tenant.name, replica, rt.pool.eligible(ctx.model), outcome, ctx.started)
    except Exception:  # an accounting bug costs the savings figures, never the answer
        log.exception("savings accounting failed", extra={"request_id": ctx.request_id})


async def store_answer(rt: "Runtime", ctx: "RequestContext", outcome: Outcome) -> None:
    """Cache a whole, clean answer; the relay awaits this before the client's final bytes.

    The exact-tier write is waited for (an in-process store at once, Redis one round
    trip), at most ``store_wait_ms``: a slow Redis finishes it in the background rather
    than hold the response. The vector follows in the background as soon as the
    embedding the lookup started is ready."""
    cache = rt.cache
    if (ctx.cache_req is None or cache is None or not outcome.complete or outcome.failure is not None
            or outcome.has_tool_calls):
        return
    from semantic_cache import CachedAnswer

    usage = outcome.usage
    answer = CachedAnswer(content=outcome.text, finish_reason=outcome.finish_reason or "",
                          model=ctx.model, prompt_tokens=(usage.prompt_tokens or 0) if usage else 0,
                          completion_tokens=(usage.completion_tokens or 0) if usage else 0,
                          created=int(time.time()))
    req, embedding = ctx.cache_req, ctx.cache_embedding
    ctx.cache_req = ctx.cache_embedding = None  # stored once, whatever happens next

    async def write() -> None:
        assert cache is not None
        stored = await cache.store_exact(req, answer, embedding)
        if not isinstance(stored, bool):
            rt.spawn(cache.store_vector(stored))

    # A task, so neither the wait's bound nor a client going away cuts the write short.
    await asyncio.wait({rt.spawn(write())}, timeout=rt.settings.semantic_cache.store_wait_ms / 1000)
