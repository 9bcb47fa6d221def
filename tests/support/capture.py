"""A replica at the outside edge that records what kvgate sends it and can hold requests.

For the tests that must see the exact bytes a replica received (which ``priority``
reached it) or must keep a replica's slot busy for as long as they choose (the
fair queue's order, deadline, disconnects and shutdown): a request whose prompt
contains ``HOLD`` is answered only after ``POST /release`` (a streamed chat request
sends all its tokens but the last first, one chunk each). A streamed chat request
whose prompt holds a word ``FIRST:<name>`` sends its first chunk only after
``POST /release?name=<name>``: a prompt the replica is still prefilling. ``metrics``
is what ``/metrics`` answers (vLLM's gauges, as a test sets them). It answers chat,
completions and Anthropic messages with fixed, well-formed bodies; with
``refuse_priority`` it refuses a non-zero ``priority`` with a 400, as vLLM does
under its default ``--scheduling-policy fcfs``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

__all__ = ["Capture", "Received"]


@dataclass(frozen=True, slots=True)
class Received:
    path: str
    raw: bytes
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def body(self) -> dict[str, Any]:
        return orjson.loads(self.raw)  # type: ignore[no-any-return]

    @property
    def text(self) -> str:
        """The prompt's text: the last message's content, or the completion prompt."""
        body = self.body
        if "messages" in body:
            content = body["messages"][-1]["content"]
            return content if isinstance(content, str) else str(content)
        return str(body.get("prompt", ""))


@dataclass
class Capture:
    model: str
    refuse_priority: bool = False
    received: list[Received] = field(default_factory=list)
    metrics: str = ""
    _releases: dict[str, asyncio.Event] = field(default_factory=dict)

    def app(self) -> Starlette:
        async def generate(request: Request) -> Response:
            got = Received(request.url.path, await request.body(), dict(request.headers))
            self.received.append(got)
            if self.refuse_priority and got.body.get("priority"):
                return Response(orjson.dumps({"error": {
                    "message": "Priority scheduling is not enabled.", "type": "BadRequestError", "param": None,
                    "code": 400}}), status_code=400, media_type="application/json")
            if got.path == "/v1/chat/completions" and got.body.get("stream"):
                return StreamingResponse(self._stream(got), media_type="text/event-stream")
            if "HOLD" in got.text:
                await self._held()
            return Response(orjson.dumps(self._answer(got.path)), media_type="application/json")

        async def release(request: Request) -> Response:
            self._releases.setdefault(request.query_params.get("name", "hold"), asyncio.Event()).set()
            return Response()

        async def metrics(request: Request) -> Response:
            return Response(self.metrics, media_type="text/plain")

        async def models(request: Request) -> Response:
            return Response(orjson.dumps({"object": "list", "data": [{"id": self.model, "object": "model"}]}),
                            media_type="application/json")

        async def ok(request: Request) -> Response:
            return Response()

        return Starlette(routes=[
            Route("/v1/chat/completions", generate, methods=["POST"]),
            Route("/v1/completions", generate, methods=["POST"]),
            Route("/v1/messages", generate, methods=["POST"]),
            Route("/release", release, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", ok, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ])

    async def _held(self, name: str = "hold") -> None:
        await self._releases.setdefault(name, asyncio.Event()).wait()

    async def _stream(self, got: Received) -> Any:
        """``max_tokens`` chunks of one token each (3 without it), then usage and [DONE]."""
        n = got.body.get("max_tokens") or 3
        for word in got.text.split():
            if word.startswith("FIRST:"):
                await self._held(word.removeprefix("FIRST:"))
        for i in range(n):
            if i == n - 1 and "HOLD" in got.text:
                await self._held()
            last = i == n - 1
            yield b"data: " + orjson.dumps({
                "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": self.model,
                "choices": [{"index": 0, "delta": {"content": "t"}, "finish_reason": "length" if last else None}],
            }) + b"\n\n"
        usage = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n}
        yield b"data: " + orjson.dumps({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0,
                                        "model": self.model, "choices": [], "usage": usage}) + b"\n\n"
        yield b"data: [DONE]\n\n"

    @staticmethod
    def release_at(url: str, name: str = "hold") -> None:
        httpx.post(url + "/release", params={"name": name}, timeout=5).raise_for_status()

    def _answer(self, path: str) -> dict[str, Any]:
        usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
        if path == "/v1/messages":
            return {"id": "msg_1", "type": "message", "role": "assistant", "model": self.model,
                    "content": [{"type": "text", "text": "ok"}], "stop_reason": "end_turn", "stop_sequence": None,
                    "usage": {"input_tokens": 3, "output_tokens": 1}}
        if path == "/v1/completions":
            return {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": self.model,
                    "choices": [{"index": 0, "text": "ok", "finish_reason": "stop", "logprobs": None}], "usage": usage}
        return {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": self.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                "usage": usage}
