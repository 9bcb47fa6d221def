"""Arbitrary JSON and multipart bodies on the utility routes: a clear 4xx or an answer, never a 500 or a hang."""

from __future__ import annotations

import json
from typing import Any, Iterator

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.stack import MODEL, start_stack

PATHS = ["/tokenize", "/detokenize", "/rerank", "/v2/rerank", "/score", "/pooling", "/classify"]
FIELDS = ["model", "prompt", "messages", "tokens", "query", "documents", "top_n", "queries", "items", "data_1",
          "data_2", "text_1", "text_2", "input", "data", "return_token_strs", "add_generation_prompt"]
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-3, 2**64), st.floats(allow_nan=False),
                    st.text(max_size=20), st.just(MODEL))
JSON = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                     st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                    max_leaves=12)
BODY = st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=5).map(lambda b: {"model": MODEL, **b}
                                                                        if "model" not in b else b)
OK = {200, 400, 404, 413, 422}


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    s = start_stack(1)
    try:
        with httpx.Client(base_url=s.url, timeout=10) as c:  # one client: no TLS context per request
            yield c
    finally:
        s.close()


def _check(r: httpx.Response) -> None:
    assert r.status_code in OK, (r.status_code, r.text)
    if r.status_code != 200:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"] and err["type"]


@settings(max_examples=200, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(PATHS), body=BODY)
def test_any_json_body_gets_an_answer_or_a_clear_4xx(client: httpx.Client, path: str, body: dict[str, Any]) -> None:
    _check(client.post(path, content=json.dumps(body), headers={"content-type": "application/json"}))


PART = st.tuples(st.sampled_from(["model", "file", "stream", "response_format", "language", "x"]),
                 st.one_of(st.none(), st.just("a.wav")),
                 st.one_of(st.binary(max_size=64), st.sampled_from([MODEL.encode(), b"true", b"json", b"srt"])))


@settings(max_examples=150, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=st.lists(PART, max_size=5), cut=st.integers(0, 40))
def test_any_multipart_body_gets_an_answer_or_a_clear_4xx(client: httpx.Client,
                                                          parts: list[tuple[str, str | None, bytes]], cut: int) -> None:
    body = b""
    for name, filename, value in parts:
        disp = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        body += f"--zz\r\nContent-Disposition: {disp}\r\n\r\n".encode() + value + b"\r\n"
    body += b"--zz--\r\n"
    body = body[: len(body) - cut] if cut < 20 else body  # sometimes truncated
    _check(client.post("/v1/audio/transcriptions", content=body,
                       headers={"content-type": "multipart/form-data; boundary=zz"}))
