"""The simulator over real HTTP (uvicorn + httpx + the OpenAI SDK): shapes, prefix cache, metrics."""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import httpx
import openai
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.servers import ServerThread
from vllm_sim.config import SimConfig
from vllm_sim.replica import Replica
from vllm_sim.server import build_app
from vllm_sim.timing import TimingModel

FAST = TimingModel(time_scale=0)


@dataclass
class Sim:
    server: ServerThread
    replica: Replica

    @property
    def url(self) -> str:
        return self.server.url


@contextmanager
def running_sim(config: SimConfig | None = None, **overrides: Any) -> Iterator[Sim]:
    """A simulator under real uvicorn on a loopback port."""
    app = build_app(config or SimConfig(timing=FAST, **overrides))
    server = ServerThread(app)
    server.start()
    try:
        yield Sim(server, app.state.replica)
    finally:
        server.stop()


def sse_events(lines: Iterator[str]) -> list[Any]:
    """Parsed ``data:`` payloads of an SSE body ("[DONE]" kept as a string)."""
    out: list[Any] = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else orjson.loads(data))
    return out


def chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": "sim-model", "messages": [{"role": "user", "content": content}], **extra}


@pytest.fixture(scope="module")
def shared_sim() -> Iterator[Sim]:
    with running_sim() as s:
        yield s


@pytest.fixture
def sim(shared_sim: Sim) -> Sim:
    """The module's simulator, with cache, counters and faults reset (one server start per module)."""
    with httpx.Client(base_url=shared_sim.url) as c:
        c.post("/sim/reset").raise_for_status()
        c.post("/sim/faults", json={}).raise_for_status()
    return shared_sim


@pytest.fixture
def client(sim: Sim) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=sim.url, timeout=10) as c:
        yield c


# -- shapes ----------------------------------------------------------------------------------------
def test_health_models_and_replica_header(client: httpx.Client) -> None:
    health = client.get("/health")
    assert health.status_code == 200 and health.content == b""
    assert health.headers["x-sim-replica"] == "sim"
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    listed = [(m["id"], m["object"], m["max_model_len"]) for m in models["data"]]
    assert listed == [("sim-model", "model", 32768)]


def test_chat_non_streaming_shape(client: httpx.Client) -> None:
    r = client.post("/v1/chat/completions", json=chat("hello there", max_tokens=5, unknown_field=1))
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    body = r.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["model"] == "sim-model" and isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["logprobs"] is None and choice["finish_reason"] == "length"
    assert choice["message"]["role"] == "assistant" and len(choice["message"]["content"].split()) == 5
    usage = body["usage"]
    assert usage["completion_tokens"] == 5
    assert usage["total_tokens"] == usage["prompt_tokens"] + 5
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
    again = client.post("/v1/chat/completions", json=chat("hello there", max_tokens=5)).json()
    assert again["choices"][0]["message"]["content"] == choice["message"]["content"]


def test_default_length_ends_with_stop_and_max_completion_tokens_wins(client: httpx.Client) -> None:
    body = client.post("/v1/chat/completions", json=chat("no limit")).json()
    assert body["choices"][0]["finish_reason"] == "stop"
    assert 16 <= body["usage"]["completion_tokens"] <= 64
    body = client.post("/v1/chat/completions", json=chat("x", max_tokens=9, max_completion_tokens=3)).json()
    assert body["usage"]["completion_tokens"] == 3


def test_completions_accepts_string_list_and_token_ids(client: httpx.Client) -> None:
    for prompt in ("once upon a time", ["once upon a time"], [5, 6, 7], [[5, 6, 7]]):
        r = client.post("/v1/completions", json={"model": "sim-model", "prompt": prompt, "max_tokens": 2})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
        (choice,) = body["choices"]
        assert set(choice) >= {"index", "text", "logprobs", "finish_reason"}
    assert body["usage"]["prompt_tokens"] == 3


def test_n_choices(client: httpx.Client) -> None:
    body = client.post("/v1/chat/completions", json=chat("pick three", max_tokens=2, n=3)).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert body["usage"]["completion_tokens"] == 6


@pytest.mark.parametrize(
    "path,payload,status,param",
    [
        ("/v1/chat/completions", chat("x", model="nope"), 404, "model"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", chat("x", max_tokens=0), 400, "max_tokens"),
        ("/v1/chat/completions", chat("x", max_tokens=40000), 400, "max_tokens"),
        ("/v1/chat/completions", chat("x", stream_options={"include_usage": True}), 400, "stream_options"),
        ("/v1/chat/completions", chat("x", cache_salt=""), 400, "cache_salt"),
        ("/v1/completions", {"prompt": {"a": 1}}, 400, "prompt"),
        ("/v1/embeddings", {"input": "x", "model": "nope"}, 404, "model"),
    ],
)
def test_errors_have_openai_shape(
    client: httpx.Client, path: str, payload: Any, status: int, param: str
) -> None:
    r = client.post(path, json=payload)
    assert r.status_code == status
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["code"] == status and error["message"]
    assert error["type"] == ("NotFoundError" if status == 404 else "BadRequestError")


def test_invalid_json_is_400_and_still_counted_as_received(client: httpx.Client) -> None:
    headers = {"content-type": "application/json"}
    r = client.post("/v1/chat/completions", content=b"{not json", headers=headers)
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
    stats = client.get("/sim/stats").json()
    assert stats["requests"] == 1 and stats["engine_requests"] == 0


# -- streaming -------------------------------------------------------------------------------------
def _stream(client: httpx.Client, path: str, payload: dict[str, Any]) -> tuple[httpx.Response, list[Any]]:
    with client.stream("POST", path, json=payload) as r:
        return r, sse_events(r.iter_lines())


def test_chat_stream_without_usage(client: httpx.Client) -> None:
    r, events = _stream(client, "/v1/chat/completions", chat("stream it", max_tokens=4, stream=True))
    assert r.headers["content-type"].startswith("text/event-stream")
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["finish_reason"] for c in chunks[1:]] == [None, None, None, "length"]
    assert all("usage" not in c and c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    text = "".join(c["choices"][0]["delta"]["content"] for c in chunks[1:])
    unary = client.post("/v1/chat/completions", json=chat("stream it", max_tokens=4)).json()
    assert text == unary["choices"][0]["message"]["content"]


def test_chat_stream_with_include_usage(client: httpx.Client) -> None:
    payload = chat("stream it", max_tokens=3, stream=True, stream_options={"include_usage": True})
    _, events = _stream(client, "/v1/chat/completions", payload)
    *chunks, usage_chunk, done = events
    assert done == "[DONE]"
    assert all(c["usage"] is None for c in chunks)
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 3
    assert usage_chunk["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_completions_stream(client: httpx.Client) -> None:
    payload = {"prompt": "abc", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
    _, events = _stream(client, "/v1/completions", payload)
    *chunks, usage_chunk, done = events
    assert done == "[DONE]" and len(chunks) == 3
    assert all(c["object"] == "text_completion" and c["choices"][0]["logprobs"] is None for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 3


def test_stream_sends_each_token_as_it_is_produced() -> None:
    timing = TimingModel(decode_base_s=0.06, decode_s_per_seq=0, prefill_base_s=0, prefill_s_per_token=0)
    with running_sim(SimConfig(timing=timing)) as s, httpx.Client(base_url=s.url) as c:
        arrivals = []
        start = time.perf_counter()
        payload = {"prompt": "tick", "max_tokens": 5, "stream": True}
        with c.stream("POST", "/v1/completions", json=payload) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    arrivals.append(time.perf_counter() - start)
    assert len(arrivals) == 5
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    assert min(gaps) > 0.03, gaps


# -- prefix cache ----------------------------------------------------------------------------------
def _completion(client: httpx.Client, prompt: Any, **extra: Any) -> dict[str, Any]:
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, **extra})
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def _cached(client: httpx.Client, prompt: Any, **extra: Any) -> int:
    return _completion(client, prompt, **extra)["prompt_tokens_details"]["cached_tokens"]


def test_repeated_prompt_reuses_full_blocks_except_the_last_token(client: httpx.Client) -> None:
    # Rule (vLLM's): a fully cached prompt of P tokens reports (P - 1) // 16 * 16 cached tokens.
    for length in (70, 64, 15, 16, 17):
        ids = list(range(length * 1000, length * 1000 + length))
        assert _cached(client, ids) == 0
        assert _cached(client, ids) == (length - 1) // 16 * 16
    text = "You are a careful assistant. " * 20
    first = client.post("/v1/chat/completions", json=chat(text, max_tokens=1)).json()["usage"]
    second = client.post("/v1/chat/completions", json=chat(text, max_tokens=1)).json()["usage"]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["prompt_tokens_details"]["cached_tokens"] == (second["prompt_tokens"] - 1) // 16 * 16


def test_shared_prefix_hits_only_its_full_blocks(client: httpx.Client) -> None:
    shared = list(range(100))  # 6 full blocks
    _cached(client, shared + [500, 501])
    assert _cached(client, shared + [900, 901, 902]) == 96


def test_cache_salt_isolates_tenants(client: httpx.Client) -> None:
    ids = list(range(200, 264))
    assert _cached(client, ids, cache_salt="tenant-a") == 0
    assert _cached(client, ids, cache_salt="tenant-b") == 0
    assert _cached(client, ids) == 0
    assert _cached(client, ids, cache_salt="tenant-a") == 48


def test_tool_schema_key_order_defeats_the_cache(client: httpx.Client) -> None:
    # Like vLLM, the template dumps tools as sent: reordered keys are a different prompt.
    params = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tool = {"type": "function", "function": {"name": "weather", "description": "Get the weather " * 8,
                                             "parameters": params}}
    reordered = {"function": {"parameters": params, "description": tool["function"]["description"],
                              "name": "weather"}, "type": "function"}

    def cached(tools: list[dict[str, Any]]) -> int:
        body = chat("What is the weather in Paris?", max_tokens=1, tools=tools)
        usage = client.post("/v1/chat/completions", json=body).json()["usage"]
        return usage["prompt_tokens_details"]["cached_tokens"]

    assert cached([tool]) == 0
    assert cached([tool]) > 48
    assert cached([reordered]) == 0


@pytest.mark.anyio
async def test_works_in_process_through_asgi_transport() -> None:
    app = build_app(SimConfig(timing=FAST))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://sim") as c:
        r = await c.post("/v1/chat/completions", json=chat("hi", max_tokens=3))
        assert r.json()["usage"]["completion_tokens"] == 3
        payload = chat("hi", max_tokens=3, stream=True)
        async with c.stream("POST", "/v1/chat/completions", json=payload) as s:
            lines = [line async for line in s.aiter_lines() if line]
        assert lines[-1] == "data: [DONE]" and len(lines) == 5
    await app.state.replica.engine.aclose()


def test_lru_eviction_under_a_small_pool() -> None:
    with running_sim(num_gpu_blocks=16) as s, httpx.Client(base_url=s.url) as c:
        a, b, big = list(range(0, 80)), list(range(1000, 1080)), list(range(5000, 5128))
        _cached(c, a)  # 5 blocks cached
        _cached(c, b)  # 5 more: 10 of 16
        _cached(c, big)  # 8 blocks: evicts the 2 least recently used, a's tail
        assert _cached(c, b) == 64  # recent: all reusable blocks kept (its dup 5th evicts a's 3rd)
        assert _cached(c, a) == 32  # old: only its first 2 blocks survived
        assert s.replica.pool.num_cached_blocks <= 16


def test_sim_reset_clears_cache_and_stats(client: httpx.Client) -> None:
    ids = list(range(64))
    _cached(client, ids)
    stats = client.get("/sim/stats").json()
    assert stats["requests"] == 1 and stats["completed"] == 1 and stats["last_cached_tokens"] == 0
    assert client.post("/sim/reset").status_code == 200
    stats = client.get("/sim/stats").json()
    assert stats["requests"] == 0 and stats["prefix_cache_queries_tokens"] == 0
    assert _cached(client, ids) == 0


# -- metrics ---------------------------------------------------------------------------------------
def _metrics(client: httpx.Client) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    r = client.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def _one(metrics: dict[str, Any], name: str, **labels: str) -> float:
    values = [v for k, v in metrics[name].items() if set(labels.items()) <= set(k)]
    assert len(values) == 1, (name, metrics[name])
    return values[0]


def test_metrics_names_and_counters_move(client: httpx.Client) -> None:
    before = _metrics(client)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:cache_config_info",
                 "vllm:request_success_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total"):
        assert name in before, name
    assert _one(before, "vllm:num_requests_running", model_name="sim-model") == 0
    assert _one(before, "vllm:cache_config_info", block_size="16", num_gpu_blocks="8192") == 1
    ids = list(range(40))
    _cached(client, ids)
    _cached(client, ids)
    after = _metrics(client)
    assert _one(after, "vllm:prefix_cache_queries_total") == 80
    assert _one(after, "vllm:prefix_cache_hits_total") == 32
    assert _one(after, "vllm:prompt_tokens_total") == 80
    assert _one(after, "vllm:generation_tokens_total") == 2
    assert _one(after, "vllm:request_success_total", finished_reason="length") == 2
    assert _one(after, "vllm:kv_cache_usage_perc") == 0


# -- embeddings ------------------------------------------------------------------------------------
def _cos(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b))


def test_embeddings_are_deterministic_unit_vectors_with_meaningful_similarity(client: httpx.Client) -> None:
    texts = ["How do I reset my password on the website?", "How do I reset my password on the site?",
             "Quarterly revenue grew by eleven percent."]
    body = client.post("/v1/embeddings", json={"model": "sim-model", "input": texts}).json()
    vecs = [d["embedding"] for d in body["data"]]
    assert [d["index"] for d in body["data"]] == [0, 1, 2] and body["object"] == "list"
    assert all(len(v) == 64 and math.isclose(math.sqrt(_cos(v, v)), 1.0, rel_tol=1e-9) for v in vecs)
    assert _cos(vecs[0], vecs[1]) > 0.7 > _cos(vecs[0], vecs[2])
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
    single = client.post("/v1/embeddings", json={"input": texts[0]}).json()["data"][0]["embedding"]
    assert single == vecs[0]


# -- the OpenAI SDK --------------------------------------------------------------------------------
def test_openai_sdk_parses_responses_streams_and_embeddings(sim: Sim) -> None:
    with openai.OpenAI(base_url=sim.url + "/v1", api_key="unused", max_retries=0) as sdk:
        messages = [{"role": "user", "content": "Say something about caches."}]
        resp = sdk.chat.completions.create(model="sim-model", messages=messages, max_tokens=6)
        assert resp.choices[0].finish_reason == "length" and resp.usage is not None
        assert resp.usage.completion_tokens == 6 and resp.usage.prompt_tokens_details is not None
        stream = sdk.chat.completions.create(model="sim-model", messages=messages, max_tokens=6, stream=True,
                                             stream_options={"include_usage": True})
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == resp.choices[0].message.content
        assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
        completion = sdk.completions.create(model="sim-model", prompt="abc", max_tokens=2)
        assert completion.choices[0].text
        emb = sdk.embeddings.create(model="sim-model", input=["a b c"])  # the SDK asks for base64
        assert len(emb.data[0].embedding) == 64
        assert [m.id for m in sdk.models.list()] == ["sim-model"]
        with pytest.raises(openai.NotFoundError):
            sdk.chat.completions.create(model="other", messages=messages)
