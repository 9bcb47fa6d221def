"""The utility, pooling and audio routes end to end: httpx and the openai SDK -> kvgate -> vllm_sim, real ports."""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import httpx
import openai
import orjson
import pytest

from gateway.app import build_app
from gateway.settings import load_settings
from tests.support.servers import ServerThread
from tests.support.stack import MODEL, Stack, start_stack
from vllm_sim.audio import synthetic_wav, transcript
from vllm_sim.faults import Faults
from vllm_sim.timing import TimingModel


def wav(seconds: float = 1.5) -> bytes:
    return synthetic_wav(seconds)


JSON_ROUTES: list[tuple[str, str, dict[str, Any], str]] = [
    ("/tokenize", "tokenize", {"prompt": "Hello there, world"}, "tokens"),
    ("/tokenize", "tokenize", {"messages": [{"role": "user", "content": "hi"}]}, "tokens"),
    ("/detokenize", "detokenize", {"tokens": [1, 2, 3]}, "prompt"),
    ("/rerank", "rerank", {"query": "rain falls", "documents": ["rain falls today", "cats"]}, "results"),
    ("/v1/rerank", "rerank", {"query": "rain falls", "documents": ["rain falls today", "cats"]}, "results"),
    ("/v2/rerank", "rerank", {"query": "rain falls", "documents": ["rain falls today", "cats"]}, "results"),
    ("/score", "score", {"queries": "rain falls", "documents": ["rain falls", "sun"]}, "data"),
    ("/v1/score", "score", {"text_1": "rain falls", "text_2": ["rain falls", "sun"]}, "data"),
    ("/pooling", "pooling", {"input": ["a b c", "d e"]}, "data"),
    ("/classify", "classify", {"input": "a fine product"}, "data"),
]


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    s = start_stack(2)
    try:
        yield s
    finally:
        s.close()


@pytest.mark.parametrize("path,name,body,key", JSON_ROUTES, ids=[f"{r[0]}:{i}" for i, r in enumerate(JSON_ROUTES)])
def test_json_route_reaches_a_replica_and_is_counted_by_endpoint(
        stack: Stack, path: str, name: str, body: dict[str, Any], key: str) -> None:
    r = httpx.post(stack.url + path, json={"model": MODEL, **body}, timeout=10)
    assert r.status_code == 200, r.text
    assert key in r.json()
    assert r.headers["x-kvgate-replica"] in stack.sims
    metrics = httpx.get(stack.url + "/metrics", timeout=5).text
    assert f'kvgate_requests_total{{endpoint="{name}",replica="{r.headers["x-kvgate-replica"]}"' in metrics


def test_scores_are_the_replicas_and_rerank_keeps_top_n(stack: Stack) -> None:
    r = httpx.post(stack.url + "/rerank", timeout=10, json={
        "model": MODEL, "query": "rain falls", "documents": ["cats", "rain falls"], "top_n": 1})
    (best,) = r.json()["results"]
    assert best["index"] == 1 and best["document"]["text"] == "rain falls" and best["relevance_score"] == 1.0
    scores = httpx.post(stack.url + "/score", timeout=10, json={
        "model": MODEL, "queries": "rain falls", "documents": ["rain falls", "sun"]}).json()["data"]
    assert scores[0]["score"] == 1.0 > scores[1]["score"]


def test_tokenize_then_detokenize_on_one_replica_round_trips() -> None:
    stack = start_stack(1)
    try:
        text = "Tokenization round trip, once more."
        tokens = httpx.post(stack.url + "/tokenize", json={"model": MODEL, "prompt": text}, timeout=10).json()
        assert tokens["count"] == len(tokens["tokens"]) > 0
        back = httpx.post(stack.url + "/detokenize", json={"model": MODEL, "tokens": tokens["tokens"]}, timeout=10)
        assert back.json() == {"prompt": text}
    finally:
        stack.close()


def test_audio_with_the_openai_sdk(stack: Stack) -> None:
    client = openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0)
    audio = wav()
    words = " ".join(transcript(audio))
    got = client.audio.transcriptions.create(model=MODEL, file=("a.wav", audio, "audio/wav"))
    assert got.text == words
    verbose = client.audio.transcriptions.create(model=MODEL, file=("a.wav", audio), response_format="verbose_json")
    assert verbose.text == words and float(verbose.duration) == 1.5
    # vLLM streams chat-like transcription.chunk events, which the SDK yields as loose objects.
    events = [e.model_dump() for e in client.audio.transcriptions.create(model=MODEL, file=("a.wav", audio),
                                                                         stream=True)]
    assert "".join(e["choices"][0]["delta"]["content"] for e in events) == words
    # The SDK marks audio.translations deprecated (warnings are errors here): plain httpx for that one.
    translated = httpx.post(stack.base_url + "/audio/translations", data={"model": MODEL}, timeout=10,
                            files={"file": ("a.wav", audio, "audio/wav")})
    assert translated.json() == {"text": words}
    metrics = httpx.get(stack.url + "/metrics", timeout=5).text
    assert 'kvgate_requests_total{endpoint="transcriptions"' in metrics
    assert 'kvgate_requests_total{endpoint="translations"' in metrics


def test_streamed_transcription_passes_through_event_by_event(stack: Stack) -> None:
    audio = wav(2.0)
    with httpx.stream("POST", stack.url + "/v1/audio/transcriptions", timeout=10,
                      data={"model": MODEL, "stream": "true", "stream_include_usage": "true"},
                      files={"file": ("a.wav", audio, "audio/wav")}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"]["content"] for c in chunks if c["choices"])
    assert text == " ".join(transcript(audio))
    assert chunks[-1]["usage"]["completion_tokens"] == len(transcript(audio))


def test_unknown_model_is_an_openai_404(stack: Stack) -> None:
    r = httpx.post(stack.url + "/rerank", json={"model": "nope", "query": "q", "documents": ["d"]}, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(stack.url + "/v1/audio/transcriptions", data={"model": "nope"},
                   files={"file": ("a.wav", wav(0.2), "audio/wav")}, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def _multipart(*parts: tuple[str, str | None, bytes], boundary: str = "kvgateb") -> tuple[bytes, str]:
    out = b""
    for name, filename, value in parts:
        disp = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        out += f"--{boundary}\r\nContent-Disposition: {disp}\r\n\r\n".encode() + value + b"\r\n"
    return out + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


BAD_JSON: list[tuple[str, bytes | dict[str, Any], str | None]] = [
    ("/tokenize", {"prompt": "x"}, "model"),
    ("/tokenize", {"model": MODEL}, "prompt"),
    ("/tokenize", {"model": MODEL, "prompt": "x", "messages": [{"role": "user"}]}, "messages"),
    ("/tokenize", {"model": MODEL, "prompt": ["x"]}, "prompt"),
    ("/detokenize", {"model": MODEL, "tokens": [1, -2]}, "tokens"),
    ("/detokenize", {"model": MODEL, "tokens": "12"}, "tokens"),
    ("/rerank", {"model": MODEL, "query": "q"}, "documents"),
    ("/rerank", {"model": MODEL, "query": "q", "documents": []}, "documents"),
    ("/v1/rerank", {"model": MODEL, "query": "q", "documents": ["d"], "top_n": -1}, "top_n"),
    ("/score", {"model": MODEL, "queries": "q"}, "queries"),
    ("/pooling", {"model": MODEL}, "input"),
    ("/classify", {"model": MODEL, "input": [{"a": 1}]}, "input"),
    ("/classify", b"{not json", None),
    ("/score", b"[1, 2]", None),
]


@pytest.mark.parametrize("path,body,param", BAD_JSON, ids=[f"{b[0]}:{i}" for i, b in enumerate(BAD_JSON)])
def test_bad_json_input_is_a_400_in_openai_shape(stack: Stack, path: str, body: bytes | dict[str, Any],
                                                 param: str | None) -> None:
    content = body if isinstance(body, bytes) else orjson.dumps(body)
    r = httpx.post(stack.url + path, content=content, headers={"content-type": "application/json"}, timeout=10)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] == param


def test_bad_audio_input_is_a_400_in_openai_shape(stack: Stack) -> None:
    url = stack.url + "/v1/audio/transcriptions"
    no_file, ctype = _multipart(("model", None, MODEL.encode()))
    no_model, _ = _multipart(("file", "a.wav", wav(0.1)))
    cases: list[tuple[bytes, str, str]] = [
        (no_file, ctype, "missing_required_parameter"),
        (no_model, ctype, "missing_required_parameter"),
        (no_file, "multipart/form-data", "invalid_multipart"),  # no boundary
        (no_file[:-12], ctype, "invalid_multipart"),  # cut before the closing boundary
        (orjson.dumps({"model": MODEL}), "application/json", "invalid_content_type"),
    ]
    for content, content_type, code in cases:
        r = httpx.post(url, content=content, headers={"content-type": content_type}, timeout=10)
        assert r.status_code == 400, (code, r.text)
        assert r.json()["error"]["code"] == code
    wrong = httpx.post(stack.url + "/rerank", content=no_file, headers={"content-type": ctype}, timeout=10)
    assert wrong.status_code == 400 and wrong.json()["error"]["code"] == "invalid_content_type"


def test_multipart_over_the_body_limit_is_a_413_in_openai_shape() -> None:
    stack = start_stack(1, limits={"max_body_bytes": 4096})
    try:
        url = stack.url + "/v1/audio/transcriptions"
        ok = httpx.post(url, data={"model": MODEL}, files={"file": ("a.wav", wav(0.05), "audio/wav")}, timeout=10)
        assert ok.status_code == 200, ok.text
        big = httpx.post(url, data={"model": MODEL}, files={"file": ("a.wav", wav(1.0), "audio/wav")}, timeout=10)
        assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
        body, ctype = _multipart(("model", None, MODEL.encode()), ("file", "a.wav", wav(1.0)))

        def chunked() -> Iterator[bytes]:  # no Content-Length: the limit is counted as bytes arrive
            for i in range(0, len(body), 1000):
                yield body[i:i + 1000]
        r = httpx.post(url, content=chunked(), headers={"content-type": ctype}, timeout=10)
        assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
    finally:
        stack.close()


def test_tenants_keys_model_lists_and_rate_limits_apply() -> None:
    stack = start_stack(1, tenants=[{"name": "a", "api_keys": ["sk-a"], "requests_per_minute": 2},
                                    {"name": "b", "api_keys": ["sk-b"], "models": ["other"]}])
    try:
        body = {"model": MODEL, "input": "x"}
        assert httpx.post(stack.url + "/classify", json=body, timeout=10).status_code == 401
        a = {"authorization": "Bearer sk-a"}
        statuses = [httpx.post(stack.url + "/classify", json=body, headers=a, timeout=10).status_code
                    for _ in range(3)]
        assert statuses == [200, 200, 429]
        denied = httpx.post(stack.url + "/v1/audio/transcriptions", headers={"authorization": "Bearer sk-b"},
                            data={"model": MODEL}, files={"file": ("a.wav", wav(0.1), "audio/wav")}, timeout=10)
        assert denied.status_code in (403, 404) and denied.json()["error"]["param"] == "model"
        metrics = httpx.get(stack.url + "/metrics", timeout=5).text
        assert 'kvgate_requests_total{endpoint="classify",replica="r1",status="200",tenant="a"} 2.0' in metrics
    finally:
        stack.close()


def test_a_replica_error_is_passed_through_in_openai_shape() -> None:
    stack = start_stack(1)
    try:
        # Valid for kvgate, refused by the replica: its 400 and message come through, OpenAI-shaped.
        r = httpx.post(stack.url + "/score", timeout=10, json={
            "model": MODEL, "queries": ["a", "b"], "documents": ["c", "d", "e"]})
        assert r.status_code == 400 and r.json()["error"]["code"] == "upstream_rejected"
        assert "same length" in r.json()["error"]["message"]
        stack.faults("r1", error_rate=1.0, error_status=500)
        r = httpx.post(stack.url + "/v1/audio/transcriptions", data={"model": MODEL},
                       files={"file": ("a.wav", wav(0.1), "audio/wav")}, timeout=10)
        assert r.status_code == 502 and set(r.json()["error"]) == {"message", "type", "param", "code"}
        stack.faults("r1", html_200=True)  # an ingress answering 200 text/html for the replica
        r = httpx.post(stack.url + "/tokenize", json={"model": MODEL, "prompt": "x"}, timeout=10)
        assert r.status_code == 502 and r.json()["error"]["type"] == "upstream_error"
    finally:
        stack.close()


def test_version_is_kvgates_own(stack: Stack) -> None:
    r = httpx.get(stack.url + "/version", timeout=5)
    assert r.status_code == 200 and r.json()["version"] != "vllm_sim"
    assert httpx.get(stack.url + "/tokenize", timeout=5).status_code == 405


class Recorder:
    """An upstream that records what it receives (the outside edge, to see what kvgate forwards)."""

    def __init__(self) -> None:
        self.bodies: list[tuple[str, str, bytes]] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = dict(scope["headers"])
        self.bodies.append((scope["path"], headers.get(b"content-type", b"").decode(), body))
        if scope["path"] == "/v1/audio/transcriptions":
            payload, ctype = b"00:00:00,000 --> 00:00:01,000\nhello\n", b"application/x-subrip"
        else:
            payload, ctype = b'{"data": [], "usage": {"prompt_tokens": 3, "total_tokens": 3}}', b"application/json"
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", ctype)]})
        await send({"type": "http.response.body", "body": payload})


def test_what_the_replica_receives_stripped_salted_and_byte_exact() -> None:
    recorder = Recorder()
    upstream = ServerThread(recorder, lifespan="off").start()
    settings = load_settings(environ={}, overrides={
        "replicas": [{"name": "rec", "url": upstream.url, "models": [MODEL]}],
        "pool": {"health_interval_s": 60, "metrics_interval_s": 60},
        "tenants": [{"name": "a", "api_keys": ["sk-a"]}]})
    gateway = ServerThread(build_app(settings)).start()
    try:
        auth = {"authorization": "Bearer sk-a"}
        r = httpx.post(gateway.url + "/pooling", headers=auth, timeout=10, json={
            "model": MODEL, "input": "x", "priority": -10, "cache_salt": "guess", "vllm_xargs": {"a": 1}})
        assert r.status_code == 200
        sent = orjson.loads(recorder.bodies[-1][2])
        assert "priority" not in sent and "vllm_xargs" not in sent
        assert sent["cache_salt"] not in (None, "guess")
        tok = httpx.post(gateway.url + "/tokenize", headers=auth, json={"model": MODEL, "prompt": "x"}, timeout=10)
        assert tok.status_code == 200 and "cache_salt" not in orjson.loads(recorder.bodies[-1][2])
        audio = wav(0.1)
        body, ctype = _multipart(("model", None, MODEL.encode()), ("vllm_xargs", None, b'{"a": 1}'),
                                 ("response_format", None, b"srt"), ("file", "a.wav", audio))
        r = httpx.post(gateway.url + "/v1/audio/transcriptions", content=body, timeout=10,
                       headers={**auth, "content-type": ctype})
        # A non-JSON answer passes through with the replica's content type.
        assert r.status_code == 200 and r.headers["content-type"] == "application/x-subrip"
        assert r.text.endswith("hello\n")
        path, got_type, got = recorder.bodies[-1]
        assert path == "/v1/audio/transcriptions" and got_type == ctype
        assert got == _multipart(("model", None, MODEL.encode()), ("response_format", None, b"srt"),
                                 ("file", "a.wav", audio))[0]
    finally:
        gateway.stop()
        upstream.stop()


def _slow_stack() -> Stack:
    # 100 ms per decoded word: a 10-second clip (20 words) streams for about 2 s.
    return start_stack(1, sim={"timing": TimingModel(decode_base_s=0.1, time_scale=1.0)})


def test_a_client_leaving_a_streamed_transcription_aborts_it_within_a_second() -> None:
    stack = _slow_stack()
    try:
        with httpx.stream("POST", stack.url + "/v1/audio/transcriptions", timeout=10,
                          data={"model": MODEL, "stream": "true"}, files={"file": ("a.wav", wav(10.0))}) as r:
            assert r.status_code == 200
            first = next(r.iter_lines())
            assert first.startswith("data: ") and "transcription.chunk" in first
            left = time.monotonic()
        assert stack.wait_for(lambda: stack.sim_stats("r1")["aborted"] == 1, timeout=1.0)
        assert time.monotonic() - left < 1.0
        assert stack.wait_for(lambda: 'kvgate_client_disconnects_total{endpoint="transcriptions"} 1.0'
                              in httpx.get(stack.url + "/metrics", timeout=5).text, timeout=2.0)
    finally:
        stack.close()


def test_a_replica_dying_mid_transcription_ends_the_stream_with_an_error_event() -> None:
    stack = start_stack(1, sim={"faults": Faults(die_after_tokens=2)})
    try:
        with httpx.stream("POST", stack.url + "/v1/audio/transcriptions", timeout=10,
                          data={"model": MODEL, "stream": "true"}, files={"file": ("a.wav", wav(3.0))}) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        words = transcript(wav(3.0))
        assert [orjson.loads(e)["choices"][0]["delta"]["content"] for e in events[:2]] == [words[0], " " + words[1]]
        assert len(events) == 3 and "[DONE]" not in events  # partial output, then the error, never a fake end
        assert orjson.loads(events[2])["error"]["type"] == "upstream_error"
    finally:
        stack.close()


NO_BUDGET = {"retry_budget_ratio": 0.0, "retry_budget_min": 0}


def _transcribed(stack: Stack, audio: bytes) -> tuple[str, str]:
    """A streamed transcription through kvgate with the SDK: the replica that served it, and its text."""
    client = openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0)
    raw = client.audio.transcriptions.with_raw_response.create(model=MODEL, file=("a.wav", audio, "audio/wav"),
                                                               stream=True)
    events = [e.model_dump() for e in raw.parse()]
    return raw.headers["x-kvgate-replica"], "".join(e["choices"][0]["delta"]["content"] for e in events)


def test_a_streamed_transcription_whose_replica_dies_before_its_first_event_is_retried_without_budget() -> None:
    # r1 (first by load: ties break by name) has sent the stream's headers and is decoding when it dies;
    # no byte has reached the client. The wait for the first event is part of the retry loop, as on chat:
    # r2 transcribes it, with a retry budget that allows none, as r1 is gone.
    stack = start_stack(2, pool=NO_BUDGET)
    try:
        audio = wav()
        stack.faults("r1", stall_before_first_token_s=120.0)
        with ThreadPoolExecutor(1) as client:
            answer = client.submit(_transcribed, stack, audio)
            assert stack.wait_for(lambda: stack.sim_stats("r1")["engine_requests"] == 1, timeout=10)
            stack.sims["r1"].kill()
            assert answer.result(timeout=60) == ("r2", " ".join(transcript(audio)))
        pool = stack.runtime.pool
        assert pool.replicas["r1"].failures >= 1 and pool.replicas["r2"].failures == 0
        assert pool.budget.active_retries == 0
    finally:
        stack.close()


@pytest.mark.parametrize("pool", [{}, NO_BUDGET], ids=["budget", "no_budget"])
@pytest.mark.parametrize("fault", [{"die_after_tokens": 0}, {"html_200": True}], ids=["ended", "html"])
def test_a_streamed_transcription_failing_before_its_first_event_on_a_live_replica_takes_the_retry_budget(
        pool: dict[str, float], fault: dict[str, object]) -> None:
    # r1 answers 200 and ends the stream before any event, or sends a page that is no event stream (an
    # ingress answering for it). It is alive, so the retry is an ordinary one: within the budget r2
    # transcribes it, and without budget the client gets a plain 502.
    stack = start_stack(2, pool=pool)
    try:
        audio = wav()
        stack.faults("r1", **fault)
        if pool:
            with pytest.raises(openai.InternalServerError) as e:
                _transcribed(stack, audio)
            assert e.value.status_code == 502
        else:
            assert _transcribed(stack, audio) == ("r2", " ".join(transcript(audio)))
        replicas = stack.runtime.pool.replicas
        assert replicas["r1"].failures == 1 and replicas["r2"].failures == 0
    finally:
        stack.close()


def test_utility_requests_go_by_load_whatever_the_routing_policy() -> None:
    stack = start_stack(2, sim={"timing": TimingModel(decode_base_s=0.1, time_scale=1.0)},
                        routing={"policy": "prefix_affinity"})
    try:
        chat = {"model": MODEL, "max_tokens": 30, "stream": True,
                "messages": [{"role": "user", "content": "hold this replica busy"}]}
        with httpx.stream("POST", stack.base_url + "/chat/completions", json=chat, timeout=10) as busy:
            next(busy.iter_lines())  # one request in flight on ``busy``'s replica
            held = busy.headers["x-kvgate-replica"]
            for path, body in [("/tokenize", {"prompt": "hold this replica busy"}),
                               ("/classify", {"input": "hold this replica busy"})] * 2:
                r = httpx.post(stack.url + path, json={"model": MODEL, **body}, timeout=10)
                assert r.status_code == 200 and r.headers["x-kvgate-replica"] != held
    finally:
        stack.close()


def test_a_client_leaving_mid_upload_sends_nothing_upstream() -> None:
    stack = start_stack(1)
    try:
        body, ctype = _multipart(("model", None, MODEL.encode()), ("file", "a.wav", wav(1.0)))
        head = (f"POST /v1/audio/transcriptions HTTP/1.1\r\nhost: x\r\ncontent-type: {ctype}\r\n"
                f"content-length: {len(body)}\r\n\r\n").encode()
        with socket.create_connection(("127.0.0.1", stack.gateway.port), timeout=5) as sock:
            sock.sendall(head + body[: len(body) // 2])
            time.sleep(0.2)
        assert stack.wait_for(lambda: 'endpoint="transcriptions",replica="-",status="499"'
                              in httpx.get(stack.url + "/metrics", timeout=5).text, timeout=3.0)
        assert stack.sim_stats("r1")["requests"] == 0
    finally:
        stack.close()
