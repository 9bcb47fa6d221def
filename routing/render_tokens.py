"""Token ids from a vLLM render server (``vllm launch render MODEL_DIR``).

For models whose preprocessing kvgate does not reproduce in process (a custom
tokenizer class, a multimodal processor, a Mistral tokenizer), vLLM's own
GPU-less rendering server answers with the exact ids it would prefill. It
costs a loopback round trip per request (bench/tokenization.py) and a process of
about 1 GB, so it is the second choice after ``HFTokenSource``.

Any failure (refused, slow, a 4xx for a request vLLM would reject, garbage)
answers None: that request routes approximately and the client never sees
the error. After a connection failure or a timeout the source stays quiet for
``backoff_s`` so a dead render server does not add its timeout to every
request.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import httpx
import orjson

__all__ = ["RenderTokenSource", "RENDER_PATHS"]

log = logging.getLogger("kvgate.routing")

RENDER_PATHS = {
    "chat": "/v1/chat/completions/render",
    "completions": "/v1/completions/render",
    "messages": "/v1/messages/render",
    "responses": "/v1/responses/render",
}


class RenderTokenSource:
    def __init__(self, render_url: str, *, timeout_s: float = 0.5, backoff_s: float = 5.0,
                 transport: httpx.AsyncBaseTransport | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.render_url = render_url.rstrip("/")
        self.backoff_s = backoff_s
        self._clock = clock
        self._quiet_until = 0.0
        # One client for every request: its connection pool keeps the loopback
        # connections open, so a render costs one round trip, not a handshake too.
        self._client = httpx.AsyncClient(
            base_url=self.render_url, transport=transport,
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 0.25)),
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=16))
        self.requests = 0
        self.failures = 0

    @property
    def healthy(self) -> bool:
        return self._clock() >= self._quiet_until

    async def prompt_ids(self, endpoint: str, body: dict[str, Any]) -> list[int] | None:
        path = RENDER_PATHS.get(endpoint)
        if path is None or not self.healthy:
            return None
        if endpoint == "responses" and body.get("previous_response_id") is not None:
            # The earlier turns live on the replica that stored them; the render server
            # is stateless and refuses these (400), so asking would only cost a round trip.
            return None
        self.requests += 1
        try:
            response = await self._client.post(path, content=orjson.dumps(body),
                                               headers={"content-type": "application/json"})
        except (httpx.TransportError, httpx.TimeoutException) as err:
            self.failures += 1
            self._quiet_until = self._clock() + self.backoff_s
            log.warning("render server %s unreachable (%s); routing approximately for %.0f s",
                        self.render_url, type(err).__name__, self.backoff_s)
            return None
        if response.status_code != 200:
            # A request vLLM rejects (it will reject it at the replica too) or a model
            # the render server does not serve: this request only.
            self.failures += 1
            return None
        try:
            data = orjson.loads(response.content)
            if isinstance(data, list):  # completions: one entry per prompt; the batch routes on the first
                data = data[0]
            ids = data["token_ids"]
        except (orjson.JSONDecodeError, LookupError, TypeError):
            self.failures += 1
            return None
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            self.failures += 1
            return None
        return ids

    def stats(self) -> dict[str, Any]:
        return {"url": self.render_url, "requests": self.requests, "failures": self.failures,
                "healthy": self.healthy}

    async def aclose(self) -> None:
        await self._client.aclose()
