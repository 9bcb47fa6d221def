"""kvgate routing a P/D fleet (gateway.proxy.disagg) over simulated replicas that speak vLLM's
NixlConnector protocol (vllm_sim.pd), driven by the official SDKs.

The simulator's answers are deterministic, so every answer through the three steps must equal
a plain replica's; its counters show which replica prefilled, which pulled and how much.
"""

from __future__ import annotations

import time
from typing import Any, Iterator

import anthropic
import httpx
import openai
import pytest

from tests.support.pd_sims import PDSim, chat, reference_sim
from tests.support.pd_stack import PDStack
from tests.support.stack import MODEL

ROLES = {"p1": "prefill", "p2": "prefill", "d1": "decode", "d2": "decode"}
PREFILLS, DECODES = ("p1", "p2"), ("d1", "d2")


ref = pytest.fixture(scope="module")(reference_sim)


@pytest.fixture(scope="module")
def fleet() -> Iterator[PDStack]:
    s = PDStack(ROLES, routing={"disaggregation": "always"})
    yield s
    s.close()


def _counts(stack: PDStack) -> dict[str, dict[str, int]]:
    return {name: stack.sims[name].stats()["kv_transfer"] for name in stack.sims}


def _delta(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]], key: str,
           names: tuple[str, ...]) -> int:
    return sum(after[n][key] - before[n][key] for n in names)


def _ref_chat(ref: PDSim, messages: list[dict[str, str]], **kw: Any) -> str:
    r = httpx.post(ref.url + "/v1/chat/completions", json={"model": MODEL, "messages": messages, **kw}, timeout=10)
    return r.json()["choices"][0]["message"]["content"]  # type: ignore[no-any-return]


def test_chat_streams_through_the_three_steps_and_answers_as_a_plain_replica(fleet: PDStack, ref: PDSim) -> None:
    messages = chat("stream me the answer")
    before = _counts(fleet)
    with openai.OpenAI(base_url=fleet.base_url, api_key="x", max_retries=0) as client:
        with client.chat.completions.with_streaming_response.create(
                model=MODEL, messages=messages, max_tokens=12, stream=True) as raw:  # type: ignore[arg-type]
            assert raw.headers["x-kvgate-replica"] in DECODES
            text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
    assert text == _ref_chat(ref, messages, max_tokens=12)
    after = _counts(fleet)
    # One prefill leg answered by a prefill replica; one decode leg that pulled its whole prompt.
    assert _delta(before, after, "remote_prefills", PREFILLS) == 1
    assert _delta(before, after, "reads", PREFILLS) == 1
    assert _delta(before, after, "transfers", DECODES) == 1
    assert _delta(before, after, "remote_prefills", DECODES) == 0 and _delta(before, after, "transfers", PREFILLS) == 0


@pytest.mark.parametrize("stream", [False, True])
def test_completions_through_the_three_steps(fleet: PDStack, ref: PDSim, stream: bool) -> None:
    prompt = f"Once upon a time (stream={stream}), " + "a block was pulled across the fleet. " * 12
    before = _counts(fleet)
    with openai.OpenAI(base_url=fleet.base_url, api_key="x", max_retries=0) as client:
        if stream:
            text = "".join(c.choices[0].text for c in client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=10, stream=True) if c.choices)
        else:
            text = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10).choices[0].text
    expected = httpx.post(ref.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 10},
                          timeout=10).json()["choices"][0]["text"]
    assert text == expected
    after = _counts(fleet)
    assert _delta(before, after, "remote_prefills", PREFILLS) == 1 and _delta(before, after, "transfers", DECODES) == 1


def test_messages_through_the_three_steps_with_the_anthropic_sdk(fleet: PDStack, ref: PDSim) -> None:
    system, question = "You answer briefly. " * 12, "messages over kvgate's P/D"
    before = _counts(fleet)
    with anthropic.Anthropic(base_url=fleet.url, api_key="x", max_retries=0) as client:
        with client.messages.stream(model=MODEL, max_tokens=9, system=system,
                                    messages=[{"role": "user", "content": question}]) as stream:
            text = "".join(stream.text_stream)
    expected = httpx.post(ref.url + "/v1/messages", json={"model": MODEL, "max_tokens": 9, "system": system,
                                                          "messages": [{"role": "user", "content": question}]},
                          timeout=10).json()["content"][0]["text"]
    assert text == expected
    after = _counts(fleet)
    assert _delta(before, after, "remote_prefills", PREFILLS) == 1 and _delta(before, after, "transfers", DECODES) == 1


def test_responses_through_the_three_steps(fleet: PDStack, ref: PDSim) -> None:
    instructions = "You are terse. " * 20
    before = _counts(fleet)
    before_requests = {n: fleet.requests(n) for n in PREFILLS}
    with openai.OpenAI(base_url=fleet.base_url, api_key="x", max_retries=0) as client:
        raw = client.responses.with_raw_response.create(model=MODEL, instructions=instructions,
                                                        input="responses over P/D", max_output_tokens=8)
        answer = raw.parse()
        mid = _counts(fleet)
        # The decode replica stored it: a continuation is pinned there (never disaggregated).
        follow = client.responses.with_raw_response.create(model=MODEL, input="and then?",
                                                           previous_response_id=answer.id, max_output_tokens=4)
    expected = httpx.post(ref.url + "/v1/responses", json={"model": MODEL, "instructions": instructions,
                                                           "input": "responses over P/D", "max_output_tokens": 8},
                          timeout=10).json()
    assert answer.output_text == expected["output"][0]["content"][0]["text"]
    assert raw.headers["x-kvgate-replica"] in DECODES
    assert follow.headers["x-kvgate-replica"] == raw.headers["x-kvgate-replica"]
    assert follow.parse().status in ("completed", "incomplete")
    after = _counts(fleet)
    after_requests = {n: fleet.requests(n) for n in PREFILLS}
    assert sum(after_requests[n] - before_requests[n] for n in PREFILLS) == 1  # one prefill leg, not stored
    assert _delta(before, mid, "remote_prefills", PREFILLS) == 1 and _delta(before, mid, "transfers", DECODES) == 1
    assert _delta(mid, after, "remote_prefills", PREFILLS) == 0  # the pinned continuation: one leg


def test_every_leg_gives_its_slot_and_lease_back(fleet: PDStack) -> None:
    rt = fleet.runtime
    with openai.OpenAI(base_url=fleet.base_url, api_key="x", max_retries=0) as client:
        for i in range(3):
            client.chat.completions.create(model=MODEL, messages=chat(f"slots {i}"), max_tokens=3)  # type: ignore[arg-type]
    # The client has its last byte a moment before kvgate's relay closes the upstream and lets go.
    assert _eventually(lambda: all(r.in_flight == 0 for r in rt.pool.replicas.values())
                       and rt.pool.active_requests == 0 and rt.pool.budget.active_retries == 0)


def _eventually(predicate: Any, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return bool(predicate())


def test_status_metrics_and_explain_show_the_pd_fleet(fleet: PDStack) -> None:
    with openai.OpenAI(base_url=fleet.base_url, api_key="x", max_retries=0) as client:
        for _ in client.chat.completions.create(model=MODEL, messages=chat("observe me"), max_tokens=3,  # type: ignore
                                                stream=True):
            pass
        # The same prompt again: the prefill side's cache hit, on the prefill replica that holds it.
        client.chat.completions.create(model=MODEL, messages=chat("observe me"), max_tokens=3)  # type: ignore[arg-type]
    status = fleet.admin_get("/admin/status")
    pd = status["disaggregation"]
    assert pd["active"] and pd["mode"] == "always" and pd["replicas"] == {"prefill": 2, "decode": 2}
    assert pd["legs"]["prefill"]["ok"] >= 2 and pd["legs"]["decode"]["ok"] >= 2
    assert pd["decisions"]["remote"] >= 2 and pd["transfer_tokens"] > 0
    assert 0 < pd["prefill_hit_ratio"] < 1
    # A streamed decode leg's time to its first token over the tokens it pulled: the transfer's cost.
    assert pd["learned"]["transfer_samples"] >= 1 and pd["learned"]["transfer_s_per_token"] > 0
    assert {row["name"]: row["role"] for row in status["replicas"]} == ROLES
    metrics = httpx.get(fleet.url + "/metrics", timeout=5).text
    for family in ("kvgate_pd_legs_total{", "kvgate_pd_decisions_total{", "kvgate_pd_prefill_tokens_total{",
                   "kvgate_pd_transfer_tokens_total{"):
        assert family in metrics, family
    explained = fleet.admin_post("/admin/routing/explain", {"body": {"model": MODEL, "messages": chat("why?")}})
    assert explained.status_code == 200, explained.text
    out = explained.json()
    assert {r["replica"] for r in out["replicas"]} == set(DECODES)  # the decode pick's candidates
    assert {r["replica"] for r in out["prefill_replicas"]} == set(PREFILLS)
    pd_row = out["disaggregation"]
    assert pd_row["remote"] is True and pd_row["reason"] in ("always", "remote")
    terms = set(pd_row["terms"])
    assert {"uncached_decode", "uncached_prefill", "rate_decode", "transfer_s_per_token", "leg_s"} <= terms
    assert {"local_s", "stall_s", "remote_s", "threshold", "headroom_s"} <= set(pd_row["figures"])



def test_the_pd_mode_changes_at_run_time_and_the_policy_keeps_what_it_learned(fleet: PDStack) -> None:
    rt, headers = fleet.runtime, {"authorization": "Bearer pd-admin-token"}
    policy = rt.policy
    try:
        r = httpx.patch(fleet.admin.url + "/admin/routing", json={"disaggregation": "selective"}, headers=headers,
                        timeout=5)
        assert r.status_code == 200 and r.json()["disaggregation"] == "selective"
        assert rt.settings.routing.disaggregation == "selective" and rt.policy is policy
        assert fleet.admin_get("/admin/status")["disaggregation"]["mode"] == "selective"
        bad = httpx.patch(fleet.admin.url + "/admin/routing", json={"disaggregation": "sometimes"}, headers=headers,
                          timeout=5)
        assert bad.status_code == 400
    finally:
        httpx.patch(fleet.admin.url + "/admin/routing", json={"disaggregation": "always"}, headers=headers, timeout=5)
    assert rt.settings.routing.disaggregation == "always"
