"""``/v1/chat/completions`` and ``/v1/completions``: parse, inject faults, generate, stream back.

One ASGI callable per endpoint. The order of a request's life is fixed here:
read the body, roll the whole-response faults (before any work, as a replica
failing fast would), validate, submit to the engine, then write the reply,
either at once or as SSE events sent the moment each token exists.
Per-token faults (stalls, garbage, dying) act while writing, except the stall
before the first token, which the engine holds the request for: a client
leaving during it must count as an abort, and the reply must not be produced
in the meantime.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import orjson

from vllm_sim import wire
from vllm_sim.asgi import (
    BodyTooLarge, ClientDisconnected, Receive, Send, Sender, read_body, run_until_disconnect,
)
from vllm_sim.engine import GenRequest, Generation, PromptTooLong, TokenEvent
from vllm_sim.faults import Faults, fault_reply
from vllm_sim.pd import PullFailed
from vllm_sim.priority import header_priority
from vllm_sim.protocol import (
    GenerationParams, Kind, parse_generation, parse_json, prompt_tokens, resolve_max_tokens,
)
from vllm_sim.hf_tokenizer import HFPrompts
from vllm_sim.replica import Replica

__all__ = ["GenerationEndpoint", "PULL_FAILED"]

# vLLM's kv_load_failure_policy "fail": finish reason "error", which its server answers with a 500.
PULL_FAILED = wire.ApiError(500, "Internal server error", "InternalServerError")

_GARBAGE_EVENT = b'data: {"id": "chatcmpl-garbage", "choices": [{"delta": \n\n'


class _Format:
    """Builds one request's SSE events and final body (ids, model and usage mode fixed per request).

    The Anthropic Messages route (``vllm_sim.messages``) subclasses it: same engine, other events."""

    garbage = _GARBAGE_EVENT  # what the ``garbage`` fault sends after the first token

    def __init__(self, params: GenerationParams, rid: str) -> None:
        # P/D: a request that carried kv_transfer_params gets the connector's answer
        # (None on a decode) in its response's own kv_transfer_params field.
        self.echo_kv = params.kv_transfer_params is not None
        self.kv_params: dict[str, Any] | None = None
        self.chat = params.kind == "chat"
        self.rid = rid
        self.created = int(time.time())
        self.model = params.model
        self.n = params.n
        self.with_usage = params.include_usage

    def opening(self) -> bytes:
        if not self.chat:
            return b""
        delta = {"role": "assistant", "content": ""}
        return b"".join(
            wire.chat_chunk(self.rid, self.created, self.model, i, delta, None, self.with_usage)
            for i in range(self.n)
        )

    def token(self, ev: TokenEvent) -> bytes:
        if self.chat:
            return wire.chat_chunk(self.rid, self.created, self.model, ev.index, {"content": ev.text},
                                   ev.finish_reason, self.with_usage)
        return wire.completion_chunk(self.rid, self.created, self.model, ev.index, ev.text,
                                     ev.finish_reason, self.with_usage)

    def last_token(self, ev: TokenEvent, kv_params: dict[str, Any]) -> bytes:
        """The chunk with the finish reason, carrying a prefill's ``kv_transfer_params`` as vLLM's
        chat and completions streams do."""
        chunk = orjson.loads(self.token(ev)[len(b"data: "):])
        chunk["kv_transfer_params"] = kv_params
        return wire.sse(chunk)

    def usage_event(self, gen: Generation) -> bytes:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return wire.usage_chunk(self.rid, self.created, self.model, obj, _usage(gen))

    def closing(self, gen: Generation) -> bytes:
        """The events after the last token."""
        return (self.usage_event(gen) if self.with_usage else b"") + wire.DONE

    def response(self, gen: Generation, texts: list[list[str]]) -> dict[str, Any]:
        build = wire.chat_response if self.chat else wire.completion_response
        return build(self.rid, self.created, self.model, ["".join(t) for t in texts],
                     gen.finish_reasons, _usage(gen))


def _usage(gen: Generation) -> dict[str, Any]:
    return wire.usage(gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens)



async def open_request(replica: Replica, receive: Receive, sender: Sender,
                       too_large: dict[str, Any]) -> tuple[bytes, Faults] | None:
    """Every POST's opening: the body, then the replica's fault roll. None: already answered
    (413 with ``too_large``, a fault's reply) or the client went away."""
    try:
        raw = await read_body(receive)
    except ClientDisconnected:
        return None
    except BodyTooLarge:
        await sender.json(413, too_large)
        return None
    faults, verdict = replica.roll_faults()
    if verdict is not None:
        status, headers, body = fault_reply(verdict, faults)
        await sender.full(status, body, headers[0][1], headers[1:])
        return None
    return raw, faults

class GenerationEndpoint:
    """The ASGI app behind one generation route."""

    # vLLM's chat and completions models have a ``priority`` field (Messages' has none).
    takes_priority = True

    def __init__(self, replica: Replica, kind: Kind) -> None:
        self.replica = replica
        self.kind = kind

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        sender = Sender(send)
        opened = await open_request(self.replica, receive, sender,
                                    wire.error_body("Request body too large.", "BadRequestError", None, 413))
        if opened is None:
            return
        raw, faults = opened
        try:
            request, fmt, stream = await self._prepare(raw, faults)
            if self.takes_priority:
                request.priority = header_priority(scope.get("headers") or (), request.priority)
        except wire.ApiError as exc:
            await sender.json(exc.status, self._error_body(exc))
            return
        except PullFailed:
            await sender.json(500, self._error_body(PULL_FAILED))
            return
        write = self._stream if stream else self._unary
        await run_until_disconnect(write(sender, request, fmt, faults), receive, sender)

    def _error_body(self, exc: wire.ApiError) -> dict[str, Any]:
        return exc.body()

    def _params(self, body: dict[str, Any]) -> GenerationParams:
        return parse_generation(self.kind, body, self.replica.config)

    def _prompts(self) -> HFPrompts | None:
        """The replica's real tokenizer and chat template, when it has one (vLLM's exact ids)."""
        return self.replica.prompts

    def _format(self, params: GenerationParams, request: GenRequest) -> _Format:
        return _Format(params, request.request_id)

    async def _prepare(self, raw: bytes, faults: Faults) -> tuple[GenRequest, _Format, bool]:
        """Validate and tokenize; raises ``ApiError`` with vLLM's status and wording."""
        config, engine = self.replica.config, self.replica.engine
        params = self._params(parse_json(raw))
        tokens = await prompt_tokens(params, self._prompts())
        max_tokens = resolve_max_tokens(params, len(tokens), config)
        try:
            engine.check_prompt(len(tokens))
        except PromptTooLong as exc:
            raise wire.ApiError(400, str(exc), param="prompt") from None
        rid = ("chatcmpl-" if self.kind == "chat" else "cmpl-") + uuid.uuid4().hex
        request = GenRequest(rid, tokens, max_tokens, params.n, params.cache_salt,
                             hold_s=faults.stall_before_first_token_s, lora=config.lora(params.model),
                             priority=params.priority)
        # P/D (vllm_sim.pd): a prefill leg keeps its blocks, a decode leg pulls its prompt's first.
        await self.replica.pd.begin(request, params.kv_transfer_params)
        return request, self._format(params, request), params.stream

    async def _stream(self, sender: Sender, request: GenRequest, fmt: _Format, faults: Faults) -> None:
        async with self.replica.engine.generate(request) as gen:
            await sender.start(200, b"text/event-stream", [(b"cache-control", b"no-cache"),
                                                            (b"x-accel-buffering", b"no")])
            # Like vLLM, the role chunk goes out with the first token (after prefill),
            # not with the headers: a replica that never produces a token sends no event.
            opening = fmt.opening()
            sent = 0
            async for ev in gen:
                if faults.die_after_tokens is not None and sent >= faults.die_after_tokens:
                    return  # leaving mid-body makes uvicorn close the connection: no [DONE]
                # P/D: a prefill leg's blocks are held, and its params sent, with the last token.
                kv = self.replica.pd.finished(request, gen) if ev.finish_reason and gen.finished else None
                await sender.body(opening + (fmt.token(ev) if kv is None else fmt.last_token(ev, kv)))
                opening = b""
                sent += 1
                if faults.garbage and sent == 1:
                    await sender.body(fmt.garbage)
                if faults.stall_mid_stream_s and sent == faults.stall_after_tokens:
                    await asyncio.sleep(faults.stall_mid_stream_s)
            if opening:
                await sender.body(opening)
            await sender.body(fmt.closing(gen), more=False)

    async def _unary(self, sender: Sender, request: GenRequest, fmt: _Format, faults: Faults) -> None:
        texts: list[list[str]] = [[] for _ in range(request.n)]
        dying = False
        async with self.replica.engine.generate(request) as gen:
            sent = 0
            async for ev in gen:
                if faults.die_after_tokens is not None and sent >= faults.die_after_tokens:
                    dying = True
                    break
                texts[ev.index].append(ev.text)
                sent += 1
                if faults.stall_mid_stream_s and sent == faults.stall_after_tokens:
                    await asyncio.sleep(faults.stall_mid_stream_s)
            if not dying:
                fmt.kv_params = self.replica.pd.finished(request, gen)
        answer = fmt.response(gen, texts)
        if fmt.echo_kv:
            answer["kv_transfer_params"] = fmt.kv_params
        body = orjson.dumps(answer)
        if dying:
            # Promise the whole body, send half, leave: the client sees a truncated response.
            await sender.start(200, b"application/json", [(b"content-length", str(len(body)).encode())])
            await sender.body(body[: len(body) // 2])
            return
        if faults.garbage:
            body = body[: len(body) // 2]
        await sender.full(200, body, b"application/json")
