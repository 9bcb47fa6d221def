"""Streaming is incremental; disconnects close the upstream; replica faults are handled."""

from __future__ import annotations

import json
import threading
import time
from functools import partial
from typing import Iterator

import httpx
import openai
import pytest

from gateway.proxy.pool import ReplicaPool
from tests.support.stack import MODEL, Stack, start_stack
from vllm_sim.timing import TimingModel

MESSAGES = [{"role": "user", "content": "Tell me a long story about routers."}]
# Slow enough to observe: ~20 ms per decode step.
SLOW = TimingModel(decode_base_s=0.02, decode_s_per_seq=0.0, prefill_base_s=0.0, time_scale=1.0)


@pytest.fixture
def slow_stack() -> Iterator[Stack]:
    s = start_stack(2, sim={"timing": SLOW})
    yield s
    s.close()


def _chat(stack: Stack, **kw: object) -> dict[str, object]:
    return {"model": MODEL, "messages": MESSAGES, **kw}


def test_stream_is_incremental(slow_stack: Stack) -> None:
    client = openai.OpenAI(base_url=slow_stack.base_url, api_key="x", max_retries=0)
    # The SDK imports its chunk types on first use, holding the GIL meanwhile: that stalls the
    # simulator's engine thread, which then catches up in a burst. Warm it up first.
    list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1, stream=True))
    arrivals = []
    t0 = time.perf_counter()
    for _ in client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20, stream=True):
        arrivals.append(time.perf_counter() - t0)
    # 20 tokens at ~20 ms each: the first chunk must not wait for the last.
    assert arrivals[-1] - arrivals[0] > 0.25
    assert arrivals[0] < arrivals[-1] / 2


def _aborts(stack: Stack) -> int:
    return sum(int(stack.sim_stats(n)["aborted"]) for n in stack.sims)


def test_disconnect_mid_stream_aborts_upstream(slow_stack: Stack) -> None:
    with httpx.Client(timeout=10) as c:
        with c.stream("POST", slow_stack.base_url + "/chat/completions",
                      json=_chat(slow_stack, max_tokens=500, stream=True)) as r:
            for _ in r.iter_raw():
                break  # first bytes arrived: now vanish
    t = time.monotonic()
    assert slow_stack.wait_for(lambda: _aborts(slow_stack) == 1, timeout=1.0)
    assert time.monotonic() - t < 1.0


def test_disconnect_before_first_token_aborts_upstream(slow_stack: Stack) -> None:
    for n in slow_stack.sims:
        slow_stack.faults(n, stall_before_first_token_s=5.0)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(slow_stack.base_url + "/chat/completions", json=_chat(slow_stack, stream=True), timeout=0.3)
    assert slow_stack.wait_for(lambda: _aborts(slow_stack) == 1, timeout=1.0)


def test_disconnect_non_streaming_aborts_upstream(slow_stack: Stack) -> None:
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(slow_stack.base_url + "/chat/completions", json=_chat(slow_stack, max_tokens=500), timeout=0.3)
    assert slow_stack.wait_for(lambda: _aborts(slow_stack) == 1, timeout=1.0)


def test_replica_dying_mid_stream_keeps_partial_text_then_error() -> None:
    stack = start_stack(1)
    try:
        stack.faults("r1", die_after_tokens=5)
        client = openai.OpenAI(base_url=stack.base_url, api_key="x", max_retries=0)
        received: list[str] = []
        with pytest.raises(openai.APIError) as e:
            for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=50, stream=True):
                if chunk.choices:
                    received.append(chunk.choices[0].delta.content or "")
                    assert chunk.choices[0].finish_reason is None, "no invented finish_reason"
        assert "".join(received), "the tokens sent before the failure reach the client"
        assert "mid-stream" in str(e.value) or "closed" in str(e.value)
        # Raw bytes: an error event, never [DONE].
        stack.faults("r1", die_after_tokens=3)
        raw = httpx.post(stack.base_url + "/chat/completions", json=_chat(stack, stream=True, max_tokens=50),
                         timeout=10).text
        assert "[DONE]" not in raw and '"error"' in raw
    finally:
        stack.close()


# A retry budget that allows no retry at all: a replica gone takes its load with it, and the one
# retry that moves a request off it needs none (gateway.proxy.upstream.take_retry).
NO_BUDGET = {"retry_budget_ratio": 0.0, "retry_budget_min": 0}


def test_refused_connection_is_retried_elsewhere() -> None:
    stack = start_stack(2, routing={"policy": "least_load"}, pool=NO_BUDGET)
    try:
        stack.sims["r1"].kill()  # least-load prefers r1 (ties break by name); it is now gone
        client = openai.OpenAI(base_url=stack.base_url, api_key="x", max_retries=0)
        raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=3)
        assert raw.headers["x-kvgate-replica"] == "r2"
        assert raw.parse().choices[0].message.content
        assert stack.runtime.pool.replicas["r1"].failures == 1  # r1 was tried first, and refused
    finally:
        stack.close()


def test_a_replica_killed_before_its_first_bytes_needs_no_retry_budget() -> None:
    # The chaos run's replica_killed_midstream, before the first byte: r1 dies with requests in
    # flight that it holds before their first token (a unary answer sends no byte before its end).
    # Round robin puts half of them there; it dies once every request has reached a replica.
    stack = start_stack(2, routing={"policy": "round_robin"}, pool=NO_BUDGET)
    try:
        stack.faults("r1", stall_before_first_token_s=120.0)
        n = 6
        answers: list[httpx.Response] = []

        def ask(i: int) -> None:
            answers.append(httpx.post(stack.base_url + "/chat/completions", timeout=120, json={
                "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": f"held {i}"}]}))
        senders = [threading.Thread(target=ask, args=(i,)) for i in range(n)]
        for t in senders:
            t.start()
        assert stack.wait_for(lambda: sum(stack.sim_stats(r)["engine_requests"] for r in stack.sims) >= n,
                              timeout=60)
        on_r1 = stack.sim_stats("r1")["engine_requests"]
        stack.sims["r1"].kill()
        for t in senders:
            t.join(120)
        assert [r.status_code for r in answers] == [200] * n
        assert all(r.headers["x-kvgate-replica"] == "r2" for r in answers)
        assert all(r.json()["choices"][0]["message"]["content"] for r in answers)
        assert stack.sim_stats("r2")["engine_requests"] == n  # r1's too, each once more
        assert on_r1 >= 1 and stack.runtime.pool.budget.active_retries == 0
    finally:
        stack.close()


def test_replica_answering_5xx_is_ejected_and_returns_when_healthy() -> None:
    # least_load: with both idle it picks r1 first, so the failing replica takes the first two requests.
    stack = start_stack(2, routing={"policy": "least_load"},
                        pool={"eject_consecutive_failures": 2, "eject_base_s": 3.0,
                              "health_interval_s": 0.1, "metrics_interval_s": 60})
    try:
        stack.faults("r1", error_rate=1.0, error_status=500)
        pool = stack.runtime.pool
        statuses = [httpx.post(stack.base_url + "/chat/completions", json=_chat(stack, max_tokens=2),
                               timeout=10).status_code for _ in range(4)]
        assert statuses[:2] == [502, 502]  # r1 failing, not retried (it may have done work)
        assert statuses[2:] == [200, 200]  # r1 ejected, r2 serves
        assert pool.replicas["r1"].ejections == 1
        stack.faults("r1", error_rate=0.0)
        # The ejection (3 s: long enough for the two requests above on a loaded machine) ends.
        assert stack.wait_for(lambda: pool.replicas["r1"].available(pool.clock()), timeout=10)
        served = {httpx.post(stack.base_url + "/chat/completions", json=_chat(stack, max_tokens=2),
                             timeout=10).headers["x-kvgate-replica"] for _ in range(2)}
        assert "r1" in served or pool.replicas["r1"].served > 0
    finally:
        stack.close()


def test_last_replica_is_never_ejected() -> None:
    stack = start_stack(1, pool={"eject_consecutive_failures": 1})
    try:
        stack.faults("r1", error_rate=1.0, error_status=500)
        for _ in range(3):
            assert httpx.post(stack.base_url + "/chat/completions", json=_chat(stack), timeout=10).status_code == 502
        assert stack.runtime.pool.replicas["r1"].ejections == 0
    finally:
        stack.close()


def test_in_flight_returns_to_zero_under_concurrency() -> None:
    stack = start_stack(3)
    try:
        def worker() -> None:
            with httpx.Client(timeout=20) as c:
                for i in range(10):
                    c.post(stack.base_url + "/chat/completions",
                           json=_chat(stack, max_tokens=3, stream=bool(i % 2)))
        threads = [threading.Thread(target=worker) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        pool = stack.runtime.pool
        # A client has read the whole answer a moment before the gateway closes the
        # upstream and releases the replica: "returns to zero", not "is zero already".
        assert stack.wait_for(lambda: all(r.in_flight == 0 for r in pool.replicas.values()), timeout=2.0)
        assert stack.wait_for(lambda: pool.active_requests == 0 and pool.budget.active_retries == 0, timeout=2.0)
    finally:
        stack.close()


def test_a_stream_whose_replica_dies_after_its_headers_is_retried_without_budget() -> None:
    # The chaos run's replica_killed_midstream, for streams: vLLM sends a stream's headers before its
    # first token, so r1 has answered 200 for each of these when it dies, and no byte has reached a
    # client yet (the relay starts the client's response at the first event). Each must get its whole
    # answer from r2, with a retry budget that allows none: the wait for the first event is part of
    # the retry loop (gateway.proxy.upstream), and r1 is gone.
    stack = start_stack(2, routing={"policy": "round_robin"}, pool=NO_BUDGET)
    try:
        n = 6
        prompts = [[{"role": "user", "content": f"streamed and held {i}"}] for i in range(n)]
        expected = [httpx.post(stack.sim_url("r2") + "/v1/chat/completions", timeout=10, json={
            "model": MODEL, "max_tokens": 4, "messages": m}).json()["choices"][0]["message"]["content"]
            for m in prompts]
        stack.faults("r1", stall_before_first_token_s=120.0)
        before = sum(stack.sim_stats(r)["engine_requests"] for r in stack.sims)
        answers: dict[int, tuple[int, str, str | None]] = {}

        def ask(i: int) -> None:
            with httpx.stream("POST", stack.base_url + "/chat/completions", timeout=120, json={
                    "model": MODEL, "max_tokens": 4, "stream": True, "messages": prompts[i]}) as r:
                answers[i] = (r.status_code, r.headers.get("x-kvgate-replica", ""), _streamed_text(r.iter_lines()))
        senders = [threading.Thread(target=ask, args=(i,)) for i in range(n)]
        for t in senders:
            t.start()
        assert stack.wait_for(lambda: sum(stack.sim_stats(r)["engine_requests"] for r in stack.sims) >= before + n,
                              timeout=60)
        on_r1 = stack.sim_stats("r1")["engine_requests"]
        stack.sims["r1"].kill()
        for t in senders:
            t.join(120)
        assert [answers[i] for i in range(n)] == [(200, "r2", expected[i]) for i in range(n)]
        assert on_r1 >= 1 and stack.runtime.pool.budget.active_retries == 0
        assert stack.runtime.pool.replicas["r1"].failures >= on_r1  # each counted against the dead replica
        assert stack.wait_for(partial(_settled, stack.runtime.pool), timeout=2.0)
    finally:
        stack.close()


def _settled(pool: ReplicaPool) -> bool:
    """Every lease, request and retry given back."""
    return (all(r.in_flight == 0 for r in pool.replicas.values()) and pool.active_requests == 0
            and pool.budget.active_retries == 0)


def _streamed_text(lines: Iterator[str]) -> str | None:
    """The content of a chat stream's chunks; None if the stream failed (an error event, or no [DONE])."""
    text = []
    for line in lines:
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            return "".join(text)
        obj = json.loads(line[6:])
        if "error" in obj:
            return None
        text.extend(choice["delta"].get("content") or "" for choice in obj["choices"])
    return None


@pytest.mark.parametrize("fault", [{"die_after_tokens": 0}, {"html_200": True}], ids=["dropped", "html"])
def test_a_stream_failing_after_its_headers_on_a_live_replica_takes_the_retry_budget(fault: dict[str, object]) -> None:
    # r1 answers 200 and then drops the connection before any event, or sends a page that is no
    # event stream. It is alive (a new connection to it is accepted), so the retry is an ordinary
    # one: within the budget it goes to r2, and without budget the client gets the 502.
    prompt = [{"role": "user", "content": "r1 fails after its headers"}]
    for pool, served in (({}, (200, "r2")), (NO_BUDGET, (502, ""))):
        stack = start_stack(2, routing={"policy": "least_load"}, pool=pool)  # r1 first: ties break by name
        try:
            stack.faults("r1", **fault)
            expected = httpx.post(stack.sim_url("r2") + "/v1/chat/completions", timeout=10, json={
                "model": MODEL, "max_tokens": 4, "messages": prompt}).json()["choices"][0]["message"]["content"]
            with httpx.stream("POST", stack.base_url + "/chat/completions", timeout=30, json={
                    "model": MODEL, "max_tokens": 4, "stream": True, "messages": prompt}) as r:
                got = (r.status_code, r.headers.get("x-kvgate-replica", ""))
                text = _streamed_text(r.iter_lines()) if r.status_code == 200 else None
            assert got == served
            assert text == (expected if served[0] == 200 else None)
            replicas = stack.runtime.pool.replicas
            assert replicas["r1"].failures == 1 and replicas["r2"].failures == 0
            assert stack.wait_for(partial(_settled, stack.runtime.pool), timeout=2.0)
        finally:
            stack.close()


def test_an_answer_read_whole_that_is_not_json_is_retried_within_the_budget() -> None:
    # r1 answers a request that is not streamed with a 200 page (an ingress in its place). Nothing
    # reached the client, so within the budget it goes to r2; without budget the client gets a 502.
    prompt = [{"role": "user", "content": "r1 answers a page"}]
    for pool, served in (({}, (200, "r2")), (NO_BUDGET, (502, ""))):
        stack = start_stack(2, routing={"policy": "least_load"}, pool=pool)  # r1 first: ties break by name
        try:
            stack.faults("r1", html_200=True)
            body = {"model": MODEL, "max_tokens": 4, "messages": prompt}
            expected = httpx.post(stack.sim_url("r2") + "/v1/chat/completions", timeout=10, json=body).json()
            r = httpx.post(stack.base_url + "/chat/completions", timeout=30, json=body)
            assert (r.status_code, r.headers.get("x-kvgate-replica", "")) == served
            if r.status_code == 200:
                got = r.json()["choices"][0]["message"]["content"]
                assert got == expected["choices"][0]["message"]["content"]
            else:
                assert r.json()["error"]["type"]  # OpenAI's error shape, not the page
            replicas = stack.runtime.pool.replicas
            assert replicas["r1"].failures == 1 and replicas["r2"].failures == 0
        finally:
            stack.close()
