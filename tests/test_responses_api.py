"""The Responses API through kvgate, with the official OpenAI SDK over real ports.

Stateful affinity is tested the way a fleet runs it: two kvgate instances that
share nothing but their configuration, in front of the same simulated replicas.
"""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import httpx
import openai
import pytest

from gateway.app import build_app
from gateway.runtime import Runtime
from gateway.settings import load_settings
from tests.support.servers import ServerThread
from tests.support.stack import MODEL, Stack, start_stack
from vllm_sim.timing import TimingModel

INSTRUCTIONS = "You are a coding agent. Follow the repository's style guide. " * 12
TOOLS = [{"type": "function", "name": "read_file", "description": "Read a file",
          "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}]
SLOW = TimingModel(decode_base_s=0.02, decode_s_per_seq=0.0, prefill_base_s=0.0, time_scale=1.0)
# A replica's own id, as vLLM makes them: it must never reach a client.
RAW_ID = re.compile(r'"resp_[0-9a-f]{32}"')


def _gateway(stack: Stack, **overrides: Any) -> ServerThread:
    """Another kvgate instance over the same replicas, sharing only configuration."""
    base: dict[str, Any] = {"replicas": [{"name": k, "url": v.url} for k, v in stack.sims.items()],
                            "routing": {"policy": "round_robin"},
                            "pool": {"health_interval_s": 60, "metrics_interval_s": 60},
                            "server_secret": "fleet-secret"}
    settings = load_settings(environ={}, overrides={**base, **overrides})
    return ServerThread(build_app(settings, runtime=Runtime(settings))).start()


@pytest.fixture(scope="module")
def fleet() -> Iterator[tuple[Stack, ServerThread]]:
    s = start_stack(3, routing={"policy": "round_robin"}, server_secret="fleet-secret",
                    tenants=[{"name": "acme", "api_keys": ["sk-acme"]}, {"name": "other", "api_keys": ["sk-other"]}])
    b = _gateway(s, tenants=[{"name": "acme", "api_keys": ["sk-acme"]}, {"name": "other", "api_keys": ["sk-other"]}])
    yield s, b
    b.stop()
    s.close()


def _client(url: str, key: str = "sk-acme") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


def test_create_non_streaming(fleet: tuple[Stack, ServerThread]) -> None:
    stack, _ = fleet
    raw = _client(stack.url).responses.with_raw_response.create(model=MODEL, input="Say hello.",
                                                                instructions=INSTRUCTIONS, max_output_tokens=6)
    r = raw.parse()
    assert r.id.startswith("resp_kg1.") and r.object == "response"
    assert r.status == "incomplete" and r.output_text  # cut at max_output_tokens, as vLLM reports it
    assert r.usage is not None and r.usage.output_tokens == 6 and r.usage.input_tokens > 0
    assert raw.headers["x-kvgate-replica"] in stack.sims
    assert not RAW_ID.search(raw.http_response.text)


def test_create_streaming_relays_events_with_kvgate_ids(fleet: tuple[Stack, ServerThread]) -> None:
    stack, _ = fleet
    events = list(_client(stack.url).responses.create(model=MODEL, input="Stream a story.", stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-1] == "response.completed" and "response.output_text.delta" in kinds
    ids = {e.response.id for e in events if hasattr(e, "response")}
    assert len(ids) == 1 and next(iter(ids)).startswith("resp_kg1.")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text and events[-1].response.output_text == text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    raw = httpx.post(stack.base_url + "/responses", json={"model": MODEL, "input": "x", "stream": True},
                     headers={"authorization": "Bearer sk-acme"}, timeout=10)
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert not RAW_ID.search(raw.text) and "[DONE]" not in raw.text


def test_previous_response_id_across_two_instances(fleet: tuple[Stack, ServerThread]) -> None:
    stack, b = fleet
    a_client, b_client = _client(stack.url), _client(b.url)
    first = a_client.responses.with_raw_response.create(model=MODEL, input="Read README.md", tools=TOOLS,
                                                        instructions=INSTRUCTIONS, max_output_tokens=8)
    home, prev = first.headers["x-kvgate-replica"], first.parse()
    # B round-robins: without the pin these turns would visit every replica.
    for turn in range(4):
        client = b_client if turn % 2 == 0 else a_client
        raw = client.responses.with_raw_response.create(model=MODEL, input=f"Next step {turn}", tools=TOOLS,
                                                        instructions=INSTRUCTIONS, previous_response_id=prev.id,
                                                        max_output_tokens=8)
        assert raw.headers["x-kvgate-replica"] == home
        r = raw.parse()
        assert r.previous_response_id == prev.id
        assert r.usage is not None and r.usage.input_tokens_details.cached_tokens > 0  # the history is cached
        prev = r
    got = b_client.responses.retrieve(prev.id)
    assert got.id == prev.id and got.output_text == prev.output_text


def test_another_secret_or_tenant_cannot_use_the_id(fleet: tuple[Stack, ServerThread]) -> None:
    stack, _ = fleet
    r = _client(stack.url).responses.create(model=MODEL, input="hi", max_output_tokens=2)
    stranger = _gateway(stack, server_secret="another-secret")
    try:
        with pytest.raises(openai.NotFoundError) as e:
            _client(stranger.url).responses.retrieve(r.id)
        assert e.value.code == "response_not_found"
    finally:
        stranger.stop()
    with pytest.raises(openai.NotFoundError) as e:
        _client(stack.url, "sk-other").responses.create(model=MODEL, input="x", previous_response_id=r.id)
    assert e.value.code == "response_not_found"


def _forgeries(client_id: str) -> list[str]:
    _, replica, upstream, tag = client_id.split(".")
    other = "cjI" if replica != "cjI" else "cjE"  # base64url of "r2" / "r1": steer to another replica
    flipped = tag[:-2] + ("A" if tag[-2] != "A" else "B") + tag[-1]
    return [f"resp_kg1.{other}.{upstream}.{tag}", f"resp_kg1.{replica}.{upstream}.{flipped}",
            f"resp_kg1.{replica}.{upstream}", "resp_" + "0" * 32, "resp_kg1.!!.??.**", "x" * 600]


def test_forged_or_garbled_ids_are_404(fleet: tuple[Stack, ServerThread]) -> None:
    stack, _ = fleet
    client = _client(stack.url)
    r = client.responses.create(model=MODEL, input="hi", max_output_tokens=2)
    before = sum(stack.sim_stats(n)["requests"] for n in stack.sims)
    for forged in _forgeries(r.id):
        calls = (lambda f: client.responses.retrieve(f), lambda f: client.responses.cancel(f),
                 lambda f: client.responses.create(model=MODEL, input="x", previous_response_id=f))
        for call in calls:
            with pytest.raises(openai.NotFoundError) as e:
                call(forged)
            assert e.value.code == "response_not_found"
            assert e.value.body["type"] == "invalid_request_error"  # type: ignore[index]
    assert sum(stack.sim_stats(n)["requests"] for n in stack.sims) == before, "a forgery reaches no replica"


def test_background_retrieve_and_cancel() -> None:
    stack = start_stack(2, sim={"timing": SLOW})
    try:
        client = _client(stack.url)
        r = client.responses.create(model=MODEL, input="A long job.", background=True, store=True,
                                    max_output_tokens=500)
        assert r.status == "queued" and r.id.startswith("resp_kg1.")
        time.sleep(0.1)
        assert client.responses.retrieve(r.id).status == "in_progress"
        cancelled = client.responses.cancel(r.id)
        assert cancelled.status == "cancelled" and cancelled.id == r.id
        assert client.responses.retrieve(r.id).status == "cancelled"
        assert sum(int(stack.sim_stats(n)["aborted"]) for n in stack.sims) == 1
        # A synchronous response cannot be cancelled: the replica's own 400 comes through.
        done = client.responses.create(model=MODEL, input="quick", max_output_tokens=2)
        with pytest.raises(openai.BadRequestError):
            client.responses.cancel(done.id)
    finally:
        stack.close()


def test_replica_gone_is_a_clear_error() -> None:
    stack = start_stack(2)
    try:
        client = _client(stack.url)
        raw = client.responses.with_raw_response.create(model=MODEL, input="hi", max_output_tokens=2)
        home, r = raw.headers["x-kvgate-replica"], raw.parse()
        stack.sims[home].kill()
        with pytest.raises(openai.InternalServerError) as e:  # 503: it may come back
            client.responses.create(model=MODEL, input="more", previous_response_id=r.id)
        assert e.value.status_code == 503 and e.value.code == "response_replica_unavailable"
        with pytest.raises(openai.InternalServerError) as e:
            client.responses.retrieve(r.id)
        assert e.value.code == "response_replica_unavailable"
        # A fresh conversation still works: it goes to the replica that is left.
        assert client.responses.create(model=MODEL, input="new", max_output_tokens=2).status == "incomplete"
        stack.runtime.pool.remove(home)
        with pytest.raises(openai.NotFoundError) as e:  # 404: it left the pool, the response is gone
            client.responses.create(model=MODEL, input="more", previous_response_id=r.id)
        assert e.value.code == "response_replica_unavailable"
    finally:
        stack.close()


BAD = [
    ({"input": "x"}, "model"),
    ({"model": MODEL}, "input"),
    ({"model": MODEL, "input": 3}, "input"),
    ({"model": MODEL, "input": []}, "input"),
    ({"model": MODEL, "input": [1]}, "input.0"),
    ({"model": MODEL, "input": [{"role": "robot", "content": "x"}]}, "input.0.role"),
    ({"model": MODEL, "input": [{"role": "user", "content": 5}]}, "input.0.content"),
    ({"model": MODEL, "input": "x", "stream": "yes"}, "stream"),
    ({"model": MODEL, "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"model": MODEL, "input": "x", "tools": "read_file"}, "tools"),
    ({"model": MODEL, "input": "x", "instructions": 5}, "instructions"),
    ({"model": MODEL, "input": "x", "previous_response_id": 5}, "previous_response_id"),
    ({"model": MODEL, "input": "x", "background": True, "store": False}, "background"),
]


@pytest.mark.parametrize(("body", "param"), BAD)
def test_bad_input_is_an_openai_400(fleet: tuple[Stack, ServerThread], body: dict[str, Any], param: str) -> None:
    stack, _ = fleet
    r = httpx.post(stack.base_url + "/responses", json=body, headers={"authorization": "Bearer sk-acme"},
                   timeout=10)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


def test_bad_json_and_sdk_error_class(fleet: tuple[Stack, ServerThread]) -> None:
    stack, _ = fleet
    r = httpx.post(stack.base_url + "/responses", content=b"{nope", headers={"authorization": "Bearer sk-acme",
                                                                             "content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    with pytest.raises(openai.BadRequestError):
        _client(stack.url).responses.create(model=MODEL, input=[])


def test_disconnect_mid_stream_aborts_upstream() -> None:
    stack = start_stack(2, sim={"timing": SLOW})
    try:
        with httpx.Client(timeout=10) as c:
            with c.stream("POST", stack.base_url + "/responses",
                          json={"model": MODEL, "input": "long", "stream": True, "max_output_tokens": 500}) as r:
                for chunk in r.iter_raw():
                    if b"output_text.delta" in chunk:
                        break  # tokens are flowing: now vanish
        t = time.monotonic()
        assert stack.wait_for(lambda: sum(int(stack.sim_stats(n)["aborted"]) for n in stack.sims) == 1,
                              timeout=1.0)
        assert time.monotonic() - t < 1.0
    finally:
        stack.close()


def test_replica_dying_mid_stream_ends_with_an_error_event() -> None:
    stack = start_stack(1)
    try:
        stack.faults("r1", die_after_tokens=5)
        events = list(_client(stack.url, "x").responses.create(model=MODEL, input="story", stream=True,
                                                               max_output_tokens=50))
        kinds = [e.type for e in events]
        assert kinds.count("response.output_text.delta") == 5, "the tokens sent before the failure arrive"
        assert kinds[-1] == "error" and "response.completed" not in kinds and "response.incomplete" not in kinds
        assert events[-1].sequence_number == events[-2].sequence_number + 1
        # Recorded once the relay returns, just after the client has read the last byte.
        assert stack.wait_for(lambda: stack.runtime.pool.replicas["r1"].failures >= 1), \
            "a cut stream counts against the replica"
    finally:
        stack.close()


NO_BUDGET = {"retry_budget_ratio": 0.0, "retry_budget_min": 0}


def _answer_of(stack: Stack, replica: str, prompt: str) -> str:
    """What ``replica`` answers to ``prompt`` with 4 output tokens (the simulator answers a prompt alike everywhere)."""
    obj = httpx.post(stack.sim_url(replica) + "/v1/responses", timeout=10, json={
        "model": MODEL, "input": prompt, "max_output_tokens": 4, "store": False}).json()
    return str(obj["output"][0]["content"][0]["text"])


def _streamed(stack: Stack, prompt: str) -> tuple[str, list[str], str | None, str]:
    """A stream through kvgate with the SDK: the replica that served it, the event types, the text of
    the terminal event (None if there was none) and the replica that stored the response its id names."""
    raw = _client(stack.url, "x").responses.with_raw_response.create(
        model=MODEL, input=prompt, stream=True, max_output_tokens=4)
    events = list(raw.parse())
    ids = {e.response.id for e in events if hasattr(e, "response")}
    assert len(ids) == 1, "one response, created and ended by one replica"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    end = events[-1]
    text = end.response.output_text if end.type in ("response.completed", "response.incomplete") else None
    stored = _client(stack.url, "x").responses.with_raw_response.retrieve(next(iter(ids)))
    return raw.headers["x-kvgate-replica"], [e.type for e in events], text, stored.headers["x-kvgate-replica"]


def test_a_stream_whose_replica_dies_before_its_first_token_is_retried_without_budget() -> None:
    # vLLM sends response.created and response.in_progress before prefill. kvgate holds them back
    # until the first event after them, so when r1 dies holding these requests in prefill nothing
    # has reached a client: each is retried on r2, without budget as r1 is gone, and the client
    # sees r2's own events from its response.created on, with r2's response id.
    stack = start_stack(2, routing={"policy": "round_robin"}, pool=NO_BUDGET)
    try:
        n = 4
        prompts = [f"held in prefill {i}" for i in range(n)]
        expected = [_answer_of(stack, "r2", p) for p in prompts]
        stack.faults("r1", stall_before_first_token_s=120.0)
        before = sum(stack.sim_stats(r)["engine_requests"] for r in stack.sims)
        with ThreadPoolExecutor(n) as clients:
            answers = [clients.submit(_streamed, stack, p) for p in prompts]
            assert stack.wait_for(lambda: sum(stack.sim_stats(r)["engine_requests"] for r in stack.sims)
                                  >= before + n, timeout=60)
            on_r1 = stack.sim_stats("r1")["engine_requests"]
            stack.sims["r1"].kill()
            got = [a.result(timeout=120) for a in answers]
        for (replica, kinds, text, stored_on), want in zip(got, expected):
            assert (replica, stored_on, text) == ("r2", "r2", want)
            assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
            assert kinds[-1] == "response.incomplete" and "error" not in kinds
        pool = stack.runtime.pool
        assert on_r1 >= 1 and pool.replicas["r1"].failures >= on_r1
        assert stack.wait_for(lambda: pool.budget.active_retries == 0 and pool.active_requests == 0
                              and all(r.in_flight == 0 for r in pool.replicas.values()), timeout=2.0)
    finally:
        stack.close()


def test_a_stream_dropped_after_its_lifecycle_events_by_a_live_replica_takes_the_retry_budget() -> None:
    # r1 sends response.created and response.in_progress, then drops the connection. It is alive, so
    # the retry is an ordinary one: within the budget r2 serves the stream whole, and without budget
    # the client gets a plain 502, not a stream that starts and fails.
    prompt = "r1 drops it after response.created"
    for pool, served in (({}, "r2"), (NO_BUDGET, None)):
        stack = start_stack(2, routing={"policy": "least_load"}, pool=pool)  # r1 first: ties break by name
        try:
            stack.faults("r1", die_after_tokens=0)
            if served is None:
                with pytest.raises(openai.InternalServerError) as e:
                    _streamed(stack, prompt)
                assert e.value.status_code == 502
            else:
                replica, kinds, text, stored_on = _streamed(stack, prompt)
                assert (replica, stored_on, text) == ("r2", "r2", _answer_of(stack, "r2", prompt))
                assert kinds[0] == "response.created" and kinds.count("response.created") == 1
            replicas = stack.runtime.pool.replicas
            assert replicas["r1"].failures == 1 and replicas["r2"].failures == 0
        finally:
            stack.close()


def test_prefix_routing_and_usage_feed_metrics() -> None:
    stack = start_stack(3, routing={"policy": "prefix_affinity"})
    try:
        client = _client(stack.url, "x")
        homes, cached = set(), []
        for i in range(6):
            raw = client.responses.with_raw_response.create(model=MODEL, input=f"task {i}", tools=TOOLS,
                                                            instructions=INSTRUCTIONS, max_output_tokens=2)
            homes.add(raw.headers["x-kvgate-replica"])
            usage = raw.parse().usage
            assert usage is not None
            cached.append(usage.input_tokens_details.cached_tokens)
        assert len(homes) == 1, "the shared instructions + tools head keeps them on one replica"
        assert all(c > 0 for c in cached[1:])
        metrics = httpx.get(stack.url + "/metrics").text
        assert re.search(r'kvgate_requests_total\{endpoint="responses"[^}]*status="200"[^}]*\} 6', metrics)
        assert re.search(r'kvgate_tokens_total\{kind="cached"[^}]*\} [1-9]', metrics)
    finally:
        stack.close()


def test_ttft_is_the_first_token_not_response_created() -> None:
    stack = start_stack(1)
    try:
        stack.faults("r1", stall_before_first_token_s=0.5)  # response.created goes out at once, tokens later
        events = list(_client(stack.url, "x").responses.create(model=MODEL, input="hi", stream=True,
                                                               max_output_tokens=3))
        assert events[-1].type == "response.incomplete"
        metrics = httpx.get(stack.url + "/metrics").text
        ttft = re.search(r'kvgate_time_to_first_token_seconds_sum\{endpoint="responses"\} ([0-9.e+-]+)', metrics)
        assert ttft is not None and float(ttft.group(1)) >= 0.5
    finally:
        stack.close()


def test_semantic_cache_is_bypassed_with_its_reason() -> None:
    stack = start_stack(1, semantic_cache={"enabled": True, "embedder": "hash",
                                           "key_prefix": f"kvgate:test:{time.monotonic_ns()}:"})
    try:
        client = _client(stack.url, "x")
        for stream in (False, False, True, True):
            raw = client.responses.with_raw_response.create(model=MODEL, input="What is prefix caching?",
                                                            instructions="Be terse.", stream=stream)
            assert raw.headers["x-kvgate-cache"] == "bypass" and raw.headers["x-kvgate-replica"] == "r1"
        assert int(stack.sim_stats("r1")["engine_requests"]) == 4, "every repeat reached the replica"
        metrics = httpx.get(stack.url + "/metrics").text
        assert re.search(r'kvgate_semantic_cache_bypasses_total\{reason="responses_stateful"\} 4', metrics)
    finally:
        stack.close()


def test_hygiene_warns_about_a_timestamp_in_the_instructions() -> None:
    stack = start_stack(1, tenants=[{"name": "acme", "api_keys": ["sk-acme"]}])
    try:
        raw = _client(stack.url).responses.with_raw_response.create(
            model=MODEL, input="hi", max_output_tokens=2,
            instructions="You are a coding agent. Current time: 2026-12-01T11:52:03Z. " + INSTRUCTIONS)
        assert raw.headers["x-kvgate-prefix-warning"] == "timestamp"
        clean = _client(stack.url).responses.with_raw_response.create(model=MODEL, input="hi", max_output_tokens=2,
                                                                      instructions=INSTRUCTIONS)
        assert "x-kvgate-prefix-warning" not in clean.headers
    finally:
        stack.close()


def test_tenants_do_not_share_kv_through_responses() -> None:
    stack = start_stack(1, tenants=[{"name": "a", "api_keys": ["sk-a"]}, {"name": "b", "api_keys": ["sk-b"]}])
    try:
        def cached(key: str) -> int:
            r = _client(stack.url, key).responses.create(model=MODEL, input="hi", instructions=INSTRUCTIONS,
                                                         max_output_tokens=2)
            assert r.usage is not None
            return r.usage.input_tokens_details.cached_tokens
        assert cached("sk-a") == 0 and cached("sk-a") > 0
        assert cached("sk-b") == 0, "B's identical prompt hits none of A's blocks (cache_salt per tenant)"
    finally:
        stack.close()


def test_unhealthy_home_is_a_503_without_asking_it() -> None:
    stack = start_stack(2, pool={"health_interval_s": 0.05, "metrics_interval_s": 60})
    try:
        client = _client(stack.url)
        raw = client.responses.with_raw_response.create(model=MODEL, input="hi", max_output_tokens=2)
        home, r = raw.headers["x-kvgate-replica"], raw.parse()
        stack.faults(home, unhealthy=True)
        assert stack.wait_for(lambda: stack.runtime.pool.replicas[home].healthy is False, timeout=3)
        before = stack.sim_stats(home)["requests"]
        with pytest.raises(openai.InternalServerError) as e:
            client.responses.create(model=MODEL, input="more", previous_response_id=r.id)
        assert e.value.status_code == 503 and e.value.code == "response_replica_unavailable"
        assert e.value.response.headers["retry-after"] == "1"
        assert stack.sim_stats(home)["requests"] == before
    finally:
        stack.close()
