"""vLLM's utility and pooling routes, passed to a replica that serves the request's model.

    /tokenize /detokenize                        tokenizer of the model (no model run)
    /rerank /v1/rerank /v2/rerank                 query against documents (Jina/Cohere shape)
    /score /v1/score                              pairs of inputs scored
    /pooling /classify                            raw pooler output, class probabilities
    /v1/audio/transcriptions /v1/audio/translations   multipart: a file plus form fields

Each path is forwarded to the same path upstream (vLLM serves every alias), with
what chat has: tenant authentication, model allow-list, rate limits, the body
limit, OpenAI-shaped errors, a replica's own 4xx passed on in that shape,
disconnect cancellation, metrics and access logs labelled by endpoint name.
No semantic cache: none of these is a chat answer.

Routing is by load alone: these requests leave no KV prefix a later request
could reuse (tokenize runs no model; a pooling pass is one prefill whose
blocks no follow-up turn extends), so the only fact worth routing on is load.

Multipart bodies are read whole, up to ``limits.max_body_bytes``, before the
replica sees a byte. Why not stream them: the model field may come after the
file (``curl -F file=@a.wav -F model=...``), so finding it can take the whole
body anyway; a body that is still arriving cannot be replayed, which would lose
the retry on a replica that refused the connection; and vLLM reads the whole
upload before its handler starts, so streaming would save the replica no time.
Memory stays bounded by the same limit as every JSON body.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import httpx
import orjson

from routing import LeastLoad, RouteRequest

from gateway.proxy import stages
from gateway.proxy.asgi_io import Exchange, Receive, Scope, read_body
from gateway.proxy.context import RequestContext
from gateway.errors import BadRequest, UpstreamError
from gateway.proxy.endpoint import ProxyEndpoint
from gateway.proxy.first_event import FirstEvent, media_type
from gateway.proxy.relay import Outcome, read_raw, relay_stream, relay_whole
from gateway.proxy.sse import StreamObserver
from gateway.proxy.transport import UPSTREAM_HEADERS
from gateway.proxy.upstream import Attempt, UpstreamCall, open_upstream
from .validate import audio_body, validate_utility
from gateway.proxy.validate import parse_json

if TYPE_CHECKING:
    from gateway.runtime import Runtime

__all__ = ["UTILITY_PATHS", "UtilityEndpoint", "utility_endpoints"]

# Client path -> endpoint name (the ``endpoint`` label of metrics and logs).
UTILITY_PATHS = {
    "/tokenize": "tokenize",
    "/detokenize": "detokenize",
    "/rerank": "rerank",
    "/v1/rerank": "rerank",
    "/v2/rerank": "rerank",
    "/score": "score",
    "/v1/score": "score",
    "/pooling": "pooling",
    "/classify": "classify",
    "/v1/audio/transcriptions": "transcriptions",
    "/v1/audio/translations": "translations",
}
_AUDIO = frozenset({"transcriptions", "translations"})
# The transcript formats OpenAI's audio API answers as text (response_format text, srt, vtt);
# vLLM 0.33 answers text as JSON and refuses srt/vtt, but a newer one or another server may not.
_TEXT_ANSWERS = frozenset({"text/plain", "text/vtt", "text/srt", "application/x-subrip"})
# What a replica may answer a streamed transcription with instead of a stream: relayed whole.
_WHOLE = frozenset({"application/json"}) | _TEXT_ANSWERS
_BY_LOAD = LeastLoad()


@dataclass(slots=True)
class UtilityContext(RequestContext):
    """A utility request: its upstream path and the exact bytes to forward."""

    path: str = ""
    payload: bytes = b""
    content_type: str = "application/json"


class UtilityEndpoint(ProxyEndpoint):
    """The hot path of ``ProxyEndpoint`` (errors, disconnects, metrics, logs, traces) with
    this family's parsing, load routing and content-type-driven relay."""

    def __init__(self, endpoint: str, runtime: "Runtime") -> None:
        self.endpoint = endpoint
        self.path = ""  # the client's path, per request
        self.rt = runtime

    async def _prepare(self, scope: Scope, receive: Receive, headers: dict[str, str], rid: str,
                       started: float) -> RequestContext:
        rt = self.rt
        tenant = stages.authenticate(rt, headers, scope.get("query_string", b""))
        audio = self.endpoint in _AUDIO
        ctype = headers.get("content-type", "" if audio else "application/json")
        media = ctype.split(";", 1)[0].strip().lower()
        if not audio and media != "application/json" and not media.endswith("+json"):
            raise BadRequest("Content-Type must be application/json", code="invalid_content_type")
        limits = rt.settings.limits
        raw = await read_body(receive, limit=limits.max_body_bytes, content_length=headers.get("content-length"),
                              deadline_s=rt.settings.timeouts.body_receive_s)
        if audio:
            form = audio_body(raw, ctype)
            ctx = UtilityContext(rid, self.endpoint, headers, {"model": form.model}, form.model, tenant,
                                 form.stream, False, started, path=scope["path"], payload=form.payload,
                                 content_type=ctype)
            await stages.admit(rt, ctx)  # the form's forbidden fields are already gone from the payload
            return ctx
        body = parse_json(raw, max_depth=limits.max_json_depth)
        model = validate_utility(self.endpoint, body)
        ctx = UtilityContext(rid, self.endpoint, headers, body, model, tenant, False, False, started,
                             path=scope["path"])
        await stages.admit(rt, ctx)
        ctx.payload = orjson.dumps(ctx.body)  # after admit: stripped fields gone, salt set
        return ctx

    async def _serve(self, ctx: RequestContext, exchange: Exchange) -> tuple[str, Outcome | None]:
        assert isinstance(ctx, UtilityContext)
        rt = self.rt
        for name, value in ctx.extra_headers:
            exchange.headers.append((name, value))
        timeouts = rt.settings.timeouts
        call = UpstreamCall(
            path=ctx.path, payload=ctx.payload,
            headers={**UPSTREAM_HEADERS, "content-type": ctx.content_type, "x-request-id": ctx.request_id},
            read_timeout_s=max(timeouts.first_byte_s, timeouts.stall_s) if ctx.stream else timeouts.non_stream_s,
            connect_timeout_s=timeouts.connect_s, max_attempts=rt.settings.pool.max_attempts,
            # A JSON body only: a multipart form is forwarded as the client's bytes.
            priority=stages.vllm_priority(ctx) if ctx.content_type == "application/json" else 0,
            # A streamed transcription is open at its first event, as chat's (first_event): a replica
            # failing before it is retried. Unless the replica answers it whole, which is its to say.
            first=FirstEvent(partial(self._stream_observer, ctx), timeouts.first_byte_s, _WHOLE)
            if ctx.stream else None,
        )
        route = RouteRequest(ctx.endpoint, ctx.model, ctx.tenant.namespace, ctx.body)
        stages.claim_slot(rt, ctx, ctx.payload)
        attempt = await open_upstream(rt.pool, _BY_LOAD, route, call, rt.replica_keys, ctx.ticket)
        try:
            replica = attempt.replica
            outcome = await self._forward(ctx, exchange, attempt)
            stages.after_response(rt, ctx, replica.name, outcome)
            return replica.name, outcome
        finally:
            await attempt.close()

    def _observer(self, ctx: RequestContext, replica: str) -> StreamObserver:
        # vLLM's transcription chunks end with [DONE] like chat's; nothing is injected or stripped.
        return StreamObserver(self.endpoint, strip_usage_chunk=False)

    async def _relay(self, ctx: RequestContext, exchange: Exchange, attempt: Attempt) -> Outcome:
        """By what the replica sent: SSE (a streamed transcription), JSON, or a transcript as text."""
        timeouts = self.rt.settings.timeouts
        response = attempt.response
        media = media_type(response)
        if attempt.head is not None or media == "text/event-stream":
            # A stream's first event is in hand (``UpstreamCall.first``), or, for an answer streamed
            # unasked, read here (``_head``).
            head = await self._head(ctx, attempt)
            return await relay_stream(response, head, exchange, stall_s=timeouts.stall_s, started_at=ctx.started)
        if media == "application/json":
            return await relay_whole(response, exchange, endpoint=self.endpoint, timeout_s=timeouts.non_stream_s)
        if media in _TEXT_ANSWERS:
            return await relay_bytes(response, exchange, timeout_s=timeouts.non_stream_s,
                                     content_type=response.headers["content-type"])
        # A 200 text/html is an ingress or captive portal answering for the replica, as on chat.
        raise UpstreamError("replica sent an invalid answer")


async def relay_bytes(response: httpx.Response, exchange: Exchange, *, timeout_s: float, content_type: str,
                      max_bytes: int = 64 * 1024 * 1024) -> Outcome:
    """A transcript as text, whole, with the replica's content type."""
    body = await read_raw(response, timeout_s=timeout_s, max_bytes=max_bytes)
    await exchange.start(200, [(b"content-type", content_type.encode("latin-1")),
                               (b"content-length", str(len(body)).encode())])
    await exchange.body(body, more=False)
    return Outcome(complete=True)


def utility_endpoints(rt: "Runtime") -> dict[str, UtilityEndpoint]:
    """Path -> endpoint for ``KvgateApp``; one endpoint object per name, shared by its aliases."""
    by_name = {name: UtilityEndpoint(name, rt) for name in dict.fromkeys(UTILITY_PATHS.values())}
    return {path: by_name[name] for path, name in UTILITY_PATHS.items()}
