"""Fault injection and client disconnects, over real HTTP."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import orjson
import pytest

from tests.test_sim_http import Sim, chat, running_sim, sse_events
from tests.test_sim_http import client, shared_sim, sim  # noqa: F401  (fixtures)
from vllm_sim.config import SimConfig
from vllm_sim.faults import Faults
from vllm_sim.timing import TimingModel

STREAM = chat("tell me a story", max_tokens=6, stream=True)


def set_faults(client: httpx.Client, **faults: Any) -> None:
    r = client.post("/sim/faults", json=faults)
    assert r.status_code == 200, r.text


def wait_for(predicate: Any, timeout: float = 1.0) -> float:
    """Seconds until ``predicate()`` is true; fails after ``timeout``."""
    start = time.perf_counter()
    while not predicate():
        if time.perf_counter() - start > timeout:
            raise AssertionError(f"not true within {timeout} s")
        time.sleep(0.005)
    return time.perf_counter() - start


# -- control plane ---------------------------------------------------------------------------------
def test_faults_endpoint_replaces_validates_and_reports(client: httpx.Client) -> None:
    assert client.get("/sim/faults").json() == Faults().as_dict()
    set_faults(client, error_rate=0.5, error_status=503)
    assert client.get("/sim/faults").json()["error_status"] == 503
    set_faults(client)  # an empty body clears every fault
    assert client.get("/sim/faults").json() == Faults().as_dict()
    for bad in ({"error_rate": 2}, {"nope": 1}, {"garbage": "yes"}, {"die_after_tokens": -1},
                {"kv_events_delay_s": -1}, {"kv_events_drop": 1}):
        r = client.post("/sim/faults", json=bad)
        assert r.status_code == 400 and "error" in r.json()


def test_faults_from_config_at_start() -> None:
    config = SimConfig(timing=TimingModel(time_scale=0), faults=Faults(error_rate=1.0, error_status=503))
    with running_sim(config) as s, httpx.Client(base_url=s.url) as c:
        r = c.post("/v1/chat/completions", json=chat("x"))
        assert r.status_code == 503 and r.json()["error"]["code"] == 503
        assert c.get("/health").status_code == 200


# -- whole-response faults -------------------------------------------------------------------------
def test_error_rate_answers_before_any_work(client: httpx.Client, sim: Sim) -> None:
    set_faults(client, error_rate=1.0)
    r = client.post("/v1/chat/completions", json=STREAM)
    assert r.status_code == 500 and r.headers["content-type"] == "application/json"
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert client.post("/v1/embeddings", json={"input": "x"}).status_code == 500
    stats = client.get("/sim/stats").json()
    assert stats["engine_requests"] == 0  # answered before any work
    assert stats["requests"] == 2 and stats["faulted"] == {"error": 2}


def test_error_rate_is_a_fraction(client: httpx.Client) -> None:
    set_faults(client, error_rate=0.5)
    payload = {"prompt": "x", "max_tokens": 1}
    codes = [client.post("/v1/completions", json=payload).status_code for _ in range(60)]
    assert 10 < codes.count(500) < 50 and codes.count(200) == 60 - codes.count(500)


def test_rate_limit_answers_429_with_retry_after(client: httpx.Client) -> None:
    set_faults(client, rate_limit_rate=1.0)
    r = client.post("/v1/completions", json={"prompt": "x"})
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == 429


def test_html_200(client: httpx.Client) -> None:
    set_faults(client, html_200=True)
    r = client.post("/v1/chat/completions", json=chat("x"))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert r.text.lstrip().startswith("<!doctype html>")


def test_unhealthy(client: httpx.Client) -> None:
    set_faults(client, unhealthy=True)
    assert client.get("/health").status_code == 503


# -- per-token faults ------------------------------------------------------------------------------
def _arrivals(client: httpx.Client, payload: dict[str, Any]) -> list[float]:
    start = time.perf_counter()
    out = []
    with client.stream("POST", "/v1/chat/completions", json=payload) as r:
        for line in r.iter_lines():
            if '"content":"' in line and '"content":""' not in line:
                out.append(time.perf_counter() - start)
    return out


def test_stall_before_first_token(client: httpx.Client) -> None:
    set_faults(client, stall_before_first_token_s=0.3)
    arrivals = _arrivals(client, STREAM)
    assert len(arrivals) == 6 and arrivals[0] >= 0.3


def test_stall_mid_stream(client: httpx.Client) -> None:
    set_faults(client, stall_mid_stream_s=0.3, stall_after_tokens=2)
    arrivals = _arrivals(client, STREAM)
    assert len(arrivals) == 6
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    stall = gaps.pop(1)  # between tokens 2 and 3
    assert stall >= 0.29 and max(gaps) < stall - 0.1, (stall, gaps)


def test_die_after_tokens_breaks_the_stream_without_done(client: httpx.Client, sim: Sim) -> None:
    set_faults(client, die_after_tokens=2)
    lines: list[str] = []
    with pytest.raises(httpx.RemoteProtocolError):
        with client.stream("POST", "/v1/chat/completions", json=STREAM) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                lines.append(line)
    events = sse_events(iter(lines))
    assert "[DONE]" not in events
    assert len(events) == 3 and all(e["choices"][0]["delta"]["content"] for e in events[1:])  # role + 2
    wait_for(lambda: sim.replica.engine.stats.aborted == 1)


def test_die_after_tokens_truncates_a_non_streaming_body(client: httpx.Client) -> None:
    set_faults(client, die_after_tokens=2)
    with pytest.raises(httpx.RemoteProtocolError):
        client.post("/v1/chat/completions", json=chat("x", max_tokens=6))


def test_garbage_sse_line_and_malformed_json(client: httpx.Client) -> None:
    set_faults(client, garbage=True)
    with client.stream("POST", "/v1/chat/completions", json=STREAM) as r:
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    bad = []
    for payload in data[:-1]:
        try:
            orjson.loads(payload)
        except orjson.JSONDecodeError:
            bad.append(payload)
    assert len(bad) == 1 and len(data) == 1 + 1 + 6 + 1  # role, garbage, tokens, [DONE]
    r = client.post("/v1/chat/completions", json=chat("x", max_tokens=3))
    assert r.status_code == 200
    with pytest.raises(ValueError):
        r.json()


# -- client disconnects ----------------------------------------------------------------------------
SLOW_PREFILL = TimingModel(prefill_base_s=2.0, decode_base_s=0.02, decode_s_per_seq=0.0)


def _aborted(sim: Sim) -> int:
    return sim.replica.engine.stats.aborted


@pytest.mark.anyio
async def test_disconnect_before_first_token_aborts_promptly() -> None:
    with running_sim(SimConfig(timing=SLOW_PREFILL)) as s:
        async with httpx.AsyncClient(base_url=s.url) as c:
            async with c.stream("POST", "/v1/chat/completions", json=STREAM) as r:
                assert r.status_code == 200
                await asyncio.sleep(0.1)  # in the 2 s prefill
                assert s.replica.engine.num_running == 1
        # Leaving the block closes the connection.
        elapsed = await asyncio.to_thread(wait_for, lambda: _aborted(s) == 1)
        assert elapsed < 1.0
        assert s.replica.engine.num_running == 0 and s.replica.pool.usage == 0
        assert s.replica.engine.stats.aborts[0][0].startswith("chatcmpl-")


@pytest.mark.anyio
async def test_disconnect_mid_stream_aborts_promptly() -> None:
    timing = TimingModel(prefill_base_s=0.0, decode_base_s=0.05, decode_s_per_seq=0.0)
    with running_sim(SimConfig(timing=timing)) as s:
        async with httpx.AsyncClient(base_url=s.url) as c:
            payload = chat("x", max_tokens=200, stream=True)
            async with c.stream("POST", "/v1/chat/completions", json=payload) as r:
                seen = 0
                async for line in r.aiter_lines():
                    seen += '"content":"' in line
                    if seen >= 3:
                        break
        elapsed = await asyncio.to_thread(wait_for, lambda: _aborted(s) == 1)
        assert elapsed < 1.0
        assert s.replica.engine.stats.completed == 0 and s.replica.pool.usage == 0


@pytest.mark.anyio
async def test_disconnect_during_non_streaming_request_aborts_promptly() -> None:
    with running_sim(SimConfig(timing=SLOW_PREFILL)) as s:
        async with httpx.AsyncClient(base_url=s.url, timeout=httpx.Timeout(10, read=0.2)) as c:
            with pytest.raises(httpx.ReadTimeout):
                await c.post("/v1/chat/completions", json=chat("x", max_tokens=3))
        elapsed = await asyncio.to_thread(wait_for, lambda: _aborted(s) == 1)
        assert elapsed < 1.0
        stats = (await asyncio.to_thread(httpx.get, s.url + "/sim/stats")).json()
        assert stats["aborted"] == 1 and stats["running"] == 0 and len(stats["aborts"]) == 1


@pytest.mark.anyio
async def test_disconnect_during_the_first_token_stall_is_an_abort() -> None:
    # A short reply the engine would finish in a few ms: the stall must hold it, not just delay writing.
    faults = Faults(stall_before_first_token_s=5.0)
    with running_sim(SimConfig(timing=TimingModel(time_scale=0), faults=faults)) as s:
        async with httpx.AsyncClient(base_url=s.url, timeout=httpx.Timeout(10, read=0.3)) as c:
            with pytest.raises(httpx.ReadTimeout):
                await c.post("/v1/chat/completions", json=chat("x", max_tokens=2, stream=True))
        elapsed = await asyncio.to_thread(wait_for, lambda: _aborted(s) == 1)
        assert elapsed < 1.0 and s.replica.engine.stats.completed == 0
