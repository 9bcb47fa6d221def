"""Read the fields of a ``multipart/form-data`` body and drop the ones no client may set. Pure.

The audio routes (``/v1/audio/transcriptions``, ``/v1/audio/translations``) take
multipart bodies: an audio file plus form fields, the model among them. The
gateway needs only a few small fields (``model`` to route, ``stream`` for the
read deadline) and must remove the parts a client may not set (the same
``policies.salt.STRIPPED_FIELDS`` as on JSON routes: ``vllm_xargs``,
``priority``, ``request_id``, ...). Everything else, the file included, is
forwarded as the original bytes: the kept parts are slices of the body, never
re-encoded.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass

from gateway.errors import BadRequest

__all__ = ["Part", "boundary_of", "field_text", "parse_parts", "without_fields"]

_BOUNDARY = re.compile(r';\s*boundary=(?:"([^"]{1,70})"|([^;\s]{1,70}))', re.IGNORECASE)
_NAME = re.compile(r'(?:^|;)\s*name=(?:"([^"]*)"|([^;\s]+))', re.IGNORECASE)
_FILENAME = re.compile(r'(?:^|;)\s*filename\*?=(?:"([^"]*)"|([^;\s]+))', re.IGNORECASE)
# A form's small fields are a few dozen; a body of thousands of empty parts is an attack.
_MAX_PARTS = 256
# A text field longer than this is not one the gateway reads (model names are <= 256).
_MAX_FIELD_BYTES = 4096


@dataclass(frozen=True, slots=True)
class Part:
    name: str
    filename: str | None
    start: int  # where the part's delimiter line begins
    value_start: int
    value_end: int
    end: int  # where the next delimiter line begins


def boundary_of(content_type: str) -> bytes:
    """The boundary of a ``multipart/form-data`` content type; ``BadRequest`` for anything else."""
    media = content_type.split(";", 1)[0].strip().lower()
    if media != "multipart/form-data":
        raise BadRequest("Content-Type must be multipart/form-data", code="invalid_content_type")
    m = _BOUNDARY.search(content_type)
    if m is None:
        raise BadRequest("multipart/form-data needs a boundary parameter", code="invalid_multipart")
    return (m.group(1) or m.group(2)).encode("latin-1")


def _bad(why: str) -> BadRequest:
    return BadRequest(f"malformed multipart body: {why}", code="invalid_multipart")


def parse_parts(body: bytes, boundary: bytes) -> list[Part]:
    """Every part of ``body`` in order (RFC 7578); ``BadRequest`` if the body is malformed."""
    delim = b"--" + boundary
    pos = body.find(delim)
    if pos < 0:
        raise _bad("no boundary found")
    parts: list[Part] = []
    while True:
        after = pos + len(delim)
        if body.startswith(b"--", after):
            return parts
        if not body.startswith(b"\r\n", after):
            raise _bad("a boundary line must end with CRLF")
        head_end = body.find(b"\r\n\r\n", after)
        if head_end < 0:
            raise _bad("a part has no end of headers")
        value_start = head_end + 4
        nxt = body.find(b"\r\n" + delim, head_end + 2)
        if nxt < 0:
            raise _bad("the body does not end with the closing boundary")
        name, filename = _disposition(body[after + 2 : head_end])
        parts.append(Part(name, filename, pos, value_start, nxt, nxt + 2))
        if len(parts) > _MAX_PARTS:
            raise _bad(f"more than {_MAX_PARTS} parts")
        pos = nxt + 2


def _disposition(head: bytes) -> tuple[str, str | None]:
    for line in head.decode("utf-8", "replace").split("\r\n"):
        key, _, value = line.partition(":")
        if key.strip().lower() != "content-disposition":
            continue
        m = _NAME.search(value)
        if m is None:
            raise _bad("a part's Content-Disposition has no name")
        f = _FILENAME.search(value)
        return m.group(1) if m.group(1) is not None else m.group(2), (
            None if f is None else (f.group(1) if f.group(1) is not None else f.group(2)))
    raise _bad("a part has no Content-Disposition header")


def field_text(body: bytes, part: Part) -> str:
    """A small text field's value; ``BadRequest`` if it is not short UTF-8."""
    raw = body[part.value_start : part.value_end]
    if part.filename is not None or len(raw) > _MAX_FIELD_BYTES:
        raise BadRequest(f"form field '{part.name}' must be a short text value", param=part.name,
                         code="invalid_type")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise BadRequest(f"form field '{part.name}' is not UTF-8", param=part.name, code="invalid_type") from None


def without_fields(body: bytes, parts: list[Part], names: Collection[str]) -> bytes:
    """``body`` minus the parts named in ``names`` (the others byte for byte, in order)."""
    if not parts or not any(p.name in names for p in parts):
        return body
    view = memoryview(body)  # slices without copies: the join is the one copy of an upload
    out = [view[: parts[0].start]]
    out.extend(view[p.start : p.end] for p in parts if p.name not in names)
    out.append(view[parts[-1].end :])
    return b"".join(out)
