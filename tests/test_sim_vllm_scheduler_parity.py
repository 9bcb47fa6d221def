"""The simulator's engine schedules as vLLM 0.33's own ``Scheduler`` does, checked by running both.

vLLM's V1 scheduler (``vllm.v1.core.sched.scheduler.Scheduler``) needs no GPU:
built on CPU over the weightless model directory of ``vllm_sim.tokenizer_dir``
and a KV cache config with ``num_blocks`` blocks, it is stepped by hand
(``schedule``, then ``update_from_output`` with one sampled token for every
scheduled request, which is what a model runner returns when every prefill
fits in one step). The simulator's ``Engine`` runs the same requests at
``time_scale=0``, all submitted before its first step, as they are all added
before vLLM's first ``schedule``.

Compared, per case: the order requests were first admitted and the prompt
tokens each found cached then, the requests preempted in order (vLLM's
``_preempt_request`` is wrapped to note each call and then run as is), the
order they finished, and, in the order first tokens came, the running and
waiting counts that ``/metrics`` shows at the end of that step (vLLM's
``len(running)``, ``len(waiting)``; the simulator's ``Engine.reported``, read by
each consumer at its first token). Cases are seeded and random: both policies,
``max_num_seqs`` from 1 to 6, pools from just enough for the longest request to
three times that, so that a good share of them preempt (the test asserts they
do, so it cannot pass on cases that never run out of blocks).

Half the cases have a token budget (``max_num_batched_tokens``, from
``max_num_seqs`` to 80 tokens against prompts of 5 to 70), so that prompts are
prefilled in chunks over several steps and requests wait with seats free (the
test asserts both happen); the others have a budget no prompt reaches. Some
cases share prefixes between their prompts, so that a chunk's blocks are found
cached by a request admitted after it. vLLM's block pool keeps one block as its
null block, so vLLM gets ``num_blocks + 1``. vLLM's model runner returns no
sampled token for a request whose prompt is not yet complete
(``is_prefill_chunk``), and the harness does the same.
"""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path
from typing import Any

import pytest

from tests.support.vllm_env import VllmWorker
from vllm_sim.engine import Engine, GenRequest
from vllm_sim.kv import KVPool
from vllm_sim.timing import TimingModel
from vllm_sim.tokenizer_dir import build_tokenizer_dir

BLOCK_SIZE = 16
MAX_MODEL_LEN = 1024

# Run under vLLM's Python (tests/support/vllm_worker.py): argv[1] is the cases file; prints one JSON line.
_VLLM_SCHEDULER = r'''
import json, sys
import torch
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

spec = json.load(open(sys.argv[1]))
traces = []
# As EngineCore builds it with prefix caching on: without a block hasher a Request has no block hashes.
hash_fn = get_hash_fn_by_name("sha256")
init_none_hash(hash_fn)
for case in spec["cases"]:
    bs, max_len, seqs = case["block_size"], case["max_model_len"], case["max_num_seqs"]
    model = ModelConfig(model=spec["model_dir"], max_model_len=max_len, skip_tokenizer_init=True)
    budget = case.get("max_num_batched_tokens") or max_len * seqs
    sched = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget, max_model_len=max_len,
                            is_encoder_decoder=False, policy=case["policy"])
    config = VllmConfig(model_config=model, scheduler_config=sched,
                        cache_config=CacheConfig(block_size=bs, enable_prefix_caching=True))
    num_blocks = case["num_blocks"] + 1  # block 0 is the pool's null block
    config.cache_config.num_gpu_blocks = num_blocks
    spec_ = FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                       kv_cache_groups=[KVCacheGroupSpec(["layer"], spec_)])
    scheduler = Scheduler(vllm_config=config, kv_cache_config=kv, log_stats=True,
                          structured_output_manager=StructuredOutputManager(config), block_size=bs)
    preempted = []
    preempt = scheduler._preempt_request

    def noted(request, *args, _preempt=preempt, _seen=preempted, **kwargs):
        _seen.append(request.request_id)
        return _preempt(request, *args, **kwargs)

    scheduler._preempt_request = noted
    requests = {}
    for i, r in enumerate(case["requests"]):
        params = SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True)
        requests[r["id"]] = Request(r["id"], r["prompt"], params, None, arrival_time=float(i),
                                    priority=r["priority"], block_hasher=get_request_block_hasher(bs, hash_fn))
        scheduler.add_request(requests[r["id"]])
    admitted, cached, finished, first = [], [], [], []
    for _ in range(100_000):
        if not scheduler.has_requests():
            break
        out = scheduler.schedule()
        running = [req.request_id for req in scheduler.running]
        for rid in running:
            if rid not in admitted:
                admitted.append(rid)
                cached.append(requests[rid].prefill_stats.num_cached_tokens)
        ids = list(out.num_scheduled_tokens)
        sampled = [[] if requests[rid].is_prefill_chunk else [7] for rid in ids]
        runner = ModelRunnerOutput(req_ids=ids, req_id_to_index={rid: i for i, rid in enumerate(ids)},
                                   sampled_token_ids=sampled)
        scheduler.update_from_output(out, runner)
        gauges = [len(scheduler.running), len(scheduler.waiting)]
        first += [[rid, *gauges] for rid, s in zip(ids, sampled) if s and len(requests[rid].output_token_ids) == 1]
        finished += [rid for rid in running if rid not in scheduler.requests]
    traces.append({"admitted": admitted, "cached": cached, "preempted": preempted, "finished": finished,
                   "first": first})
print(json.dumps(traces))
'''


def _cases(seed: int = 28, count: int = 80) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        requests = []
        shared = rng.random() < 0.3  # prompts share a prefix of 0 to 3 blocks
        for i in range(rng.randint(3, 8)):
            head = [7 + j for j in range(BLOCK_SIZE * rng.randint(0, 3))] if shared else []
            prompt = head + [1000 * (i + 1) + j for j in range(rng.randint(5, 70))]
            requests.append({"id": f"r{i}", "prompt": prompt, "max_tokens": rng.randint(1, 60),
                             "priority": rng.choice([0, 0, 1, 2, 5, -1])})
        # Every request fits the pool alone (vLLM refuses to start with less than max_model_len).
        longest = max(-(-(len(r["prompt"]) + r["max_tokens"]) // BLOCK_SIZE) for r in requests)
        seqs = rng.randint(1, 6)
        cases.append({"policy": rng.choice(["fcfs", "priority"]), "max_num_seqs": seqs,
                      "num_blocks": rng.randint(longest, 3 * longest), "block_size": BLOCK_SIZE,
                      "max_model_len": MAX_MODEL_LEN, "requests": requests,
                      "max_num_batched_tokens": rng.randint(seqs, 80) if rng.random() < 0.5 else None})
    return cases


async def _sim_trace(case: dict[str, Any]) -> dict[str, list[Any]]:
    timing = TimingModel(max_num_seqs=case["max_num_seqs"], time_scale=0,
                         max_num_batched_tokens=case.get("max_num_batched_tokens"))
    engine = Engine(KVPool(case["num_blocks"], case["block_size"]), timing, policy=case["policy"])
    finished: list[str] = []
    first: list[list[Any]] = []

    async def run(r: dict[str, Any]) -> None:
        request = GenRequest(r["id"], r["prompt"], r["max_tokens"], priority=r["priority"])
        async with engine.generate(request) as gen:
            async for _ in gen:
                if gen.completion_tokens == 1:
                    # A consumer runs after the step that woke it and before the next one ends:
                    # ``reported`` is still that step's.
                    first.append([r["id"], *engine.reported])
        finished.append(r["id"])  # woken in the order the step emitted the last tokens

    # The tasks start in order and all submit before the engine's first step.
    await asyncio.gather(*(run(r) for r in case["requests"]))
    await engine.aclose()
    # cached_tokens is recorded at each request's first admission, in order.
    return {"admitted": list(engine.stats.cached_tokens), "cached": list(engine.stats.cached_tokens.values()),
            "preempted": list(engine.stats.preempted), "finished": finished, "first": first}


def test_engine_admits_preempts_and_finishes_as_vllms_scheduler(tmp_path: Path, vllm_worker: VllmWorker) -> None:
    cases = _cases()
    spec = tmp_path / "cases.json"
    spec.write_text(json.dumps({"model_dir": str(build_tokenizer_dir(tmp_path / "model")), "cases": cases}))
    out = vllm_worker.run(_VLLM_SCHEDULER, str(spec), timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    vllm = json.loads(out.stdout.strip().splitlines()[-1])
    sim = [asyncio.run(_sim_trace(case)) for case in cases]
    mismatches = [f"case {i} ({c['policy']}, max_num_seqs={c['max_num_seqs']}, blocks={c['num_blocks']}):\n"
                  f"  sim  {s}\n  vLLM {v}" for i, (c, s, v) in enumerate(zip(cases, sim, vllm)) if s != v]
    assert not mismatches, "\n".join(mismatches)
    # The cases exercise what they are for: both policies preempt, and a high priority overtakes.
    preempting = {c["policy"] for c, v in zip(cases, vllm) if v["preempted"]}
    assert preempting == {"fcfs", "priority"}, preempting
    overtaken = [v for c, v in zip(cases, vllm)
                 if c["policy"] == "priority" and v["admitted"] != [r["id"] for r in c["requests"]]]
    assert overtaken
    # Budgets chunk prompts: requests wait beside free seats, which whole prompts never make them do
    # while blocks are plentiful; shared prefixes are found cached, chunks' blocks included.
    waited = [c for c, v in zip(cases, vllm) if c["max_num_batched_tokens"] and
              any(waiting and running < c["max_num_seqs"] for _, running, waiting in v["first"])]
    assert len(waited) >= 5, len(waited)
    assert sum(1 for v in vllm if any(v["cached"])) >= 10


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_hand_made_case_preempts_the_policys_victim(policy: str, tmp_path: Path, vllm_worker: VllmWorker) -> None:
    """One case small enough to read: 12 blocks, four 40-token prompts of 3 blocks each, all admitted;
    at their 49th token each needs a fourth block and none is left."""
    prompts = {rid: [base + j for j in range(40)] for rid, base in (("a", 100), ("b", 200), ("c", 300), ("d", 400))}
    case = {"policy": policy, "max_num_seqs": 4, "num_blocks": 12, "block_size": BLOCK_SIZE,
            "max_model_len": MAX_MODEL_LEN,
            "requests": [{"id": rid, "prompt": prompts[rid], "max_tokens": tokens, "priority": priority}
                         for rid, tokens, priority in (("a", 40, 2), ("b", 40, 0), ("c", 30, 1), ("d", 20, 3))]}
    spec = tmp_path / "case.json"
    spec.write_text(json.dumps({"model_dir": str(build_tokenizer_dir(tmp_path / "model")), "cases": [case]}))
    out = vllm_worker.run(_VLLM_SCHEDULER, str(spec), timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    [vllm] = json.loads(out.stdout.strip().splitlines()[-1])
    assert asyncio.run(_sim_trace(case)) == vllm
    if policy == "priority":
        # Admitted by priority; the lowest priorities (d, then a) are preempted.
        assert {k: vllm[k] for k in ("admitted", "preempted", "finished")} == {
            "admitted": ["b", "c", "a", "d"], "preempted": ["d", "a"], "finished": ["c", "b", "a", "d"]}
    else:
        # Admitted in arrival order; the last admitted (d, then c) are preempted.
        assert vllm["admitted"] == ["a", "b", "c", "d"] and vllm["preempted"][:2] == ["d", "c"], vllm


# vLLM's input processor (the API server's last step before the engine) under fcfs: argv[1] is the model dir.
_VLLM_FCFS_PRIORITY = r'''
import json, sys
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.engine.input_processor import InputProcessor

model = ModelConfig(model=sys.argv[1], max_model_len=1024)
config = VllmConfig(model_config=model, cache_config=CacheConfig(block_size=16),
                    scheduler_config=SchedulerConfig(max_model_len=1024, is_encoder_decoder=False))
processor = InputProcessor(config)
kept = {}
for priority in (7, -3):
    request = processor.process_inputs(f"r{priority}", {"type": "token", "prompt_token_ids": [1, 2, 3]},
                                       SamplingParams(max_tokens=4), ("generate",), priority=priority)
    kept[str(priority)] = request.priority
print(json.dumps({"policy": config.scheduler_config.policy, "kept": kept}))
'''


def test_vllm_accepts_a_priority_under_fcfs(tmp_path: Path, vllm_worker: VllmWorker) -> None:
    """Why the simulator accepts ``priority`` under fcfs: vLLM 0.33 does (its protocol models' field
    description says it "will raise an error", but nothing on the way to the scheduler checks it),
    and the fcfs queue then ignores it (the random cases above include priorities under fcfs)."""
    out = vllm_worker.run(_VLLM_FCFS_PRIORITY, str(build_tokenizer_dir(tmp_path / "model")), timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"policy": "fcfs", "kept": {"7": 7, "-3": -3}}
