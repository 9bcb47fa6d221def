"""Every row of the bad-input table: a clear OpenAI-shaped error, never a 500 or a hang."""

from __future__ import annotations

import json
import socket
import time
from typing import Any, Iterator

import httpx
import pytest

from tests.support.stack import MODEL, Stack, start_stack

GOOD = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    s = start_stack(1, limits={"max_body_bytes": 1024 * 1024},
                    tenants=[{"name": "acme", "api_keys": ["sk-acme-1"]}])
    yield s
    s.close()


@pytest.fixture(scope="module")
def http(stack: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.url, headers={"authorization": "Bearer sk-acme-1"}, timeout=10) as c:
        yield c


def _err(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert resp.headers["x-request-id"]
    return body["error"]  # type: ignore[no-any-return]


def _requests_seen(stack: Stack) -> int:
    return int(stack.sim_stats("r1")["requests"])


@pytest.mark.parametrize("raw", [b"", b"{", b"[1,2]", b"null", b'{"model": NaN}', b"\x00\x01",
                                 b'{"a":"\\ud800"}'])
def test_malformed_json_is_400_and_not_forwarded(stack: Stack, http: httpx.Client, raw: bytes) -> None:
    before = _requests_seen(stack)
    _err(http.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"}), 400)
    assert _requests_seen(stack) == before


def test_wrong_content_type(http: httpx.Client) -> None:
    _err(http.post("/v1/chat/completions", content=json.dumps(GOOD), headers={"content-type": "text/plain"}), 400)


@pytest.mark.parametrize("field,value", [
    ("max_tokens", "10"), ("max_tokens", -1), ("max_tokens", 1.5), ("max_tokens", 10**30), ("n", 1000),
    ("stream", "yes"), ("temperature", "hot"), ("temperature", 9), ("messages", "hi"), ("messages", []),
    ("stop", 5), ("stream_options", {"include_usage": "yes"}), ("model", 7), ("model", ""),
])
def test_wrong_types_name_the_param(http: httpx.Client, field: str, value: Any) -> None:
    err = _err(http.post("/v1/chat/completions", json={**GOOD, field: value}), 400)
    assert err["param"] is not None and err["param"].split(".")[0] == field


def test_missing_fields(http: httpx.Client) -> None:
    assert _err(http.post("/v1/chat/completions", json={"messages": GOOD["messages"]}), 400)["param"] == "model"
    assert _err(http.post("/v1/completions", json={"model": MODEL}), 400)["param"] == "prompt"
    assert _err(http.post("/v1/embeddings", json={"model": MODEL}), 400)["param"] == "input"


def test_unknown_model_is_404(http: httpx.Client) -> None:
    assert _err(http.post("/v1/chat/completions", json={**GOOD, "model": "gpt-nope"}), 404)["param"] == "model"


def test_unknown_route_and_method(http: httpx.Client) -> None:
    _err(http.get("/v1/nope"), 404)
    assert http.get("/v1/chat/completions").status_code == 405


def test_deep_nesting_huge_ints_many_keys_are_fast_400s(http: httpx.Client) -> None:
    deep = b'{"model":"sim-model","x":' + b"[" * 5000 + b"]" * 5000 + b"}"
    many = json.dumps({**GOOD, **{f"k{i}": 1 for i in range(60_000)}}).encode()
    for raw in (deep, many):
        t = time.perf_counter()
        _err(http.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"}), 400)
        assert time.perf_counter() - t < 2.0


def test_unicode_edge_cases_pass(http: httpx.Client) -> None:
    for text in ["\ufeffhello", "nul\u0000byte", "zero\u200bwidth", "caf\u00e9", "cafe\u0301", "😀" * 50]:
        r = http.post("/v1/chat/completions", json={**GOOD, "messages": [{"role": "user", "content": text}]})
        assert r.status_code == 200, r.text
    # A body starting with a UTF-8 BOM is accepted, not a 500.
    r = http.post("/v1/chat/completions", content=b"\xef\xbb\xbf" + json.dumps(GOOD).encode(),
                  headers={"content-type": "application/json"})
    assert r.status_code == 200


def test_body_over_limit_with_content_length_is_413(stack: Stack) -> None:
    # Declared 100 MB: refused from the header, before the body is read.
    with socket.create_connection(("127.0.0.1", stack.gateway.port), timeout=5) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-acme-1\r\n"
                  b"Content-Type: application/json\r\nContent-Length: 104857600\r\n\r\n" + b"{" * 1000)
        head = s.recv(65536)
    assert head.startswith(b"HTTP/1.1 413")


def test_body_over_limit_chunked_is_413(stack: Stack) -> None:
    def gen() -> Iterator[bytes]:
        yield b'{"model":"sim-model","pad":"'
        for _ in range(100):  # 100 x 64 KiB, well past the 1 MiB limit
            yield b"x" * 65536

    try:
        r = httpx.post(stack.url + "/v1/chat/completions", content=gen(), timeout=10,
                       headers={"authorization": "Bearer sk-acme-1", "content-type": "application/json"})
        assert r.status_code == 413
    except (httpx.WriteError, httpx.RemoteProtocolError, httpx.ReadError):
        pass  # the server answered and closed while we were still writing: also a refusal


def test_oversized_headers_431(http: httpx.Client) -> None:
    r = http.post("/v1/chat/completions", json=GOOD, headers={"x-big": "a" * (61 * 1024)})
    assert r.status_code == 431
    r = http.post("/v1/chat/completions", json=GOOD, headers={f"x-h{i}": "1" for i in range(120)})
    assert r.status_code == 431


@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer"}, {"authorization": "Basic abc"},
                                     {"authorization": "Bearer sk-unknown"}])
def test_missing_malformed_unknown_keys_are_401(stack: Stack, headers: dict[str, str]) -> None:
    r = httpx.post(stack.url + "/v1/chat/completions", json=GOOD, headers=headers, timeout=10)
    err = _err(r, 401)
    assert "sk-unknown" not in r.text and err["type"] == "authentication_error"


def test_key_in_query_string_is_refused(stack: Stack) -> None:
    r = httpx.post(stack.url + "/v1/chat/completions?api_key=sk-acme-1", json=GOOD, timeout=10)
    assert _err(r, 401)["code"] == "api_key_in_query"
    assert "sk-acme-1" not in r.text


def test_request_id_kept_only_when_safe(http: httpx.Client) -> None:
    assert http.post("/v1/chat/completions", json=GOOD, headers={"x-request-id": "abc-123"}).headers[
        "x-request-id"] == "abc-123"
    rid = http.post("/v1/chat/completions", json=GOOD, headers={"x-request-id": "bad id\r\nx: y" [:6] + "%0a"})
    assert rid.headers["x-request-id"].startswith("req_")


def test_slow_body_is_dropped_at_deadline() -> None:
    s = start_stack(1, timeouts={"body_receive_s": 0.3})
    try:
        with socket.create_connection(("127.0.0.1", s.gateway.port), timeout=5) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{")
            t = time.monotonic()
            head = sock.recv(65536)
            assert head.startswith(b"HTTP/1.1 400") and time.monotonic() - t < 2
    finally:
        s.close()
