"""gateway.apis.utility.multipart and the audio body check: pure, so properties over generated forms."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.errors import BadRequest
from gateway.apis.utility.multipart import boundary_of, field_text, parse_parts, without_fields
from gateway.apis.utility.validate import audio_body
from policies.salt import STRIPPED_FIELDS

BOUNDARY = "----kvgate7MA4YWxkTrZu0gW"
NAMES = st.sampled_from(["model", "file", "language", "stream", "vllm_xargs", "priority", "request_id", "prompt"])
PART = st.tuples(NAMES, st.one_of(st.none(), st.just("a.wav")), st.binary(max_size=300))


def form(parts: list[tuple[str, str | None, bytes]], boundary: str = BOUNDARY, preamble: bytes = b"") -> bytes:
    out = preamble
    for name, filename, value in parts:
        disp = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        out += f"--{boundary}\r\nContent-Disposition: {disp}\r\nContent-Type: x/y\r\n\r\n".encode() + value + b"\r\n"
    return out + f"--{boundary}--\r\n".encode()


def values(body: bytes) -> list[tuple[str, str | None, bytes]]:
    return [(p.name, p.filename, body[p.value_start:p.value_end]) for p in parse_parts(body, BOUNDARY.encode())]


@given(st.lists(PART, max_size=8), st.binary(max_size=20).filter(lambda b: b"--" not in b))
def test_parse_returns_every_part_byte_for_byte(parts: list[tuple[str, str | None, bytes]], preamble: bytes) -> None:
    parts = [(n, f, v) for n, f, v in parts if BOUNDARY.encode() not in v]
    assert values(form(parts, preamble=preamble)) == parts


@given(st.lists(PART, min_size=1, max_size=8))
def test_without_fields_is_the_form_without_those_parts(parts: list[tuple[str, str | None, bytes]]) -> None:
    body = form(parts)
    out = without_fields(body, parse_parts(body, BOUNDARY.encode()), STRIPPED_FIELDS)
    kept = [p for p in parts if p[0] not in STRIPPED_FIELDS]
    assert out == form(kept)
    assert values(out) == kept


def test_boundary_forms_and_refusals() -> None:
    assert boundary_of('multipart/form-data; boundary="a b"') == b"a b"
    assert boundary_of("Multipart/Form-Data;charset=utf-8;boundary=xyz") == b"xyz"
    for bad in ("application/json", "multipart/form-data", "multipart/mixed; boundary=x", ""):
        with pytest.raises(BadRequest):
            boundary_of(bad)


@pytest.mark.parametrize("body", [
    b"no boundary at all",
    f"--{BOUNDARY}garbage".encode(),
    f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\nunterminated".encode(),
    f"--{BOUNDARY}\r\nContent-Type: x/y\r\n\r\nv\r\n--{BOUNDARY}--\r\n".encode(),  # no Content-Disposition
    f"--{BOUNDARY}\r\nContent-Disposition: form-data\r\n\r\nv\r\n--{BOUNDARY}--\r\n".encode(),  # no name
    form([("a", None, b"x")] * 300),
])
def test_malformed_bodies_are_400s(body: bytes) -> None:
    with pytest.raises(BadRequest) as info:
        parse_parts(body, BOUNDARY.encode())
    assert info.value.status == 400 and info.value.code == "invalid_multipart"


def test_audio_body_finds_model_and_stream_and_strips() -> None:
    ctype = f"multipart/form-data; boundary={BOUNDARY}"
    body = form([("file", "a.wav", b"RIFF"), ("stream", None, b"True"), ("priority", None, b"-5"),
                 ("model", None, b"m1")])
    got = audio_body(body, ctype)
    assert (got.model, got.stream) == ("m1", True)
    assert got.payload == form([("file", "a.wav", b"RIFF"), ("stream", None, b"True"), ("model", None, b"m1")])
    with pytest.raises(BadRequest, match="model"):
        audio_body(form([("file", "a.wav", b"x"), ("model", None, b"")]), ctype)
    with pytest.raises(BadRequest, match="file"):
        audio_body(form([("file", None, b"x"), ("model", None, b"m")]), ctype)  # a text field, not a file
    with pytest.raises(BadRequest, match="short text"):
        audio_body(form([("file", "a.wav", b"x"), ("model", "m.txt", b"m")]), ctype)
    with pytest.raises(BadRequest, match="UTF-8"):
        field_text(*_first(form([("model", None, b"\xff\xfe")])))


def _first(body: bytes) -> tuple[bytes, object]:
    return body, parse_parts(body, BOUNDARY.encode())[0]
