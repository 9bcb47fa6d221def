"""The simulator's routes for vLLM's utility, pooling and audio APIs (bodies built in ``utility`` / ``audio``).

Like ``/v1/embeddings``, each request first rolls the whole-response faults
(``error_rate``, ``rate_limit_rate``, ``html_200``), so a gateway's error paths can
be tested on these routes too. The tokenizer, render (``render``) and pooling routes
answer at once, without the engine; the audio routes decode their transcript through
the engine (``audio``), so a streamed transcription also obeys ``die_after_tokens`` and ``stall_before_first_token_s``.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable

import orjson
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from vllm_sim import render, utility
from vllm_sim.audio import AudioRequest, StreamFormat, Task, audio_response, audio_tokens, transcript
from vllm_sim.config import SimConfig
from vllm_sim.engine import GenRequest
from vllm_sim.faults import Faults, fault_reply
from vllm_sim.protocol import parse_json, resolve_model
from vllm_sim.replica import Replica
from vllm_sim.wire import DONE, ApiError

__all__ = ["utility_routes"]

Handler = Callable[[Request], Awaitable[Response]]


def _json(payload: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(payload), status, media_type="application/json")


Work = Callable[[Request, Faults], Awaitable[Response]]


def _guarded(replica: Replica, work: Work) -> Handler:
    async def handler(request: Request) -> Response:
        faults, verdict = replica.roll_faults()
        if verdict is not None:
            status, headers, content = fault_reply(verdict, faults)
            return Response(content, status, {k.decode(): v.decode() for k, v in headers})
        try:
            return await work(request, faults)
        except ApiError as exc:
            return _json(exc.body(), exc.status)
    return handler


def _bool_field(value: Any, name: str) -> bool:
    if value is None:
        return False
    text = str(value).strip().lower()
    if text not in ("true", "false", "1", "0"):
        raise ApiError(400, f"{name} must be a boolean.", param=name)
    return text in ("true", "1")


async def _read_audio(request: Request, task: Task, config: SimConfig) -> AudioRequest:
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise ApiError(400, "Expected a multipart/form-data body.")
    async with request.form() as form:
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise ApiError(422, "Field required: file.", param="file")
        model = resolve_model({"model": form.get("model")}, config)
        req = AudioRequest(task, model, await upload.read(), str(form.get("response_format") or "json"),
                           str(form["language"]) if form.get("language") else None,
                           _bool_field(form.get("stream"), "stream"),
                           _bool_field(form.get("stream_include_usage"), "stream_include_usage"))
    req.check()
    return req


def _audio(replica: Replica, task: Task) -> Work:
    engine = replica.engine

    async def work(request: Request, faults: Faults) -> Response:
        req = await _read_audio(request, task, replica.config)
        words = transcript(req.audio)
        gen_req = GenRequest(f"{task}-{uuid.uuid4().hex}", audio_tokens(req.audio), len(words),
                             hold_s=faults.stall_before_first_token_s)
        if not req.stream:
            async with engine.generate(gen_req) as gen:
                async for _ in gen:
                    pass
            return _json(audio_response(req))
        fmt = StreamFormat(req)

        async def events() -> AsyncIterator[bytes]:
            # Leaving this generator early (a client gone: Starlette cancels it) aborts the engine request.
            sent = 0
            async with engine.generate(gen_req) as gen:
                async for _ in gen:
                    if faults.die_after_tokens is not None and sent >= faults.die_after_tokens:
                        return  # the stream ends without [DONE], as a replica dying mid-answer
                    yield fmt.word(words, sent)
                    sent += 1
            if req.include_usage:
                yield fmt.usage(gen.prompt_tokens, sent)
            yield DONE

        return StreamingResponse(events(), media_type="text/event-stream")
    return work


def utility_routes(replica: Replica) -> list[Route]:
    config = replica.config
    vocab = utility.Vocabulary()

    def json_route(build: Callable[[dict[str, Any]], dict[str, Any]]) -> Handler:
        async def work(request: Request, faults: Faults) -> Response:
            return _json(build(parse_json(await request.body())))
        return _guarded(replica, work)

    def rid(prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex}"

    tokenize = json_route(lambda b: utility.tokenize_body(b, config, vocab))
    detokenize = json_route(lambda b: utility.detokenize(b, config, vocab))
    rerank = json_route(lambda b: utility.rerank(b, config, rid("rerank")))
    score = json_route(lambda b: utility.score(b, config, rid("score"), int(time.time())))
    pooling = json_route(lambda b: utility.pooling(b, config, rid("pool"), int(time.time())))
    classify = json_route(lambda b: utility.classify(b, config, rid("classify"), int(time.time())))

    async def render_chat(request: Request, faults: Faults) -> Response:
        body = parse_json(await request.body())
        replica.renders += 1
        return _json(await render.render_chat(body, config, replica.prompts, request.headers.get("x-request-id")))

    async def render_completion(request: Request, faults: Faults) -> Response:
        body = parse_json(await request.body())
        replica.renders += 1
        return _json(await render.render_completion(body, config, replica.prompts,
                                                    request.headers.get("x-request-id")))

    transcribe = _guarded(replica, _audio(replica, "transcribe"))
    translate = _guarded(replica, _audio(replica, "translate"))
    routes = [("/tokenize", tokenize), ("/detokenize", detokenize), ("/rerank", rerank), ("/v1/rerank", rerank),
              ("/v2/rerank", rerank), ("/score", score), ("/v1/score", score), ("/pooling", pooling),
              ("/classify", classify), ("/v1/audio/transcriptions", transcribe),
              ("/v1/audio/translations", translate),
              ("/v1/chat/completions/render", _guarded(replica, render_chat)),
              ("/v1/completions/render", _guarded(replica, render_completion))]
    return [Route(path, handler, methods=["POST"]) for path, handler in routes]
