"""The simulator's /v1/messages shapes, and what kvgate forwards there, checked against vLLM 0.33's own models.

vLLM lives in its own venv (it pins its own torch and fastapi); a short script
run in the session's vLLM interpreter (tests/support/vllm_env.py) validates the JSON collected here with the pydantic
classes of ``vllm.entrypoints.anthropic.protocol``, and round-trips it the way
vLLM serialises (``exclude_none`` for bodies, ``exclude_unset`` for stream
events), so an extra, missing or misspelt field fails. Skipped, saying why,
where that venv is missing.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import orjson

from gateway.errors import BadRequest, NoReplica
from gateway.apis.messages.shape import ANTHROPIC_SHAPE
from tests.support.servers import ServerThread
from tests.support.stack import MODEL, sim_config
from tests.support.vllm_env import VllmWorker
from vllm_sim.server import build_app as build_sim

_CHECK = r"""
import json, sys
from vllm.entrypoints.anthropic import protocol as p

data = json.load(sys.stdin)
def same(model, obj, **dump):
    parsed = model.model_validate(obj)
    back = json.loads(parsed.model_dump_json(**dump))
    assert back == obj, (model.__name__, obj, back)
for obj in data["requests"]:
    p.AnthropicMessagesRequest.model_validate(obj)
for obj in data["count_requests"]:
    p.AnthropicCountTokensRequest.model_validate(obj)
for obj in data["responses"]:
    same(p.AnthropicMessagesResponse, obj, exclude_none=True)
for obj in data["events"]:
    same(p.AnthropicStreamEvent, obj, exclude_unset=True)
for obj in data["counts"]:
    same(p.AnthropicCountTokensResponse, obj, exclude_none=True)
for obj in data["errors"]:
    same(p.AnthropicErrorResponse, obj)
for status, kind in data["statuses"]:
    assert p.translate_error_type(status) == kind, (status, kind, p.translate_error_type(status))
print("ok")
"""

EPHEMERAL = {"type": "ephemeral"}
REQUEST: dict[str, Any] = {
    "model": MODEL, "max_tokens": 16, "cache_salt": "Tj3c1m9_Qy-0aZ8kV1bX2w",
    "system": [{"type": "text", "text": "You are a coding agent.", "cache_control": EPHEMERAL}],
    "tools": [{"name": "read_file", "description": "read a file", "input_schema": {"type": "object"},
               "cache_control": EPHEMERAL}],
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Fix main.py", "cache_control": EPHEMERAL}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "read_file", "input": {"p": "x"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "print(1)"}]},
    ],
}


def _events(raw: str) -> list[dict[str, Any]]:
    out = []
    for block in raw.strip().split("\n\n"):
        event, data = block.split("\n", 1)
        obj = orjson.loads(data.removeprefix("data: "))
        assert event == f"event: {obj['type']}"
        out.append(obj)
    return out


def test_simulator_shapes_are_vllms(vllm_worker: VllmWorker) -> None:
    sim = ServerThread(build_sim(sim_config("r1"))).start()
    try:
        with httpx.Client(base_url=sim.url, timeout=10) as http:
            responses = [http.post("/v1/messages", json=REQUEST).json() for _ in range(2)]
            assert responses[1]["usage"]["cache_read_input_tokens"] > 0
            events = _events(http.post("/v1/messages", json={**REQUEST, "stream": True}).text)
            count_request = {k: REQUEST[k] for k in ("model", "system", "tools", "messages")}
            counts = [http.post("/v1/messages/count_tokens", json=count_request).json()]
            not_found = http.post("/v1/messages", json={**REQUEST, "model": "nope"})
            too_long = http.post("/v1/messages", json={**REQUEST, "max_tokens": 100_000})
        assert not_found.status_code == 404 and too_long.status_code == 400
        errors = [not_found.json(), too_long.json(),
                  ANTHROPIC_SHAPE.body(BadRequest("x", param="max_tokens")), ANTHROPIC_SHAPE.body(NoReplica("y"))]
        data = {"requests": [REQUEST, {**REQUEST, "stream": True}], "count_requests": [count_request],
                "responses": responses, "events": events, "counts": counts, "errors": errors,
                "statuses": [(s, ANTHROPIC_SHAPE.body(_status(s))["error"]["type"])
                             for s in (400, 401, 403, 404, 413, 422, 429, 500, 502, 503, 504)]}
        run = vllm_worker.run(_CHECK, input=json.dumps(data), timeout=300)
        assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]
    finally:
        sim.stop()


def _status(status: int) -> BadRequest:
    err = BadRequest("x")
    err.status = status
    return err
