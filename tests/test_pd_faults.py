"""Faults in a P/D fleet (gateway.proxy.disagg): each fallback path over simulated replicas.

Every answer must equal a plain replica's (the simulator is deterministic): a fault may cost a
leg, never a wrong answer, and no client sees an error a healthy replica could have avoided.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.pd_sims import PDSim, chat, reference_sim
from tests.support.pd_stack import PDStack
from tests.support.stack import MODEL

ROLES = {"p1": "prefill", "p2": "prefill", "d1": "decode", "d2": "decode"}
PREFILLS, DECODES = ("p1", "p2"), ("d1", "d2")
# Enough distinct prompts that routing puts each replica first for some (rendezvous order by
# prompt): the chance that one is never first in 24 is 2^-24.
TRIES = 24


ref = pytest.fixture(scope="module")(reference_sim)


def expected(ref: PDSim, messages: list[dict[str, str]]) -> str:
    r = httpx.post(ref.url + "/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 8},
                   timeout=10)
    return r.json()["choices"][0]["message"]["content"]  # type: ignore[no-any-return]


def ask(stack: PDStack, messages: list[dict[str, str]], stream: bool = True) -> str:
    with openai.OpenAI(base_url=stack.base_url, api_key="x", max_retries=0) as client:
        if not stream:
            return client.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                                  max_tokens=8).choices[0].message.content or ""
        return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=8, stream=True) if c.choices)  # type: ignore[arg-type]


def pd(stack: PDStack, names: tuple[str, ...], key: str) -> int:
    return sum(stack.sims[n].stats()["kv_transfer"][key] for n in names)


@pytest.fixture
def fleet() -> Iterator[PDStack]:
    s = PDStack(ROLES, routing={"disaggregation": "always"}, pool={"eject_consecutive_failures": 100})
    yield s
    s.close()


def until(stack: PDStack, ref: PDSim, tag: str, done: Any, stream: bool | None = None) -> int:
    """Ask distinct questions until ``done()``; every answer must be right. The number asked.
    ``stream``: every question streamed or not (None: every other one)."""
    for i in range(TRIES):
        messages = chat(f"{tag} {i}")
        assert ask(stack, messages, stream=i % 2 == 0 if stream is None else stream) == expected(ref, messages)
        if done():
            return i + 1
    raise AssertionError(f"{tag}: the fault's path was never taken in {TRIES} requests")


def test_a_failing_prefill_replica_is_retried_on_another(fleet: PDStack, ref: PDSim) -> None:
    fleet.faults("p1", error_rate=1.0, error_status=500)
    fallbacks = fleet.runtime.disagg.fallbacks
    asked = until(fleet, ref, "prefill fails", lambda: fallbacks["prefill", "retry"] >= 1)
    # Every request was still prefilled remotely (by p2) and pulled by a decode replica.
    assert pd(fleet, DECODES, "transfers") == asked and fallbacks["prefill", "local"] == 0
    assert fleet.sims["p1"].stats()["kv_transfer"]["remote_prefills"] == 0


def test_every_prefill_replica_failing_falls_back_to_a_local_prefill(fleet: PDStack, ref: PDSim) -> None:
    for name in PREFILLS:
        fleet.faults(name, error_rate=1.0, error_status=500)
    messages = chat("no prefill replica works")
    assert ask(fleet, messages) == expected(ref, messages)
    assert fleet.runtime.disagg.fallbacks["prefill", "local"] == 1
    assert pd(fleet, DECODES, "transfers") == 0  # the decode replica computed the prompt itself


def test_a_decode_replica_failing_before_its_first_byte_is_replaced_and_prefilled_again(
        fleet: PDStack, ref: PDSim) -> None:
    fleet.faults("d1", error_rate=1.0, error_status=500)
    disagg = fleet.runtime.disagg
    asked = until(fleet, ref, "decode fails", lambda: disagg.fallbacks["decode", "retry"] >= 1)
    retries = disagg.fallbacks["decode", "retry"]
    # One prefill leg per request, and one more for each retried decode leg.
    assert pd(fleet, PREFILLS, "remote_prefills") == asked + retries
    assert pd(fleet, ("d2",), "transfers") == asked
    # d1's first refusal looked like a refused pull, so d1 prefilled locally, and failed that too:
    # its own failure. From then on its refusals went straight to the budgeted retry elsewhere.
    assert disagg.fallbacks["decode", "local"] == 1
    assert fleet.runtime.pool.budget.active_retries == 0


def test_a_prefill_replica_killed_is_skipped(fleet: PDStack, ref: PDSim) -> None:
    fleet.sims["p1"].server.stop()
    for i in range(6):
        messages = chat(f"p1 is gone {i}")
        assert ask(fleet, messages) == expected(ref, messages)
    assert pd(fleet, ("p2",), "remote_prefills") == 6 and pd(fleet, DECODES, "transfers") == 6


def test_a_transfer_refused_is_prefilled_locally_on_the_same_decode_replica() -> None:
    # p1 names a side channel nobody listens on: every pull of its blocks fails, and vLLM's
    # default kv_load_failure_policy ("fail") answers 500 before any byte. The decode replica that
    # refused prefills the request itself, as vLLM's "recompute" policy would: no retry elsewhere.
    with PDSim("ref2") as ref:
        stack = PDStack(ROLES, routing={"disaggregation": "always"}, per_sim={"p1": {"side_channel_port": 9}},
                        pool={"eject_consecutive_failures": 100})
        try:
            fallbacks = stack.runtime.disagg.fallbacks
            asked = until(stack, ref, "transfer refused", lambda: fallbacks["decode", "local"] >= 2)
            assert pd(stack, DECODES, "failed_transfers") == fallbacks["decode", "local"]
            assert fallbacks["decode", "retry"] == 0 and stack.runtime.pool.budget.active_retries == 0
            # The others pulled from p2; the refused ones pulled nothing more.
            assert pd(stack, DECODES, "transfers") == asked - fallbacks["decode", "local"]
            assert pd(stack, PREFILLS, "remote_prefills") == asked  # no second prefill leg
        finally:
            stack.close()


def test_refused_transfers_need_no_retry_budget() -> None:
    # The fault's first second in the chaos run (bench.chaos_pd, transfer_refused): many requests
    # carry p1's params at once, past the fleet's retry budget, before p1 is ejected. Here the
    # budget allows no retry at all, and a burst of concurrent requests meets p1's refusals: each
    # must still get its answer, for a healthy decode replica could give it.
    with PDSim("ref4") as ref:
        stack = PDStack(ROLES, routing={"disaggregation": "always"}, per_sim={"p1": {"side_channel_port": 9}},
                        pool={"eject_consecutive_failures": 100, "retry_budget_ratio": 0.0, "retry_budget_min": 0})
        try:
            questions = [chat(f"no budget {i}") for i in range(TRIES)]
            with ThreadPoolExecutor(8) as burst:
                answers = list(burst.map(lambda m: ask(stack, m, stream=len(m[0]["content"]) % 2 == 0),
                                         questions))
            assert answers == [expected(ref, m) for m in questions]
            fallbacks = stack.runtime.disagg.fallbacks
            assert fallbacks["decode", "local"] >= 1, "no request was prefilled by p1: the fault was never met"
            assert pd(stack, DECODES, "failed_transfers") == fallbacks["decode", "local"]
            assert fallbacks["decode", "retry"] == 0 and stack.runtime.pool.budget.active_retries == 0
        finally:
            stack.close()


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_a_decode_replica_killed_before_its_first_bytes_needs_no_retry_budget(stream: bool) -> None:
    # The chaos run's decode_killed (bench.chaos_pd): the busiest decode replica dies with many
    # requests in flight before their first byte, far past the fleet's retry budget. Here the budget
    # allows no retry at all. d2 is drained, so every decode leg goes to d1, which holds each before its
    # first token; once 6 are held, d2 is back and d1 dies. Its requests' load went with it, and a
    # healthy d2 can serve them: each gets its answer, prefilled again (d1 may have pulled the params'
    # blocks: SentAndDropped). A unary answer sends no byte before its end; a stream has had its 200
    # and headers (vLLM sends them before the first token), but no event has reached a client, since
    # the relay starts the client's response at the first event: the wait for it is part of the
    # decode leg's retry.
    held = 6
    with PDSim("ref5") as ref:
        stack = PDStack(ROLES, routing={"disaggregation": "always"},
                        pool={"eject_consecutive_failures": 100, "retry_budget_ratio": 0.0, "retry_budget_min": 0})
        try:
            stack.faults("d1", stall_before_first_token_s=120.0)
            stack.admin_post("/admin/replicas/d2/drain", {}).raise_for_status()
            questions = [chat(f"d1 dies holding {i} ({stream})") for i in range(held)]
            with ThreadPoolExecutor(held) as burst:
                answers = [burst.submit(ask, stack, m, stream) for m in questions]
                deadline = time.monotonic() + 60
                while stack.sims["d1"].stats()["engine_requests"] < held:
                    assert time.monotonic() < deadline, "d1 never held every request"
                    time.sleep(0.05)
                stack.admin_post("/admin/replicas/d2/undrain", {}).raise_for_status()
                stack.sims["d1"].server.kill()
                assert [a.result(timeout=120) for a in answers] == [expected(ref, m) for m in questions]
            disagg = stack.runtime.disagg
            assert disagg.fallbacks["decode", "retry"] == held
            assert pd(stack, PREFILLS, "remote_prefills") == 2 * held
            assert pd(stack, ("d2",), "transfers") == held
            pool = stack.runtime.pool
            assert pool.budget.active_retries == 0
            if stream:
                assert disagg.legs["decode", "failed"] == held
                assert pool.replicas["d1"].failures >= held  # counted against the dead replica
                assert all(r.in_flight == 0 for r in pool.replicas.values())
        finally:
            stack.close()


def test_the_prefill_replica_whose_transfers_fail_is_ejected_not_the_decode_replicas() -> None:
    # The same fault at the default threshold of failures: the 500s the decode replicas give are
    # counted where the params came from, so p1 goes and the decode replicas stay.
    with PDSim("ref3") as ref:
        stack = PDStack(ROLES, routing={"disaggregation": "always"}, per_sim={"p1": {"side_channel_port": 9}},
                        pool={"eject_consecutive_failures": 2, "health_interval_s": 60})
        try:
            pool = stack.runtime.pool
            until(stack, ref, "blamed", lambda: pool.replicas["p1"].ejections >= 1)
            assert [pool.replicas[d].ejections for d in DECODES] == [0, 0]
            for i in range(4):  # and from then on every request pulls from p2, first time
                messages = chat(f"after {i}")
                assert ask(stack, messages) == expected(ref, messages)
            assert all(not pool.replicas[d].ejected(pool.clock()) for d in DECODES)
        finally:
            stack.close()


def test_a_decode_replica_dying_mid_stream_gives_partial_output_then_an_error() -> None:
    stack = PDStack({"p1": "prefill", "d1": "decode"}, routing={"disaggregation": "always"})
    try:
        stack.faults("d1", die_after_tokens=2)
        seen = []
        with openai.OpenAI(base_url=stack.base_url, api_key="x", max_retries=0) as client:
            with pytest.raises(openai.APIError):
                for c in client.chat.completions.create(model=MODEL, messages=chat("die mid-stream"),  # type: ignore
                                                        max_tokens=8, stream=True):
                    if c.choices:
                        seen.append(c.choices[0].delta.content or "")
        assert "".join(seen)  # the client saw bytes: nothing was retried after them
        assert pd(stack, ("p1",), "remote_prefills") == 1
        assert stack.runtime.disagg.fallbacks["decode", "retry"] == 0
    finally:
        stack.close()


def test_a_decode_replica_killed_is_skipped_with_the_same_params(fleet: PDStack, ref: PDSim) -> None:
    fleet.sims["d1"].server.stop()
    for i in range(6):
        messages = chat(f"d1 is gone {i}")
        assert ask(fleet, messages) == expected(ref, messages)
    # One prefill leg each: a refused connection did no work, so the params went on to d2.
    assert pd(fleet, PREFILLS, "remote_prefills") == 6 and pd(fleet, ("d2",), "transfers") == 6


def test_a_prefill_replica_that_times_out_falls_back_to_a_local_prefill() -> None:
    with PDSim("ref3") as ref:
        stack = PDStack({"p1": "prefill", "d1": "decode"}, routing={"disaggregation": "always"},
                        timeouts={"first_byte_s": 0.5})
        try:
            stack.faults("p1", stall_before_first_token_s=3.0)
            messages = chat("the prefill replica is slow")
            assert ask(stack, messages, stream=False) == expected(ref, messages)
            assert stack.runtime.disagg.fallbacks["prefill", "local"] == 1
            assert pd(stack, ("d1",), "transfers") == 0
        finally:
            stack.close()


def test_a_decode_stream_dropped_after_its_headers_by_a_live_replica_is_prefilled_again(
        fleet: PDStack, ref: PDSim) -> None:
    # d1 pulls the params' blocks, answers 200 and drops the connection before any event. It is alive,
    # so the retry takes the budget (there is enough), and it is prefilled again: d1 may have pulled
    # the blocks, which the prefill replica then frees. The failure is d1's, not the prefill replica's.
    fleet.faults("d1", die_after_tokens=0)
    disagg = fleet.runtime.disagg
    asked = until(fleet, ref, "d1 drops streams", lambda: disagg.fallbacks["decode", "retry"] >= 1, stream=True)
    retries = disagg.fallbacks["decode", "retry"]
    assert pd(fleet, PREFILLS, "remote_prefills") == asked + retries
    assert pd(fleet, ("d2",), "transfers") == asked and pd(fleet, ("d1",), "transfers") == retries
    pool = fleet.runtime.pool
    assert pool.replicas["d1"].failures == retries and all(pool.replicas[p].failures == 0 for p in PREFILLS)
    assert pool.budget.active_retries == 0


def test_a_decode_answer_read_whole_that_is_not_json_is_prefilled_again(fleet: PDStack, ref: PDSim) -> None:
    # d1 answers a decode leg that is not streamed with a 200 page (an ingress in its place). The leg
    # carried a prefill replica's params, which are never sent twice: another decode replica, prefilled
    # again, and the failure is d1's.
    fleet.faults("d1", html_200=True)
    disagg = fleet.runtime.disagg
    asked = until(fleet, ref, "d1 answers pages", lambda: disagg.fallbacks["decode", "retry"] >= 1, stream=False)
    retries = disagg.fallbacks["decode", "retry"]
    assert pd(fleet, PREFILLS, "remote_prefills") == asked + retries
    assert pd(fleet, ("d2",), "transfers") == asked
    pool = fleet.runtime.pool
    assert pool.replicas["d1"].failures == retries and all(pool.replicas[p].failures == 0 for p in PREFILLS)


def _decode_legs(stack: PDStack) -> dict[tuple[str, str], float]:
    """kvgate_pd_legs_total for the decode role, by (replica, outcome), as /metrics shows it."""
    legs: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(httpx.get(stack.url + "/metrics", timeout=5).text):
        for sample in family.samples:
            if sample.name == "kvgate_pd_legs_total" and sample.labels["role"] == "decode":
                legs[sample.labels["replica"], sample.labels["outcome"]] = sample.value
    return legs


def test_a_decode_stream_without_a_first_event_in_time_is_a_504_and_a_failed_leg() -> None:
    # d1 pulls the params' blocks, sends its stream's headers and no event within first_byte_s: the
    # client's 504, not retried (d1 may be working on it), and in /metrics a decode leg that failed.
    stack = PDStack({"p1": "prefill", "d1": "decode", "d2": "decode"}, routing={"disaggregation": "always"},
                    timeouts={"first_byte_s": 0.5}, pool={"eject_consecutive_failures": 100})
    try:
        stack.faults("d1", stall_before_first_token_s=3.0)
        stack.faults("d2", stall_before_first_token_s=3.0)
        r = httpx.post(stack.base_url + "/chat/completions", timeout=10, json={
            "model": MODEL, "messages": chat("no first event in time"), "max_tokens": 8, "stream": True})
        assert r.status_code == 504 and r.json()["error"]["code"] == "upstream_timeout"
        legs = _decode_legs(stack)
        assert sum(n for (_, outcome), n in legs.items() if outcome == "failed") == 1
        assert sum(n for (_, outcome), n in legs.items() if outcome == "ok") == 0
        assert stack.runtime.disagg.fallbacks["decode", "retry"] == 0
    finally:
        stack.close()


def test_a_decode_leg_dropped_on_its_last_try_is_a_failed_leg() -> None:
    # Both decode replicas answer 200 and drop the stream before any event: the first drop is retried
    # on the other (prefilled again), the second is the client's 502. Both legs failed.
    stack = PDStack(ROLES, routing={"disaggregation": "always"}, pool={"eject_consecutive_failures": 100})
    try:
        for name in DECODES:
            stack.faults(name, die_after_tokens=0)
        r = httpx.post(stack.base_url + "/chat/completions", timeout=10, json={
            "model": MODEL, "messages": chat("every decode leg drops"), "max_tokens": 8, "stream": True})
        assert r.status_code == 502
        assert _decode_legs(stack) == {("d1", "failed"): 1.0, ("d2", "failed"): 1.0}
        assert stack.runtime.disagg.fallbacks["decode", "retry"] == 1
    finally:
        stack.close()
