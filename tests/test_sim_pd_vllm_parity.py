"""The simulator's P/D legs against vLLM 0.33's own code (skipped where vLLM is not installed).

vLLM's V1 ``Scheduler`` runs on CPU with the real ``NixlConnector`` (its scheduler side
needs no NIXL library: ``NixlPullConnector`` in ``--kv-transfer-config``'s
``kv_both`` role), stepped by hand as in tests/test_sim_vllm_scheduler_parity.py, with
vLLM's sha256 block hasher so its prefix cache works. Checked:

* the prefill leg: the ``kv_transfer_params`` vLLM returns for a finished
  ``do_remote_decode`` request (``request_finished`` plus the scheduler's
  ``remote_prefill_cached_tokens``) has the keys, value types and values the
  simulator's has, for a cold prompt and one whose first block was cached; block ids,
  engine id, request id and side-channel address are compared by type and count only
  (they name each side's own things);
* the decode leg: the tokens vLLM's connector asks to load
  (``get_num_new_matched_tokens``, after the local prefix hit it is given) are the
  tokens the simulator pulls, with and without a local hit, and for a prompt held whole
  (vLLM's hit stops before the last token, so a block is still pulled); once the load
  is reported done (``KVConnectorOutput.finished_recving``), vLLM computes none of the
  prompt and counts all of it as cached (``PrefillStats``), as the simulator does;
* a failed load (``failed_recving``): under ``kv_load_failure_policy`` "fail" (the
  default) the request finishes with "error", the simulator's 500; under "recompute"
  the whole prompt is computed locally, nothing cached;
* KV events: the blocks a decode leg caches (``BlockStored`` token ids, vLLM's through its
  event publisher, the simulator's through its replay socket) are the same, but for a
  block whose hash the decode already held (see the test);
* the bodies: vLLM's request models (chat, completions, responses, Anthropic messages)
  accept the simulator's prefill and decode bodies and keep their ``kv_transfer_params``,
  and its response models accept the simulator's prefill answers with the params intact.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx

from tests.support.kv_sims import token_prompt
from tests.support.pd_sims import REMOTE_DECODE, PDSim, decode_body, prefill_body
from tests.support.stack import MODEL
from tests.support.vllm_env import VllmWorker
from vllm_sim.tokenizer_dir import build_tokenizer_dir

BS = 16
# Compared by type (and, for block ids, by count): each side names its own engine, request and blocks.
OWN = ("remote_block_ids", "remote_engine_id", "remote_request_id", "remote_host", "remote_port")

# Run under vLLM's Python (tests/support/vllm_worker.py): argv[1] is the spec file; prints one JSON line.
_VLLM_PD = r'''
import json, sys
import torch
from vllm.config import CacheConfig, KVEventsConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_events import BlockStored
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.utils.hashing import sha256
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

spec = json.load(open(sys.argv[1]))
BS = spec["block_size"]
init_none_hash(sha256)
HASHER = get_request_block_hasher(BS, sha256)


def scheduler(policy="fail"):
    model = ModelConfig(model=spec["model_dir"], max_model_len=1024, skip_tokenizer_init=True)
    sched = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=4096, max_model_len=1024,
                            is_encoder_decoder=False)
    config = VllmConfig(model_config=model, scheduler_config=sched,
                        cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True),
                        kv_transfer_config=KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_both",
                                                            engine_id="engine-p",
                                                            kv_load_failure_policy=policy),
                        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null"))
    config.cache_config.num_gpu_blocks = 201
    kv_spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=201, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer"], kv_spec)])
    return Scheduler(vllm_config=config, kv_cache_config=kv, log_stats=True,
                     structured_output_manager=StructuredOutputManager(config), block_size=BS)


def step(s):
    out = s.schedule()
    ids = list(out.num_scheduled_tokens)
    runner = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                               sampled_token_ids=[[7] for _ in ids])
    return s.update_from_output(out, runner)


def run(s, rid, prompt, max_tokens=1, params=None):
    extra = {"kv_transfer_params": params} if params is not None else None
    s.add_request(Request(rid, prompt, SamplingParams(max_tokens=max_tokens, extra_args=extra), None,
                          arrival_time=0.0, block_hasher=HASHER))
    found = None
    for _ in range(100):
        for outs in step(s).values():
            for o in outs.outputs:
                if o.request_id == rid and o.finish_reason is not None:
                    found = o.kv_transfer_params
                    return found
    raise RuntimeError(f"{rid} did not finish")


result = {"prefill": [], "decode": []}
for case in spec["prefill"]:
    s = scheduler()
    if case["cached"]:
        run(s, "warm", case["cached"], max_tokens=1)
    result["prefill"].append(run(s, "p", case["prompt"], params=spec["remote_decode"]))
def decode(case, policy="fail", fail=False):
    """The decode leg on a fresh scheduler: (local tokens, tokens the connector loads, and the
    request's end: cached and computed prompt tokens, finish reason, prompt tokens scheduled)."""
    s = scheduler(policy)
    if case["cached"]:
        run(s, "warm", case["cached"], max_tokens=1)
    seen = []
    connector = s.connector
    ask = connector.get_num_new_matched_tokens

    def noted(request, num_computed, _ask=ask, _seen=seen):
        answer = _ask(request, num_computed)
        _seen.append([num_computed, answer[0]])
        return answer

    connector.get_num_new_matched_tokens = noted
    stored = []  # token ids of the blocks the decode leg cached (KV events' BlockStored)
    publish = s.kv_event_publisher.publish

    def kept(batch, _publish=publish, _stored=stored):
        _stored.extend(t for ev in batch.events if isinstance(ev, BlockStored) for t in ev.token_ids)
        return _publish(batch)

    s.kv_event_publisher.publish = kept
    n_blocks = -(-len(case["prompt"]) // BS)
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [list(range(1, n_blocks + 1))],
              "remote_engine_id": "engine-x", "remote_request_id": "p", "remote_host": "localhost",
              "remote_port": 5600, "tp_size": 1, "dcp_size": 1, "pp_size": 1}
    s.add_request(Request("d", case["prompt"], SamplingParams(max_tokens=2, extra_args={"kv_transfer_params": params}),
                          None, arrival_time=0.0, block_hasher=HASHER))
    out = s.schedule()  # allocated, waiting for the remote KV
    done = KVConnectorOutput(finished_recving={"d"}, failed_recving={"d"} if fail else set())
    end = {"cached": None, "computed": None, "finish": None, "scheduled": 0, "stored": stored}
    received = s.update_from_output(out, ModelRunnerOutput(req_ids=[], req_id_to_index={}, kv_connector_output=done))
    for outs in received.values():
        for o in outs.outputs:
            if o.request_id == "d" and o.finish_reason is not None:
                end["finish"] = str(o.finish_reason)
                return seen[0] + [end]
    for _ in range(50):
        out = s.schedule()
        end["scheduled"] += out.num_scheduled_tokens.get("d", 0) if end["cached"] is None else 0
        ids = list(out.num_scheduled_tokens)
        runner = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                   sampled_token_ids=[[7] for _ in ids])
        for outs in s.update_from_output(out, runner).values():
            for o in outs.outputs:
                if o.request_id == "d" and o.prefill_stats is not None and end["cached"] is None:
                    end["cached"] = o.prefill_stats.num_cached_tokens
                    end["computed"] = o.prefill_stats.num_computed_tokens
                if o.request_id == "d" and o.finish_reason is not None:
                    end["finish"] = str(o.finish_reason)
                    return seen[0] + [end]
        if not s.has_requests():
            break
    return seen[0] + [end]


for case in spec["decode"]:
    result["decode"].append(decode(case))
result["failed"] = {policy: decode(spec["decode"][0], policy, fail=True)[2] for policy in ("fail", "recompute")}

from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest, ChatCompletionResponse
from vllm.entrypoints.openai.completion.protocol import CompletionRequest, CompletionResponse
from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest, AnthropicMessagesResponse
models = {"chat": ChatCompletionRequest, "completions": CompletionRequest, "responses": ResponsesRequest,
          "messages": AnthropicMessagesRequest, "chat_response": ChatCompletionResponse,
          "completions_response": CompletionResponse, "messages_response": AnthropicMessagesResponse}
checked = []
for item in spec["bodies"]:
    try:
        m = models[item["model"]](**item["body"])
        checked.append({"ok": True, "kv_transfer_params": m.kv_transfer_params})
    except Exception as e:
        checked.append({"ok": False, "error": str(e)[:500]})
result["bodies"] = checked
print(json.dumps(result))
'''

PROMPT = token_prompt(11, 2, tail=3)  # 35 tokens: 2 full blocks and 3
PREFILL_CASES = [{"cached": None, "prompt": PROMPT}, {"cached": PROMPT[:20], "prompt": PROMPT}]
WHOLE = token_prompt(12, 2, tail=0)  # 32 tokens, held whole by the decode
DECODE_CASES = [{"cached": None, "prompt": PROMPT}, {"cached": PROMPT[:20], "prompt": PROMPT},
                {"cached": WHOLE, "prompt": WHOLE}, {"cached": PROMPT[:28], "prompt": PROMPT[:28]}]


def _post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(url + path, json=body, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def _completion(ids: list[int], max_tokens: int = 4) -> dict[str, Any]:
    return {"model": MODEL, "prompt": ids, "max_tokens": max_tokens}


def _sim_prefills() -> list[dict[str, Any]]:
    out = []
    for case in PREFILL_CASES:
        with PDSim("p", "prefill") as p, PDSim("d", "decode") as d:
            if case["cached"]:
                _post(p.url, "/v1/completions", _completion(case["cached"], 1))
            answer = _post(p.url, "/v1/completions", prefill_body(_completion(case["prompt"])))
            out.append(answer["kv_transfer_params"])
            _post(d.url, "/v1/completions", decode_body(_completion(case["prompt"]), out[-1]))  # frees them
    return out


def _stored(d: PDSim) -> list[int]:
    return [t for run in d.stored_token_ids() for t in run]


def _decode_end(d: PDSim, answer: httpx.Response, before: dict[str, Any], stored: int) -> dict[str, Any]:
    """How a decode leg ended, in the terms the vLLM script reports (``finish`` "error": a 500), and
    the token ids of the blocks it cached (its KV events' ``BlockStored``)."""
    if answer.status_code == 500:
        return {"cached": None, "computed": None, "finish": "error", "stored": _stored(d)[stored:]}
    body = answer.json()
    return {"cached": body["usage"]["prompt_tokens_details"]["cached_tokens"],
            "computed": int(d.stats()["prefill_computed_tokens_sum"] - before["prefill_computed_tokens_sum"]),
            "finish": body["choices"][0]["finish_reason"], "stored": _stored(d)[stored:]}


def _sim_decode(case: dict[str, Any], policy: str = "fail", fail: bool = False) -> list[Any]:
    """(tokens held locally, tokens pulled, how it ended) for one case on fresh simulators."""
    with PDSim("p", "prefill") as p, PDSim("d", "decode", kv_load_failure_policy=policy) as d:
        if case["cached"]:
            _post(d.url, "/v1/completions", _completion(case["cached"], 1))
        params = _post(p.url, "/v1/completions", prefill_body(_completion(case["prompt"])))["kv_transfer_params"]
        # vLLM's scheduler reports its own PrefillStats; the prefill's hit replaces them only later,
        # in the OutputProcessor (tests/test_sim_pd.py checks that part).
        params.pop("remote_prefill_cached_tokens")
        if fail:
            params["remote_engine_id"] = "no-such-engine"
        before, stored = d.stats(), len(_stored(d))
        answer = httpx.post(d.url + "/v1/completions", json=decode_body(_completion(case["prompt"], 2), params),
                            timeout=10)
        moved = d.stats()["kv_transfer"]
        local = len(case["prompt"]) - moved["external_queries"]
        return [local, moved["transfer_tokens"], _decode_end(d, answer, before, stored)]


def _bodies() -> list[dict[str, Any]]:
    """The simulator's request bodies for each route and leg, and its prefill answers."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hello " * 40}], "max_tokens": 8}
    completion = _completion(PROMPT)
    messages = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hello " * 40}]}
    responses = {"model": MODEL, "input": "hello " * 40, "max_output_tokens": 8}
    items: list[dict[str, Any]] = []
    with PDSim("p", "prefill") as p, PDSim("d", "decode") as d:
        for model, path, body in (("chat", "/v1/chat/completions", chat),
                                  ("completions", "/v1/completions", completion),
                                  ("messages", "/v1/messages", messages)):
            first = prefill_body(body)
            answer = _post(p.url, path, first)
            second = decode_body(body, answer["kv_transfer_params"])
            _post(d.url, path, second)
            items += [{"model": model, "body": first}, {"model": model, "body": second},
                      {"model": model + "_response", "body": answer}]
        first = {**responses, "max_output_tokens": 1, "kv_transfer_params": dict(REMOTE_DECODE)}
        answer = _post(p.url, "/v1/responses", first)
        second = decode_body(responses, answer["kv_transfer_params"])
        _post(d.url, "/v1/responses", second)
        items += [{"model": "responses", "body": first}, {"model": "responses", "body": second}]
    return items


def _vllm(worker: VllmWorker, tmp_path: Path, bodies: list[dict[str, Any]]) -> dict[str, Any]:
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"model_dir": str(build_tokenizer_dir(tmp_path / "model")), "block_size": BS,
                                "remote_decode": REMOTE_DECODE, "prefill": PREFILL_CASES,
                                "decode": DECODE_CASES, "bodies": bodies}))
    out = worker.run(_VLLM_PD, str(spec), timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_the_sims_p_d_legs_match_vllms_connector_and_protocol(tmp_path: Path, vllm_worker: VllmWorker) -> None:
    bodies = _bodies()
    vllm = _vllm(vllm_worker, tmp_path, bodies)
    # The prefill's params: same keys in the same order, same types, same values but each side's own names.
    for sim, real in zip(_sim_prefills(), vllm["prefill"], strict=True):
        assert list(sim) == list(real)
        assert {k: type(v) for k, v in sim.items()} == {k: type(v) for k, v in real.items()}
        assert [len(g) for g in sim["remote_block_ids"]] == [len(g) for g in real["remote_block_ids"]]
        assert {k: v for k, v in sim.items() if k not in OWN} == {k: v for k, v in real.items() if k not in OWN}
    assert [r["remote_prefill_cached_tokens"] for r in vllm["prefill"]] == [0, BS]  # the cases test a hit
    # The decode pulls what vLLM's connector asks for, after the same local hit, computes none of
    # the prompt (vLLM schedules only its last token again), counts all of it as cached, and caches
    # the pulled full blocks (BlockStored).
    for case, real in zip(DECODE_CASES, vllm["decode"], strict=True):
        assert real[2].pop("scheduled") == 1
        sim = _sim_decode(case)
        if case["prompt"] is WHOLE:
            # A known difference, not P/D's own: vLLM caches the pulled (or recomputed) block whose hash
            # it already holds as a second physical block and reports it stored again; the simulator's
            # pool keeps such a duplicate anonymous and reports nothing (vllm_sim.kv, allocate).
            assert (real[2].pop("stored"), sim[2].pop("stored")) == (WHOLE[BS:], [])
        assert sim == real, case
    assert [loaded for _, loaded, _ in vllm["decode"]] == [35, 19, 16, 12]
    # A failed load: vLLM's default policy ends the request in error (the server's 500), and
    # "recompute" prefills all of it locally.
    for policy, real in vllm["failed"].items():
        real.pop("scheduled")
        assert _sim_decode(DECODE_CASES[0], policy, fail=True)[2] == real, policy
    assert vllm["failed"]["fail"]["finish"] == "error" and vllm["failed"]["recompute"]["computed"] == len(PROMPT)
    assert vllm["decode"][0][2]["stored"] == PROMPT[: 2 * BS]  # the cases test what they should
    # vLLM's models take every body and keep the params as sent or returned.
    for item, checked in zip(bodies, vllm["bodies"], strict=True):
        assert checked["ok"], (item["model"], checked)
        assert checked["kv_transfer_params"] == item["body"]["kv_transfer_params"], item["model"]
