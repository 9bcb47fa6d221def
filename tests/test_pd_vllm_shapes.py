"""The P/D legs kvgate sends (gateway.proxy.disagg), checked against vLLM 0.33's own code.

* the prefill leg of each API (chat, completions, Responses, Messages), built by its
  ``LegShape`` from a client's body, is validated by vLLM's request model, declares no
  field vLLM lacks, and gives the sampling parameters a prefill replica needs: one
  output token, ``kv_transfer_params`` asking for a remote decode in ``extra_args``
  (where the NixlConnector reads them);
* the response models of the four routes carry ``kv_transfer_params`` at the top
  level, where kvgate reads them;
* the decode leg: the params dict vLLM's NixlConnector returns (its keys read from
  ``NixlConnectorScheduler.request_finished``'s source), spliced into the client's
  body by ``with_params``, validates and reaches ``extra_args`` unchanged, with
  ``do_remote_prefill`` set, the flag its ``get_num_new_matched_tokens`` pulls on.

Runs in the session's vLLM interpreter (tests/support/vllm_env.py); skips, saying why, without vLLM.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway.apis.messages.endpoint import MESSAGES_LEG
from gateway.apis.responses.endpoint import RESPONSES_LEG
from gateway.proxy.disagg import CHAT_LEG, COMPLETIONS_LEG, REMOTE_DECODE, LegShape, with_params
from tests.support.vllm_env import VllmWorker

SALT = "tenant-salt-0123456789"
_CHAT = "vllm.entrypoints.openai.chat_completion.protocol"
_CMPL = "vllm.entrypoints.openai.completion.protocol"
_RESP = "vllm.entrypoints.openai.responses.protocol"
_ANTH = "vllm.entrypoints.anthropic.protocol"

# (the client's body as kvgate forwards it: salted, usage on for streams; the leg; vLLM's request model)
CASES: list[tuple[dict[str, Any], LegShape, str]] = [
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 200,
      "stream_options": {"include_usage": True}, "min_tokens": 5, "cache_salt": SALT}, CHAT_LEG,
     f"{_CHAT}:ChatCompletionRequest"),
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 50,
      "cache_salt": SALT}, CHAT_LEG, f"{_CHAT}:ChatCompletionRequest"),
    ({"model": "m", "prompt": "Once upon", "stream": True, "max_tokens": 64, "min_tokens": 2,
      "stream_options": {"include_usage": True}, "cache_salt": SALT}, COMPLETIONS_LEG,
     f"{_CMPL}:CompletionRequest"),
    ({"model": "m", "input": "hi", "stream": True, "max_output_tokens": 80, "cache_salt": SALT}, RESPONSES_LEG,
     f"{_RESP}:ResponsesRequest"),
    # A thinking budget above the leg's one token: vLLM skips that check on a do_remote_decode leg.
    ({"model": "m", "max_tokens": 4096, "stream": True, "messages": [{"role": "user", "content": "hi"}],
      "thinking": {"type": "enabled", "budget_tokens": 1024}, "cache_salt": SALT}, MESSAGES_LEG,
     f"{_ANTH}:AnthropicMessagesRequest"),
]
RESPONSE_MODELS = [f"{_CHAT}:ChatCompletionResponse", f"{_CHAT}:ChatCompletionStreamResponse",
                   f"{_CMPL}:CompletionResponse", f"{_CMPL}:CompletionStreamResponse", f"{_RESP}:ResponsesResponse",
                   f"{_ANTH}:AnthropicMessagesResponse"]

_CHECK = r"""
import ast, importlib, inspect, json, sys
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import pull_scheduler

def load(ref):
    module, name = ref.split(":")
    return getattr(importlib.import_module(module), name)

def declared(cls):
    return set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}

def sampling(req):
    fn = getattr(req, "to_sampling_params", None)
    if fn is None:
        return None
    sp = fn(4096, {})
    return {"max_tokens": sp.max_tokens, "kv": (sp.extra_args or {}).get("kv_transfer_params")}

data = json.load(open(sys.argv[1]))
out = {"prefill": [], "decode": [], "responses": {}}
for ref, leg in data["prefill"]:
    cls = load(ref)
    try:
        req = cls.model_validate(leg)
    except Exception as exc:
        out["prefill"].append({"ref": ref, "error": str(exc)[:2000]})
        continue
    out["prefill"].append({"ref": ref, "extra": sorted(set(leg) - declared(cls)), "kv": req.kv_transfer_params,
                           "stream": bool(req.stream), "salt": req.cache_salt, "sampling": sampling(req)})
for ref in data["responses"]:
    out["responses"][ref] = "kv_transfer_params" in load(ref).model_fields
# The keys of the params dict the connector returns from request_finished (the prefill side's answer).
src = inspect.getsource(pull_scheduler)
keys = None
for node in ast.walk(ast.parse(src)):
    if isinstance(node, ast.FunctionDef) and node.name == "request_finished":
        for call in ast.walk(node):
            if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "dict" and call.keywords:
                keys = [k.arg for k in call.keywords]
out["keys"] = keys
print(json.dumps(out))
"""

_DECODE = r"""
import importlib, json, sys
data = json.load(open(sys.argv[1]))
out = []
for ref, body in data:
    module, name = ref.split(":")
    req = getattr(importlib.import_module(module), name).model_validate(body)
    fn = getattr(req, "to_sampling_params", None)
    sp = fn(4096, {}) if fn else None
    extra_kv = (sp.extra_args or {}).get("kv_transfer_params") if sp else None
    out.append({"kv": req.kv_transfer_params, "extra_kv": extra_kv, "stream": bool(req.stream)})
print(json.dumps(out))
"""


def _last_json(out: Any) -> Any:
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(300)
def test_pd_legs_match_vllm_protocol_models_and_nixl_connector(tmp_path: Path, vllm_worker: VllmWorker) -> None:
    legs = [(ref, leg.body(body)) for body, leg, ref in CASES]
    path = tmp_path / "legs.json"
    path.write_text(json.dumps({"prefill": legs, "responses": RESPONSE_MODELS}))
    got = _last_json(vllm_worker.run(_CHECK, str(path), timeout=280))

    for (_, _, ref), row in zip(CASES, got["prefill"]):
        assert "error" not in row, row
        assert row["extra"] == [], f"{ref}: fields vLLM does not declare: {row['extra']}"
        assert row["kv"] == dict(REMOTE_DECODE) and row["stream"] is False
        assert row["salt"] == SALT  # the tenant's salt on the prefill leg
        if row["sampling"] is not None:  # chat, completions, responses: one token, the params in extra_args
            assert row["sampling"]["kv"] == dict(REMOTE_DECODE)
            if ref.startswith(_RESP):
                assert row["sampling"]["max_tokens"] == 1
    chat = dict(CASES[0][1].body(CASES[0][0]))
    assert chat["max_tokens"] == chat["max_completion_tokens"] == 1 and "stream_options" not in chat
    assert all(got["responses"].values()), got["responses"]

    # The decode leg: the connector's own keys, values as a prefill replica would send them.
    keys = got["keys"]
    assert keys and {"do_remote_prefill", "remote_engine_id", "remote_block_ids", "remote_host",
                     "remote_port"} <= set(keys)
    sample = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2, 3]],
              "remote_engine_id": "engine-p1", "remote_request_id": "cmpl-1", "remote_host": "10.0.0.5",
              "remote_port": 5600, "tp_size": 1, "remote_num_tokens": 40}
    params = {k: sample.get(k) for k in keys}
    decodes = [(ref, orjson.loads(with_params(orjson.dumps(body), params))) for body, _, ref in CASES]
    path.write_text(json.dumps(decodes))
    rows = _last_json(vllm_worker.run(_DECODE, str(path), timeout=280))
    for (body, _, _), row, (_, sent) in zip(CASES, rows, decodes):
        assert row["kv"] == params and row["kv"]["do_remote_prefill"] is True
        assert row["stream"] == bool(body.get("stream"))  # the client's request, as it asked
        assert sent["cache_salt"] == SALT  # the tenant's salt on the decode leg too
        if row["extra_kv"] is not None:
            assert row["extra_kv"] == params


def test_with_params_splices_without_touching_the_rest() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}
    spliced = orjson.loads(with_params(orjson.dumps(body), {"a": 1}))
    assert spliced == {**body, "kv_transfer_params": {"a": 1}}
    assert orjson.loads(with_params(b"{}", {"a": 1})) == {"kv_transfer_params": {"a": 1}}


def test_only_one_prompt_is_disaggregated() -> None:
    # vLLM's completions answer a batch with the first prompt's params only (final_res_batch[0]).
    assert COMPLETIONS_LEG.applies({"prompt": "one"}) and COMPLETIONS_LEG.applies({"prompt": [1, 2, 3]})
    assert not COMPLETIONS_LEG.applies({"prompt": ["one", "two"]})
    assert not COMPLETIONS_LEG.applies({"prompt": [[1, 2], [3]]})
    assert CHAT_LEG.applies({"messages": []}) and MESSAGES_LEG.applies({}) and RESPONSES_LEG.applies({})
