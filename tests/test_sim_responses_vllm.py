"""The simulator's /v1/responses shapes, checked against vLLM's own pydantic protocol models.

The JSON is collected here (a real sim on a real port, requests as the gateway
sends them) and validated by a short script run in the session's vLLM
interpreter (tests/support/vllm_env.py). Without vLLM the test skips and says
so. Beyond validation (vLLM's models accept extra fields), the sim must not
emit a key vLLM's models do not have.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx

from tests.support.servers import ServerThread
from tests.support.stack import MODEL, sim_config
from tests.support.vllm_env import VllmWorker
from vllm_sim.server import build_app as build_sim

_CHECK = r"""
import json, sys, typing
from vllm.entrypoints.openai.responses.protocol import ResponsesRequest, ResponsesResponse, StreamingResponsesResponse
data = json.load(open(sys.argv[1]))
problems = []
for body in data["requests"]:
    ResponsesRequest.model_validate(body)
for obj in data["responses"]:
    ResponsesResponse.model_validate(obj)
    extra = set(obj) - set(ResponsesResponse.model_fields)
    if extra:
        problems.append(f"response keys vLLM does not have: {sorted(extra)}")
# Each event against the union member its type names (a clearer error than the whole union's).
# vLLM's union lists the events it defines or overrides; the text events it streams are the
# openai package's own (vllm/entrypoints/openai/responses/streaming_events.py), which fill in.
from openai.types.responses import ResponseStreamEvent
by_type = {}
openai_events = typing.get_args(typing.get_args(ResponseStreamEvent)[0])
for cls in [*openai_events, *typing.get_args(StreamingResponsesResponse)]:
    for kind in typing.get_args(cls.model_fields["type"].annotation):
        by_type[kind] = cls
for ev in data["events"]:
    cls = by_type.get(ev["type"])
    if cls is None:
        problems.append(f"{ev['type']}: not an event type vLLM streams")
        continue
    cls.model_validate(ev)
    extra = set(ev) - set(cls.model_fields)
    if extra:
        problems.append(f"{ev['type']}: keys vLLM does not have: {sorted(extra)}")
print("\n".join(problems) or "ok")
sys.exit(1 if problems else 0)
"""


def _events(raw: str) -> list[dict[str, Any]]:
    out = []
    for block in raw.split("\n\n"):
        lines = block.splitlines()
        data = [ln[6:] for ln in lines if ln.startswith("data: ")]
        names = [ln[7:] for ln in lines if ln.startswith("event: ")]
        if data:
            obj = json.loads("\n".join(data))
            assert names == [obj["type"]], "each event is named by its type"
            out.append(obj)
    return out


def test_sim_responses_match_vllm_models(tmp_path: Path, vllm_worker: VllmWorker) -> None:
    sim = ServerThread(build_sim(sim_config("r1"))).start()
    try:
        url = sim.url + "/v1/responses"
        tools = [{"type": "function", "name": "read_file", "parameters": {"type": "object", "properties": {}}}]
        requests = [
            {"model": MODEL, "input": "hello", "instructions": "be terse", "cache_salt": "s1", "tools": tools},
            {"model": MODEL, "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
             "max_output_tokens": 4},
        ]
        responses = [httpx.post(url, json=body, timeout=10).json() for body in requests]
        follow = {"model": MODEL, "input": "more", "previous_response_id": responses[0]["id"]}
        requests.append(follow)
        responses.append(httpx.post(url, json=follow, timeout=10).json())
        responses.append(httpx.get(f"{url}/{responses[0]['id']}", timeout=10).json())
        bg = {"model": MODEL, "input": "job", "background": True, "max_output_tokens": 3}
        requests.append(bg)
        responses.append(httpx.post(url, json=bg, timeout=10).json())
        stream = {"model": MODEL, "input": "stream", "stream": True, "max_output_tokens": 5}
        requests.append(stream)
        events = _events(httpx.post(url, json=stream, timeout=10).text)
        events += _events(httpx.post(url, json={**stream, "max_output_tokens": None}, timeout=10).text)
    finally:
        sim.stop()
    assert events[-1]["type"] == "response.completed" and events[-1]["response"]["status"] == "completed"
    assert responses[1]["status"] == "incomplete"
    path = tmp_path / "shapes.json"
    path.write_text(json.dumps({"requests": requests, "responses": responses, "events": events}))
    done = vllm_worker.run(_CHECK, str(path))
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
