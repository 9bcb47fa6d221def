"""The simulator's HTTP app: vLLM's OpenAI-compatible endpoints plus a ``/sim/*`` control plane.

``build_app(config)`` returns a fresh Starlette app owning one ``Replica``; call
it twice for two independent replicas. The engine's step task starts lazily
on the first request, so the app also works without lifespan events (e.g.
under ``httpx.ASGITransport``); the lifespan only stops it cleanly.

Endpoints: ``GET /health`` (503 with the ``unhealthy`` fault), ``GET /version``,
``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions``,
``POST /v1/embeddings``, ``POST /v1/responses`` with ``GET /v1/responses/{id}`` and
``POST /v1/responses/{id}/cancel`` (``vllm_sim.responses``), ``POST /v1/messages`` and
``/v1/messages/count_tokens`` (Anthropic's Messages API, ``vllm_sim.messages``), ``GET /metrics``, the utility,
pooling, render and audio routes of ``vllm_sim.utility_http`` (``/tokenize``, ``/rerank``,
``/v1/chat/completions/render``, ``/v1/audio/transcriptions``, ...);
control plane: ``GET|POST /sim/faults`` (POST replaces the whole fault set, ``{}`` clears it), ``GET /sim/stats``,
``POST /sim/reset`` (drops cached blocks and counters); P/D side channel: ``POST /sim/nixl/read``
(``vllm_sim.pd``: a decode replica pulls the blocks a prefill holds for it).
"""

from __future__ import annotations

import time
import uuid
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import orjson
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from vllm_sim.asgi import Receive, Send
from vllm_sim.config import SimConfig
from vllm_sim.embeddings import embeddings_response
from vllm_sim.faults import Faults, fault_reply
from vllm_sim.handlers import GenerationEndpoint
from vllm_sim.messages import CountTokensEndpoint, MessagesEndpoint
from vllm_sim.metrics import CONTENT_TYPE, render_metrics
from vllm_sim.protocol import parse_generation, parse_json, prompt_tokens
from vllm_sim.replica import Replica
from vllm_sim.responses import ResponsesApi
from vllm_sim.utility_http import utility_routes
from vllm_sim.wire import ApiError, error_body

__all__ = ["build_app"]


def _json(payload: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(payload), status, headers, media_type="application/json")


class ReplicaHeader:
    """Pure ASGI middleware adding ``x-sim-replica: <name>`` to every response (SSE included)."""

    def __init__(self, app: Any, name: str) -> None:
        self.app = app
        self.header = (b"x-sim-replica", name.encode())

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: Any) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), self.header]
            await send(message)

        await self.app(scope, receive, send_with_header)


def _routes(replica: Replica) -> list[Route]:
    config = replica.config

    async def health(request: Request) -> Response:
        return Response(status_code=503 if replica.faults.unhealthy else 200)

    async def models(request: Request) -> Response:
        created = int(time.time())
        data = []
        for m in config.models:
            lora = config.lora(m)
            # vLLM lists an adapter with its path as root and the base model as parent.
            data.append({"id": m, "object": "model", "created": created, "owned_by": "vllm",
                         "root": lora[1] if lora else m, "parent": config.model if lora else None,
                         "max_model_len": config.max_model_len})
        return _json({"object": "list", "data": data})

    async def embeddings(request: Request) -> Response:
        faults, verdict = replica.roll_faults()
        if verdict is not None:
            status, headers, content = fault_reply(verdict, faults)
            return Response(content, status, {k.decode(): v.decode() for k, v in headers})
        try:
            payload = parse_json(await request.body())
            rid = "embd-" + uuid.uuid4().hex
            return _json(embeddings_response(payload, config, rid, int(time.time())))
        except ApiError as exc:
            return _json(exc.body(), exc.status)

    async def metrics(request: Request) -> Response:
        text = render_metrics(config, replica.engine, replica.pd)
        return Response(text, headers={"content-type": CONTENT_TYPE.decode()})

    async def get_faults(request: Request) -> Response:
        return _json(replica.faults.as_dict())

    async def set_faults(request: Request) -> Response:
        # Replace, not merge: what you POST is exactly the fault set in force ({} clears all).
        try:
            replica.faults = Faults.from_json(orjson.loads(await request.body() or b"{}"))
        except (ValueError, TypeError) as exc:
            return _json(error_body(str(exc), "BadRequestError", None, 400), 400)
        return _json(replica.faults.as_dict())

    async def stats(request: Request) -> Response:
        return _json(replica.stats())

    async def reset(request: Request) -> Response:
        replica.reset()
        return _json(replica.stats())

    async def tokenize(request: Request) -> Response:
        # vLLM's /tokenize: {"prompt": ...} or {"messages": ...}; the ids a generation
        # request with the same fields would prefill.
        try:
            payload = parse_json(await request.body())
            params = parse_generation("chat" if "messages" in payload else "completions", payload, config)
            tokens = await prompt_tokens(params, replica.prompts)
        except ApiError as exc:
            return _json(exc.body(), exc.status)
        return _json({"count": len(tokens), "max_model_len": config.max_model_len, "tokens": tokens,
                      "token_strs": None})

    async def nixl_read(request: Request) -> Response:
        # P/D side channel (vllm_sim.pd): a decode replica reads, or releases, held blocks.
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError:
            body = None
        status, payload = replica.pd.read(body)
        return _json(payload, status)

    async def version(request: Request) -> Response:
        return _json({"version": "vllm_sim"})

    responses = ResponsesApi(replica)

    return [
        Route("/health", health, methods=["GET"]),
        Route("/version", version, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/chat/completions", GenerationEndpoint(replica, "chat"), methods=["POST"]),
        Route("/v1/completions", GenerationEndpoint(replica, "completions"), methods=["POST"]),
        Route("/v1/embeddings", embeddings, methods=["POST"]),
        Route("/v1/messages", MessagesEndpoint(replica), methods=["POST"]),
        Route("/v1/messages/count_tokens", CountTokensEndpoint(replica), methods=["POST"]),
        # With a real tokenizer, vLLM's /tokenize answers with its ids (ahead of the
        # utility routes' stand-in /tokenize, which serves otherwise).
        *([Route("/tokenize", tokenize, methods=["POST"])] if replica.prompts is not None else []),
        Route("/v1/responses", responses, methods=["POST"]),
        Route("/v1/responses/{response_id}", responses.retrieve, methods=["GET"]),
        Route("/v1/responses/{response_id}/cancel", responses.cancel, methods=["POST"]),
        *utility_routes(replica),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/sim/faults", get_faults, methods=["GET"]),
        Route("/sim/faults", set_faults, methods=["POST"]),
        Route("/sim/stats", stats, methods=["GET"]),
        Route("/sim/reset", reset, methods=["POST"]),
        Route("/sim/nixl/read", nixl_read, methods=["POST"]),
    ]


def build_app(config: SimConfig | None = None) -> Starlette:
    """A new simulated replica. ``app.state.replica`` exposes its engine, pool and faults to tests."""
    replica = Replica(config or SimConfig())

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await replica.engine.aclose()
        await replica.pd.aclose()
        replica.close()

    app = Starlette(
        routes=_routes(replica),
        middleware=[Middleware(ReplicaHeader, name=replica.config.name)],
        lifespan=lifespan,
    )
    app.state.replica = replica
    return app
