"""The simulator's render routes (``/v1/chat/completions/render``, ``/v1/completions/render``).

Routers that tokenize through a worker (vLLM's own ``vllm-router``) hash the
ids these routes return, so they must be the ids a generation request
prefills. With vLLM installed the whole response is compared with vLLM
0.33's own render server on the same tokenizer directory, and validated by
vLLM's ``GenerateRequest`` model; without it those tests skip, saying why.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.vllm_env import RenderServer, VllmWorker
from vllm_sim.config import SimConfig
from vllm_sim.server import build_app

MODEL = "sim-model"
CHAT = {"messages": [{"role": "system", "content": "You route requests. " * 20},
                     {"role": "user", "content": "Which replica?"}]}


def _run(app: Any, *calls: tuple[str, dict[str, Any], dict[str, str]]) -> list[httpx.Response]:
    async def go() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://sim") as client:
            return [await client.post(path, json=body, headers=headers) for path, body, headers in calls]
    return asyncio.run(go())


def test_rendered_ids_are_the_ids_generation_prefills_and_tokenize_returns() -> None:
    app = build_app(SimConfig(model=MODEL))
    chat = {"model": MODEL, **CHAT}
    completion = {"model": MODEL, "prompt": "Once upon a time " * 30}
    rc, rp, gc, gp, tc = _run(app, ("/v1/chat/completions/render", chat, {}),
                              ("/v1/completions/render", completion, {}),
                              ("/v1/chat/completions", {**chat, "max_tokens": 2}, {}),
                              ("/v1/completions", {**completion, "max_tokens": 2}, {}),
                              ("/tokenize", chat, {}))
    assert all(r.status_code == 200 for r in (rc, rp, gc, gp, tc))
    chat_ids, [completion_render] = rc.json()["token_ids"], rp.json()
    assert chat_ids == tc.json()["tokens"]
    assert len(chat_ids) == gc.json()["usage"]["prompt_tokens"] > 100
    assert len(completion_render["token_ids"]) == gp.json()["usage"]["prompt_tokens"] > 50
    # The render does not run the engine: no request reached its pool.
    [s] = _run_get(app, "/sim/stats")
    assert s.json()["engine_requests"] == 2 and s.json()["renders"] == 2


def _run_get(app: Any, path: str) -> list[httpx.Response]:
    async def go() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://sim") as client:
            return [await client.get(path)]
    return asyncio.run(go())


def test_render_carries_vllms_request_id_stream_and_max_tokens_rules() -> None:
    config = SimConfig(model=MODEL, max_model_len=4096)
    app = build_app(config)
    streamed = {"model": MODEL, **CHAT, "stream": True, "stream_options": {"include_usage": True},
                "max_tokens": 7, "temperature": 0, "stop": "END", "n": 2}
    plain, stream, many = _run(app, ("/v1/chat/completions/render", {"model": MODEL, **CHAT}, {}),
                               ("/v1/chat/completions/render", streamed, {"x-request-id": "req-1"}),
                               ("/v1/completions/render", {"model": MODEL, "prompt": ["a b", "c d e"]}, {}))
    p, s = plain.json(), stream.json()
    assert p["request_id"].startswith("chatcmpl-") and s["request_id"] == "chatcmpl-req-1"
    # Chat without max_tokens: the room left in the context; non-streamed: FINAL_ONLY (2).
    assert p["sampling_params"]["max_tokens"] == 4096 - len(p["token_ids"])
    assert p["sampling_params"]["output_kind"] == 2 and p["stream"] is False and p["stream_options"] is None
    assert s["sampling_params"] == {"n": 2, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                                    "repetition_penalty": 1.0, "temperature": 0.0, "stop": ["END"],
                                    "stop_token_ids": [], "max_tokens": 7, "output_kind": 1, "skip_clone": True,
                                    "bad_words": [], "skip_reading_prefix_cache": False}
    assert s["stream_options"] == {"include_usage": True, "continuous_usage_stats": False}
    # Two prompts, two entries, ids suffixed; completions keep SamplingParams' default 16 (omitted).
    entries = many.json()
    assert [e["request_id"][-2:] for e in entries] == ["-0", "-1"]
    assert len(entries[1]["token_ids"]) > len(entries[0]["token_ids"])
    assert all("max_tokens" not in e["sampling_params"] and e["parse_context"] is None for e in entries)


@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/chat/completions/render", {"model": "nope", **CHAT}, 404, "model"),
    ("/v1/chat/completions/render", {"model": MODEL, "messages": []}, 400, "messages"),
    ("/v1/chat/completions/render", {"model": MODEL, **CHAT, "max_tokens": 5000}, 400, "max_tokens"),
    ("/v1/completions/render", {"model": MODEL, "prompt": "word " * 5000}, 400, "input_tokens"),
    ("/v1/completions/render", {"model": MODEL, "prompt": {"not": "a prompt"}}, 400, "prompt"),
    ("/v1/chat/completions/render", {"model": MODEL, **CHAT, "stop_token_ids": 5}, 400, "stop_token_ids"),
    ("/v1/chat/completions/render", {"model": MODEL, **CHAT, "temperature": "hot"}, 400, "temperature"),
])
def test_bad_render_requests_get_vllms_error_shape(path: str, body: dict[str, Any], status: int, param: str) -> None:
    [r] = _run(build_app(SimConfig(model=MODEL, max_model_len=4096)), (path, body, {}))
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == status and error["param"] == param and error["message"]


TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}
TOOL_TURN = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]}
TOOL_CHAT = {"messages": [*CHAT["messages"], TOOL_TURN, {"role": "tool", "tool_call_id": "call_1", "content": "r2"}],
             "tools": [TOOL]}


def test_chat_render_keeps_what_a_generate_server_needs_to_parse_the_output() -> None:
    tool, body = TOOL, {"model": MODEL, **TOOL_CHAT}
    [r] = _run(build_app(SimConfig(model=MODEL)), ("/v1/chat/completions/render", body, {}))
    assert r.status_code == 200, r.text
    context = r.json()["parse_context"]
    assert context["tools"] == [{"type": "function", "function": {"name": "lookup", "description": None,
                                                                  "parameters": tool["function"]["parameters"]}}]
    assert context["tool_choice"] == "auto" and context["history_tool_call_cnt"] == 1
    assert context["chat_template_kwargs"]["add_generation_prompt"] is True


def test_render_obeys_the_whole_response_faults() -> None:
    app = build_app(SimConfig(model=MODEL))
    [set_faults] = _run(app, ("/sim/faults", {"error_rate": 1.0}, {}))
    assert set_faults.status_code == 200
    [r] = _run(app, ("/v1/chat/completions/render", {"model": MODEL, **CHAT}, {}))
    assert r.status_code >= 500


# ---- against vLLM 0.33 itself -------------------------------------------------------------------------------

PARITY_MODEL = "parity-model"
# Bodies compared whole with vLLM's render server (tools are left out: vLLM's tool parser sets fields the
# simulator, which has none, does not).
PARITY: list[tuple[str, dict[str, Any]]] = [
    ("/v1/chat/completions/render", CHAT),
    ("/v1/chat/completions/render", {**CHAT, "max_tokens": 4, "temperature": 0.5, "top_p": 0.9, "seed": 3,
                                     "stop": ["x"], "n": 2, "stream": True, "cache_salt": "tenant-a",
                                     "stream_options": {"include_usage": True}}),
    ("/v1/chat/completions/render", {**CHAT, "temperature": 0, "max_completion_tokens": 16}),
    # The body vllm-router sends: vLLM's request fields with their defaults spelled out.
    ("/v1/chat/completions/render", {**CHAT, "stream": False, "max_tokens": 4, "logprobs": False,
                                     "ignore_eos": False, "continue_final_message": False,
                                     "skip_special_tokens": True}),
    ("/v1/completions/render", {"prompt": "Once upon a time " * 10}),
    ("/v1/completions/render", {"prompt": "hello there", "max_tokens": 4, "stream": True, "temperature": 0}),
    ("/v1/completions/render", {"prompt": [101, 7592, 2088]}),
    ("/v1/completions/render", {"prompt": ["one prompt", "and another"]}),
    ("/v1/completions/render", {"prompt": "hi " * 40000}),
    ("/v1/chat/completions/render", {**CHAT, "max_tokens": 40000}),
]


@pytest.fixture
def tokdir(vllm_tokdir: Path) -> Path:
    return vllm_tokdir


@pytest.fixture
def vllm_server(vllm_render: RenderServer) -> RenderServer:
    assert vllm_render.model == PARITY_MODEL
    return vllm_render


def _pairs(tokdir: Path, server: RenderServer) -> list[tuple[Any, Any, int, int]]:
    app = build_app(SimConfig(name="sim-render", model=PARITY_MODEL, tokenizer=str(tokdir), max_model_len=32768))
    ours = _run(app, *((path, {"model": PARITY_MODEL, **body}, {}) for path, body in PARITY))
    theirs = [httpx.post(server.url + path, json={"model": PARITY_MODEL, **body}, timeout=60) for path, body in PARITY]
    return [(a.json(), b.json(), a.status_code, b.status_code) for a, b in zip(ours, theirs)]


def _without_ids(obj: Any) -> Any:
    entries = obj if isinstance(obj, list) else [obj]
    return [{k: v for k, v in e.items() if k != "request_id"} for e in entries]


@pytest.mark.timeout(300)
def test_render_responses_equal_vllms_own_render_server(tokdir: Path, vllm_server: RenderServer) -> None:
    for (path, body), (ours, theirs, status, vllm_status) in zip(PARITY, _pairs(tokdir, vllm_server)):
        assert status == vllm_status, (path, body, ours, theirs)
        if status == 200:
            assert _without_ids(ours) == _without_ids(theirs), (path, body)
        else:
            assert ours["error"]["param"] == theirs["error"]["param"], (ours, theirs)
            assert ours["error"]["message"] == theirs["error"]["message"]


_CHECK = r"""
import json, sys
from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest
failures = []
for obj in json.load(open(sys.argv[1])):
    for entry in obj if isinstance(obj, list) else [obj]:
        try:
            GenerateRequest.model_validate(entry)
        except Exception as exc:
            failures.append(str(exc))
        extra = sorted(set(entry) - set(GenerateRequest.model_fields))
        if extra:
            failures.append(f"fields vLLM does not send: {extra}")
print(json.dumps(failures))
"""


@pytest.mark.timeout(300)
def test_render_responses_validate_as_vllms_generate_request(tmp_path: Path, vllm_worker: VllmWorker) -> None:
    app = build_app(SimConfig(model=MODEL))
    cases = [*PARITY[:8], ("/v1/chat/completions/render", TOOL_CHAT)]
    bodies = [(path, {"model": MODEL, **body}, {}) for path, body in cases]
    responses = _run(app, *bodies)
    assert all(r.status_code == 200 for r in responses)
    data = tmp_path / "render.json"
    data.write_text(json.dumps([r.json() for r in responses]))
    out = vllm_worker.run(_CHECK, str(data), timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
