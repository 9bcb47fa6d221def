"""The simulator saturates as vLLM 0.33 does: ``max_num_seqs``, ``--scheduling-policy``, preemption.

Saturation is made deterministic without clocks. In-process, requests entered
in one go (no await between them) are all waiting when the engine's first step
runs. Over HTTP, a *blocker* holds the replica (its one slot, or every KV
block) with a reply too long to finish; the test waits until ``/metrics``
shows the others queued, then closes the blocker's stream, which aborts it and
frees everything at once. Which request ran first is read from the order the
engine admitted them (``/sim/stats`` ``cached_tokens``, recorded at admission).

The parity tests run vLLM 0.33's own ``request_queue.py`` and protocol models
in its interpreter (tests/support/vllm_env.py) and skip, saying why, without it.
"""

from __future__ import annotations

import ast
import asyncio
import json
from contextlib import AsyncExitStack, contextmanager
from typing import Any, Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.servers import ServerThread
from tests.support.vllm_env import VllmWorker
from vllm_sim.cli import add_arguments, config_from_args
from vllm_sim.config import SimConfig
from vllm_sim.engine import Engine, GenRequest
from vllm_sim.kv import KVPool
from vllm_sim.priority import body_priority
from vllm_sim.server import build_app
from vllm_sim.timing import TimingModel
from vllm_sim.waiting import Policy, waiting_queue

pytestmark = pytest.mark.anyio

# Long enough that a blocker never finishes on its own during a test (10 ms a token, 60 s).
_SLOW = dict(time_scale=1.0, decode_base_s=0.01, decode_s_per_seq=0.0, prefill_base_s=0.0)
_BLOCKER_TOKENS = 6000


# -- in-process: the engine's order and its preemption ------------------------------------------
async def _drain(engine: Engine, requests: list[GenRequest]) -> dict[str, str]:
    """Submit all of ``requests`` before the engine's first step; each one's whole text."""
    async with AsyncExitStack() as stack:
        gens = [await stack.enter_async_context(engine.generate(r)) for r in requests]

        async def text(gen: Any) -> str:
            return "".join([ev.text async for ev in gen])

        texts = await asyncio.gather(*(text(g) for g in gens))
    return {r.request_id: t for r, t in zip(requests, texts)}


@pytest.mark.parametrize("policy, order", [("priority", ["high", "mid", "low"]),
                                           ("fcfs", ["low", "high", "mid"])])
async def test_one_slot_serves_the_queue_in_the_policys_order(policy: Policy, order: list[str]) -> None:
    engine = Engine(KVPool(64), TimingModel(max_num_seqs=1, time_scale=0), policy=policy)
    requests = [GenRequest("low", [1, 2, 3], max_tokens=2, priority=10),
                GenRequest("high", [4, 5, 6], max_tokens=2, priority=-3),
                GenRequest("mid", [7, 8, 9], max_tokens=2, priority=0)]
    await _drain(engine, requests)
    assert list(engine.stats.cached_tokens) == order  # admission order
    await engine.aclose()


@pytest.mark.parametrize("policy, victim", [("priority", "low"), ("fcfs", "high")])
async def test_out_of_blocks_preempts_the_policys_victim_which_resumes_by_recompute(policy: Policy,
                                                                                   victim: str) -> None:
    # Three blocks of 16; two 15-token prompts take one each and both need a second at their
    # second token. priority: running is [high, low] and low, the largest (priority, arrival),
    # goes; fcfs: running is [low, high] and the last admitted, high, goes.
    engine = Engine(KVPool(3, 16), TimingModel(max_num_seqs=4, time_scale=0), policy=policy)
    low = GenRequest("low", list(range(100, 115)), max_tokens=20, priority=5)
    high = GenRequest("high", list(range(200, 215)), max_tokens=20, priority=0)
    texts = await _drain(engine, [low, high])
    assert list(engine.stats.preempted) == [victim] and engine.stats.preemptions == 1
    # The victim waited for the other to finish, resumed and finished its reply unchanged.
    alone = Engine(KVPool(64, 16), TimingModel(time_scale=0))
    assert texts == await _drain(alone, [GenRequest("low", low.prompt_tokens, 20, priority=5),
                                         GenRequest("high", high.prompt_tokens, 20)])
    assert engine.stats.completed == 2 and engine.pool.usage == 0
    # A resumed request's lookup is not a new prefix-cache query (vLLM counts those apart).
    assert engine.pool.queries_tokens == 30
    await engine.aclose()
    await alone.aclose()


@pytest.mark.parametrize("policy, victim", [("priority", "low"), ("fcfs", "high")])
async def test_priority_preempts_the_lowest_even_when_another_ran_out(policy: Policy, victim: str) -> None:
    # low runs alone first and takes a second block; high joins (running is [low, high]) and
    # runs out at its second token. priority: low goes, though high asked (vLLM's max over
    # running of (priority, arrival)); fcfs: the last admitted, high itself.
    engine = Engine(KVPool(3, 16), TimingModel(max_num_seqs=4, time_scale=0), policy=policy)
    low = GenRequest("low", list(range(100, 115)), max_tokens=30, priority=5)
    high = GenRequest("high", list(range(200, 215)), max_tokens=20, priority=0)
    async with engine.generate(low) as low_gen:
        tokens = low_gen.__aiter__()
        await tokens.__anext__()  # low is running
        async with engine.generate(high) as high_gen:
            high_text = "".join([ev.text async for ev in high_gen])
        low_text = "".join([ev.text async for ev in tokens])
    assert list(engine.stats.preempted) == [victim]
    assert len(high_text) > 0 and len(low_text) > 0 and engine.stats.completed == 2
    await engine.aclose()


async def test_a_lone_sequence_outgrowing_the_pool_runs_on_rather_than_preempting_itself() -> None:
    engine = Engine(KVPool(2, 16), TimingModel(time_scale=0), policy="priority")
    texts = await _drain(engine, [GenRequest("big", list(range(30)), max_tokens=40)])
    assert engine.stats.preemptions == 0 and engine.stats.completed == 1 and len(texts["big"]) > 0
    await engine.aclose()


def test_waiting_queues_prepend_as_vllms_do() -> None:
    class Entry:
        def __init__(self, name: str, priority: int, arrival: int) -> None:
            self.name, self.sort_key = name, (priority, arrival, 0)

    a, b, c = Entry("a", 1, 0), Entry("b", 0, 1), Entry("c", 1, 2)
    for policy, expected in (("fcfs", ["c", "a", "b"]), ("priority", ["b", "a", "c"])):
        queue = waiting_queue(policy)  # type: ignore[var-annotated]
        queue.add(a)
        queue.add(b)
        queue.prepend(c)  # c was preempted: the front under fcfs, its own place under priority
        assert [e.name for e in queue] == expected
        assert [queue.pop().name for _ in range(3)] == expected
    with pytest.raises(ValueError, match="Unknown scheduling policy"):
        waiting_queue("lifo")  # type: ignore[arg-type]


def test_the_flag_is_vllms_and_lands_in_the_settings() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert config_from_args(parser.parse_args([])).scheduling_policy == "fcfs"
    assert config_from_args(parser.parse_args(["--scheduling-policy", "priority"])).scheduling_policy == "priority"
    with pytest.raises(SystemExit):
        parser.parse_args(["--scheduling-policy", "lifo"])
    with pytest.raises(ValueError, match="Unknown scheduling policy"):
        SimConfig(scheduling_policy="lifo")  # type: ignore[arg-type]


# -- over HTTP: a saturated replica, the OpenAI SDK as client ------------------------------------
@contextmanager
def _sim(policy: Policy, **config: Any) -> Iterator[str]:
    app = build_app(SimConfig(scheduling_policy=policy, **config))
    server = ServerThread(app)
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


async def _gauge(http: httpx.AsyncClient, name: str) -> float:
    text = (await http.get("/metrics")).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise AssertionError(f"{name} not in /metrics")


async def _until_waiting(http: httpx.AsyncClient, count: int) -> None:
    """Wait (polling, no deadline asserted on) until ``count`` requests are queued."""
    for _ in range(2000):
        if await _gauge(http, "vllm:num_requests_waiting") == count:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never saw {count} waiting")


@pytest.mark.parametrize("policy, first", [("priority", "high"), ("fcfs", "low")])
async def test_a_later_higher_priority_request_is_served_first_on_a_saturated_replica(
        policy: Policy, first: str) -> None:
    with _sim(policy, timing=TimingModel(max_num_seqs=1, **_SLOW)) as url:
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as client, \
                httpx.AsyncClient(base_url=url) as http:
            blocker = await client.chat.completions.create(
                model="sim-model", messages=[{"role": "user", "content": "hold"}],
                max_tokens=_BLOCKER_TOKENS, stream=True)
            await blocker.__anext__()  # it runs: the one slot is taken
            low = asyncio.create_task(client.chat.completions.create(
                model="sim-model", messages=[{"role": "user", "content": "low"}], max_tokens=2,
                extra_body={"priority": 10}))
            await _until_waiting(http, 1)
            # The header wins over the body, as in vLLM (X-Vllm-Priority).
            high = asyncio.create_task(client.chat.completions.create(
                model="sim-model", messages=[{"role": "user", "content": "high"}], max_tokens=2,
                extra_body={"priority": 50}, extra_headers={"X-Vllm-Priority": "-5"}))
            await _until_waiting(http, 2)
            await blocker.close()  # aborts it: the slot frees with both queued
            done = {"low": (await low).id, "high": (await high).id}
            admitted = list((await http.get("/sim/stats")).json()["cached_tokens"])
            second = "high" if first == "low" else "low"
            assert admitted[1:] == [done[first], done[second]]


@pytest.mark.parametrize("policy, victim", [("priority", "low"), ("fcfs", "high")])
async def test_preemption_over_http_and_its_metrics(policy: Policy, victim: str) -> None:
    # A blocker with a 40-token prompt holds all three blocks; the two 15-token prompts queue
    # behind it, then are admitted together when it goes, as in the in-process test above.
    with _sim(policy, num_gpu_blocks=3, block_size=16, timing=TimingModel(max_num_seqs=4, **_SLOW)) as url:
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as client, \
                httpx.AsyncClient(base_url=url) as http:
            blocker = await client.completions.create(model="sim-model", prompt=list(range(1, 41)),
                                                      max_tokens=_BLOCKER_TOKENS, stream=True)
            await blocker.__anext__()
            low = asyncio.create_task(client.completions.create(
                model="sim-model", prompt=list(range(100, 115)), max_tokens=20, extra_body={"priority": 5}))
            await _until_waiting(http, 1)  # low arrives first: under fcfs, arrival order picks the victim
            high = asyncio.create_task(client.completions.create(
                model="sim-model", prompt=list(range(200, 215)), max_tokens=20))
            await _until_waiting(http, 2)
            assert await _gauge(http, "vllm:num_requests_running") == 1
            await blocker.close()
            ids = {"low": (await low).id, "high": (await high).id}
            assert (await low).usage.completion_tokens == (await high).usage.completion_tokens == 20
            assert (await http.get("/sim/stats")).json()["preempted"] == [ids[victim]]
            text = (await http.get("/metrics")).text
            assert 'vllm:num_preemptions_total{engine="0",model_name="sim-model"} 1.0' in text
            assert 'vllm:num_requests_waiting_by_reason{engine="0",model_name="sim-model",reason="capacity"} 0.0' \
                in text
            # Per finished request (the aborted blocker is not one): both in the first bucket, one
            # preempted once, the other never.
            assert 'vllm:request_num_preemptions_bucket{engine="0",model_name="sim-model",le="1.0"} 2.0' in text
            assert 'vllm:request_num_preemptions_sum{engine="0",model_name="sim-model"} 1.0' in text


async def test_priority_is_accepted_under_fcfs_and_a_bad_one_refused_in_vllms_shape() -> None:
    # vLLM 0.33 refuses no priority under fcfs (it ignores it); only pydantic's type checks bite.
    with _sim("fcfs", timing=TimingModel(time_scale=0)) as url:
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as client:
            messages = [{"role": "user", "content": "hi"}]
            chat = await client.chat.completions.create(model="sim-model", messages=messages,  # type: ignore[arg-type]
                                                        max_tokens=2, extra_body={"priority": 7})
            assert chat.choices[0].finish_reason == "length"
            await client.completions.create(model="sim-model", prompt="hi", max_tokens=2, extra_body={"priority": -7})
            await client.responses.create(model="sim-model", input="hi", max_output_tokens=2,
                                          extra_body={"priority": 3})
            async with httpx.AsyncClient(base_url=url) as http:
                # Messages has no priority field in vLLM: a priority there changes nothing.
                reply = await http.post("/v1/messages", json={"model": "sim-model", "max_tokens": 2, "priority": 4,
                                                              "messages": messages})
                assert reply.status_code == 200
                for route, body in (("/v1/chat/completions", {"messages": messages}),
                                    ("/v1/completions", {"prompt": "hi"}), ("/v1/responses", {"input": "hi"})):
                    bad = await http.post(route, json={"model": "sim-model", "priority": "urgent", **body})
                    assert bad.status_code == 400, route
                    error = bad.json()["error"]
                    assert error["type"] == "Bad Request" and error["param"] == "body.priority"
                    assert error["code"] == 400 and error["message"].startswith("1 validation error:\n  {'type': "
                                                                                "'int_parsing', 'loc': ('body', "
                                                                                "'priority')")
            with pytest.raises(openai.BadRequestError) as caught:
                await client.chat.completions.create(model="sim-model", messages=messages,  # type: ignore[arg-type]
                                                     max_tokens=2, extra_body={"priority": 2**63})
            assert "less than or equal to 9223372036854775807" in str(caught.value)


# -- parity with vLLM 0.33's own code -----------------------------------------------------------
_QUEUE = r"""
import json, sys
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.request_queue import SchedulingPolicy, create_request_queue
from vllm.v1.request import Request
ops = json.load(sys.stdin)
out = {}
for policy in ("fcfs", "priority"):
    queue, known, order = create_request_queue(SchedulingPolicy(policy)), {}, []
    for op in ops:
        if op[0] == "add":
            _, rid, priority, arrival = op
            known[rid] = Request(rid, [1], SamplingParams(max_tokens=1), None, arrival_time=float(arrival),
                                 priority=priority)
            queue.add_request(known[rid])
        elif op[0] == "prepend":
            queue.prepend_request(known[op[1]])
        else:
            order.append(queue.pop_request().request_id)
    out[policy] = order
print(json.dumps(out))
"""

# Arrivals interleaved with pops and preempted requests put back, ties on priority included.
_OPS: list[list[Any]] = [
    ["add", "a", 0, 0], ["add", "b", 5, 1], ["add", "c", -2, 2], ["add", "d", 5, 3], ["pop"],
    ["add", "e", 0, 4], ["pop"], ["prepend", "c"], ["add", "f", -2, 5], ["pop"], ["prepend", "a"],
    ["add", "g", 1, 6], ["pop"], ["pop"], ["pop"], ["pop"], ["pop"], ["pop"],
]


def _sim_order(policy: Policy) -> list[str]:
    class Entry:
        def __init__(self, rid: str, priority: int, arrival: int) -> None:
            self.rid, self.sort_key = rid, (priority, arrival, 0)

    queue, known, order = waiting_queue(policy), {}, []  # type: ignore[var-annotated]
    for op in _OPS:
        if op[0] == "add":
            known[op[1]] = Entry(op[1], op[2], op[3])
            queue.add(known[op[1]])
        elif op[0] == "prepend":
            queue.prepend(known[op[1]])
        else:
            order.append(queue.pop().rid)
    return order


def test_waiting_queue_order_matches_vllms_request_queue(vllm_worker: VllmWorker) -> None:
    done = vllm_worker.run(_QUEUE, input=json.dumps(_OPS))
    assert done.returncode == 0, done.stderr[-3000:]
    vllm_orders = json.loads(done.stdout.strip().splitlines()[-1])
    assert vllm_orders == {"fcfs": _sim_order("fcfs"), "priority": _sim_order("priority")}
    assert vllm_orders["fcfs"] != vllm_orders["priority"]  # the sequence tells the policies apart


_VALUES: list[Any] = [7, -7, "12", " 3 ", 4.0, True, 5.5, None, "urgent", [1], {"a": 1}, 2**63, -(2**63) - 1,
                      2**63 - 1]

_PROTOCOL = r"""
import json, sys
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
from vllm.entrypoints.generate.base.serving import PRIORITY_HEADER
values = json.load(sys.stdin)
models = {"chat": (ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}]}),
          "completions": (CompletionRequest, {"prompt": "hi"}), "responses": (ResponsesRequest, {"input": "hi"})}
out = {"header": PRIORITY_HEADER, "messages_has_priority": "priority" in AnthropicMessagesRequest.model_fields}
for name, (model, base) in models.items():
    seen = []
    for value in values:
        try:
            seen.append(["ok", model.model_validate({"model": "m", **base, "priority": value}).priority])
        except Exception as exc:
            errors = exc.errors()
            seen.append(["error", [(e["type"], e["msg"]) for e in errors if e["loc"][-1] == "priority"]])
    out[name] = seen
print(json.dumps(out))
"""


def test_priority_validation_matches_vllms_protocol_models(vllm_worker: VllmWorker) -> None:
    done = vllm_worker.run(_PROTOCOL, input=json.dumps(_VALUES))
    assert done.returncode == 0, done.stderr[-3000:]
    vllm_seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert vllm_seen.pop("header").lower() == "x-vllm-priority"
    assert vllm_seen.pop("messages_has_priority") is False
    ours: list[Any] = []
    for value in _VALUES:
        try:
            ours.append(["ok", body_priority({"priority": value})])
        except Exception as exc:
            error = ast.literal_eval(str(exc).split("\n  ", 1)[1])  # the dict vLLM's handler prints
            ours.append(["error", [[error["type"], error["msg"]]]])
    for name, seen in vllm_seen.items():
        assert seen == ours, name
