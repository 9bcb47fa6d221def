"""``/v1/responses`` as vLLM serves it: generate, stream named events, keep stored responses in memory.

vLLM keeps each stored response (``store``, default true) and the messages that
produced it in this replica's memory only: ``GET /v1/responses/{id}``,
``POST /v1/responses/{id}/cancel`` and ``previous_response_id`` work here and
404 on any other replica, which is the behaviour a gateway's affinity must cope
with. A continuation's prompt is the previous prompt's messages, the previous
answer, then the new input, so its prefix is cached on this replica.

``background: true`` answers at once with status ``queued`` and generates in a
task; cancel stops it (the engine aborts the sequence). Faults act as on chat:
whole-response faults before any work, ``die_after_tokens`` / ``garbage`` /
stalls while streaming.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterable

import orjson
from starlette.requests import Request
from starlette.responses import Response

from vllm_sim import wire
from vllm_sim.asgi import Receive, Send, Sender, run_until_disconnect
from vllm_sim.engine import GenRequest, PromptTooLong
from vllm_sim.faults import Faults
from vllm_sim.handlers import PULL_FAILED, open_request
from vllm_sim.pd import PullFailed
from vllm_sim.priority import body_priority, header_priority
from vllm_sim.protocol import (
    GenerationParams, kv_transfer_params, parse_json, prompt_tokens, resolve_max_tokens, resolve_model,
)
from vllm_sim.replica import Replica
from vllm_sim.responses_wire import Shape, event, response_usage
from vllm_sim.template import render_chat

__all__ = ["ResponsesApi"]

_SSE_HEADERS = [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
_TEXT_PARTS = ("input_text", "output_text", "text")


@dataclass
class _Stored:
    response: dict[str, Any]
    messages: list[dict[str, Any]]  # the conversation so far (no system message), for continuations
    task: asyncio.Task[None] | None = None


@dataclass
class _Job:
    request: GenRequest
    shape: Shape
    messages: list[dict[str, Any]]
    stream: bool
    store: bool
    background: bool
    texts: list[str] = field(default_factory=list)
    # P/D (vllm_sim.pd): the request carried kv_transfer_params, so the response echoes the
    # connector's answer (the prefill's params, None on a decode).
    echo_kv: bool = False
    kv_params: dict[str, Any] | None = None


def _part(p: Any) -> Any:
    if isinstance(p, dict) and p.get("type") in _TEXT_PARTS:
        return {"type": "text", "text": p.get("text", "")}
    return p


def _to_messages(items: Any) -> list[dict[str, Any]]:
    """Input items as chat messages, the way vLLM hands them to the chat template."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise wire.ApiError(400, "input must be a string or a non-empty list of input items.", param="input")
    out: list[dict[str, Any]] = []
    for item in items:
        if not isinstance(item, dict):
            raise wire.ApiError(400, "Each input item must be an object.", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            content = item.get("content")
            parts = [_part(p) for p in content] if isinstance(content, list) else content
            out.append({"role": item.get("role", "user"), "content": parts})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": item.get("output")})
        else:
            out.append({"role": "user", "content": orjson.dumps(item).decode()})
    return out


class ResponsesApi:
    """The three Responses routes of one replica, and its store."""

    def __init__(self, replica: Replica) -> None:
        self.replica = replica
        self.store: dict[str, _Stored] = {}

    # -- POST /v1/responses --------------------------------------------------------------------
    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        sender = Sender(send)
        opened = await open_request(self.replica, receive, sender,
                                    wire.error_body("Request body too large.", "BadRequestError", None, 413))
        if opened is None:
            return
        raw, faults = opened
        try:
            job = await self._prepare(raw, faults, scope.get("headers") or ())
        except wire.ApiError as exc:
            await sender.json(exc.status, exc.body())
            return
        except PullFailed:
            await sender.json(500, PULL_FAILED.body())
            return
        if job.background:
            queued = job.shape.response("queued")
            stored = self.store[job.shape.rid] = _Stored(queued, job.messages)
            stored.task = asyncio.ensure_future(self._background(job, faults, stored))
            await sender.json(200, queued)
            return
        work = self._stream(sender, job, faults) if job.stream else self._unary(sender, job, faults)
        await run_until_disconnect(work, receive, sender)

    async def _prepare(self, raw: bytes, faults: Faults, headers: Iterable[tuple[bytes, bytes]] = ()) -> _Job:
        config = self.replica.config
        body = parse_json(raw)
        model = resolve_model(body, config)
        store, background = body.get("store", True), bool(body.get("background", False))
        if background and not store:
            raise wire.ApiError(400, "background can only be used when `store` is true", param="background")
        if background and body.get("stream"):
            raise wire.ApiError(400, "The simulator does not stream background responses.", param="stream")
        history: list[dict[str, Any]] = []
        prev_id = body.get("previous_response_id")
        if prev_id is not None:
            prev = self.store.get(prev_id) if isinstance(prev_id, str) else None
            if prev is None:
                raise wire.ApiError(404, f"Response with id '{prev_id}' not found.", "invalid_request_error",
                                    "response_id")
            history = [*prev.messages, *_answer(prev.response)]
        messages = [*history, *_to_messages(body.get("input"))]
        system = [{"role": "system", "content": body["instructions"]}] if isinstance(
            body.get("instructions"), str) else []
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise wire.ApiError(400, "tools must be a list.", param="tools")
        max_tokens = body.get("max_output_tokens")
        if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)
                                       or max_tokens < 1):
            raise wire.ApiError(400, "max_output_tokens must be an integer >= 1.", param="max_output_tokens")
        salt = body.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise wire.ApiError(400, "Parameter 'cache_salt' must be a non-empty string if provided.",
                                param="cache_salt")
        priority = header_priority(headers, body_priority(body))
        params = GenerationParams("chat", model, render_chat([*system, *messages], tools), None, max_tokens, 1,
                                  bool(body.get("stream")), False, salt)
        tokens = await prompt_tokens(params)
        resolve_max_tokens(params, len(tokens), config)
        try:
            self.replica.engine.check_prompt(len(tokens))
        except PromptTooLong as exc:
            raise wire.ApiError(400, str(exc), param="input") from None
        rid = "resp_" + uuid.uuid4().hex
        # vLLM echoes the effective limit: without one, the rest of the context.
        limit = max_tokens if max_tokens is not None else config.max_model_len - len(tokens)
        shape = Shape(rid, "msg_" + uuid.uuid4().hex, int(time.time()), model, body, limit)
        request = GenRequest(rid, tokens, max_tokens, 1, salt, hold_s=faults.stall_before_first_token_s,
                             lora=config.lora(model), priority=priority)
        kv = kv_transfer_params(body)
        await self.replica.pd.begin(request, kv)  # P/D legs (vllm_sim.pd)
        return _Job(request, shape, messages, params.stream, bool(store), background, echo_kv=kv is not None)

    def _final(self, job: _Job, gen: Any) -> dict[str, Any]:
        usage = response_usage(gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens)
        cut = gen.finish_reasons[0] == "length"
        response = job.shape.response("incomplete" if cut else "completed", "".join(job.texts), usage,
                                      incomplete="max_output_tokens" if cut else None)
        if job.echo_kv:
            response["kv_transfer_params"] = job.kv_params
        if job.store:
            self.store[job.shape.rid] = _Stored(response, job.messages)
        return response

    async def _stream(self, sender: Sender, job: _Job, faults: Faults) -> None:
        shape, seq = job.shape, 0

        def ev(kind: str, **fields: Any) -> bytes:
            nonlocal seq
            seq += 1
            return event(kind, seq - 1, **fields)

        async with self.replica.engine.generate(job.request) as gen:
            await sender.start(200, b"text/event-stream", _SSE_HEADERS)
            progress = shape.response("in_progress")
            await sender.body(ev("response.created", response=progress) + ev("response.in_progress",
                                                                              response=progress))
            where = {"item_id": shape.msg_id, "output_index": 0, "content_index": 0}
            async for tok in gen:
                if faults.die_after_tokens is not None and len(job.texts) >= faults.die_after_tokens:
                    return  # leaving mid-body makes uvicorn drop the connection: no terminal event
                opening = b""
                if not job.texts:
                    opening = (ev("response.output_item.added", output_index=0,
                                  item=shape.message(None, "in_progress"))
                               + ev("response.content_part.added", **where, part=shape.part("")))
                job.texts.append(tok.text)
                await sender.body(opening + ev("response.output_text.delta", **where, delta=tok.text, logprobs=[]))
                if faults.garbage and len(job.texts) == 1:
                    await sender.body(b"event: response.output_text.delta\ndata: {\"type\": \n\n")
                if faults.stall_mid_stream_s and len(job.texts) == faults.stall_after_tokens:
                    await asyncio.sleep(faults.stall_mid_stream_s)
        final = self._final(job, gen)
        text = "".join(job.texts)
        terminal = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        await sender.body(ev("response.output_text.done", **where, text=text, logprobs=[])
                          + ev("response.content_part.done", **where, part=shape.part(text))
                          + ev("response.output_item.done", output_index=0, item=shape.message(text))
                          + ev(terminal, response=final), more=False)

    async def _unary(self, sender: Sender, job: _Job, faults: Faults) -> None:
        async with self.replica.engine.generate(job.request) as gen:
            async for tok in gen:
                job.texts.append(tok.text)
            job.kv_params = self.replica.pd.finished(job.request, gen)
        body = orjson.dumps(self._final(job, gen))
        if faults.garbage:
            body = body[: len(body) // 2]
        await sender.full(200, body, b"application/json")

    async def _background(self, job: _Job, faults: Faults, stored: _Stored) -> None:
        try:
            async with self.replica.engine.generate(job.request) as gen:
                stored.response = {**stored.response, "status": "in_progress"}
                async for tok in gen:
                    job.texts.append(tok.text)
            job.store = True
            stored.response = self._final(job, gen)
        except asyncio.CancelledError:
            stored.response = {**stored.response, "status": "cancelled"}

    # -- GET /v1/responses/{id}, POST /v1/responses/{id}/cancel ----------------------------------
    def _lookup(self, request: Request) -> _Stored | Response:
        rid = request.path_params["response_id"]
        stored = self.store.get(rid)
        if stored is None:
            return _error(404, f"Response with id '{rid}' not found.", param="response_id")
        return stored

    async def retrieve(self, request: Request) -> Response:
        stored = self._lookup(request)
        return stored if isinstance(stored, Response) else _json(stored.response)

    async def cancel(self, request: Request) -> Response:
        stored = self._lookup(request)
        if isinstance(stored, Response):
            return stored
        # As vLLM: only a background response still running can be cancelled.
        if stored.task is None or stored.response["status"] not in ("queued", "in_progress"):
            return _error(400, "Cannot cancel a synchronous response.", param="response_id")
        stored.task.cancel()
        await asyncio.gather(stored.task, return_exceptions=True)
        return _json(stored.response)


def _answer(response: dict[str, Any]) -> list[dict[str, Any]]:
    """The previous answer as the assistant turn of the next prompt."""
    out = []
    for item in response.get("output") or ():
        if item.get("type") == "message":
            text = "".join(p.get("text", "") for p in item.get("content") or () if p.get("type") == "output_text")
            out.append({"role": "assistant", "content": text})
    return out


def _json(payload: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(payload), status, media_type="application/json")


def _error(status: int, message: str, param: str | None = None) -> Response:
    return _json(wire.error_body(message, "invalid_request_error", param, status), status)
