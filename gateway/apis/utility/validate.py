"""Check the bodies of vLLM's utility and pooling routes before anything is forwarded. Pure.

JSON routes: ``tokenize``, ``detokenize``, ``rerank``, ``score``, ``pooling``,
``classify``. Only what a replica would answer with a confusing error, or what
the gateway itself needs (the model, to route), is checked; unknown fields
pass through, as on chat. Shapes follow vLLM's protocol models
(``TokenizeRequest``, ``DetokenizeRequest``, ``RerankRequest``, ``ScoreRequest``,
``PoolingRequest``, ``ClassificationRequest``).

Audio routes: ``transcriptions``, ``translations`` take multipart bodies;
``audio_body`` finds the model and the file and drops the fields no client
may set.

``model`` is required on every route, although vLLM defaults to its one served
model: a fleet serves several, and routing needs to know which.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from policies.salt import STRIPPED_FIELDS

from gateway.errors import BadRequest
from .multipart import boundary_of, field_text, parse_parts, without_fields
# The same rules and wording as chat's model and the embeddings' input.
from gateway.proxy.validate import _input as check_input
from gateway.proxy.validate import _is_int
from gateway.proxy.validate import _model as require_model

__all__ = ["AudioBody", "audio_body", "validate_utility"]

_SCORE_PAIRS = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2"))


def _missing(name: str) -> BadRequest:
    return BadRequest(f"'{name}' is required", param=name, code="missing_required_parameter")


def _score_input(body: dict[str, Any], name: str, *, many: bool) -> None:
    """A text, a multimodal content object, or (``many``) a non-empty list of either."""
    value = body.get(name)
    if value is None:
        raise _missing(name)
    if isinstance(value, (str, dict)) or (many and isinstance(value, list) and value
                                          and all(isinstance(v, (str, dict)) for v in value)):
        return
    kinds = "a string, an object or a non-empty array of them" if many else "a string or an object"
    raise BadRequest(f"'{name}' must be {kinds}", param=name, code="invalid_type")


def _messages(body: dict[str, Any]) -> None:
    messages = body["messages"]
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise BadRequest("'messages' must be a non-empty array of objects", param="messages", code="invalid_type")


def _text_or_messages(body: dict[str, Any], text: str, extra: tuple[str, ...] = ()) -> None:
    """Exactly one of ``text`` / ``messages`` (or one of ``extra``, e.g. a plugin's ``data``)."""
    given = [k for k in (text, "messages", *extra) if body.get(k) is not None]
    if not given:
        raise BadRequest(f"one of '{text}' or 'messages' is required", param=text,
                         code="missing_required_parameter")
    if len(given) > 1:
        raise BadRequest(f"give only one of {', '.join(repr(g) for g in given)}", param=given[1],
                         code="invalid_value")
    if given[0] == "messages":
        _messages(body)
    elif given[0] == "input":
        check_input(body)
    elif given[0] == "prompt" and not isinstance(body["prompt"], str):
        raise BadRequest("'prompt' must be a string", param="prompt", code="invalid_type")


def _tokens(body: dict[str, Any]) -> None:
    tokens = body.get("tokens")
    if tokens is None:
        raise _missing("tokens")
    if not isinstance(tokens, list) or not all(_is_int(t) and 0 <= t < 2**63 for t in tokens):
        raise BadRequest("'tokens' must be an array of non-negative token ids", param="tokens", code="invalid_type")


def _rerank(body: dict[str, Any]) -> None:
    _score_input(body, "query", many=False)
    _score_input(body, "documents", many=True)
    top_n = body.get("top_n")
    if top_n is not None and not (_is_int(top_n) and top_n >= 0):
        raise BadRequest("'top_n' must be a non-negative integer", param="top_n", code="invalid_value")


def _score(body: dict[str, Any]) -> None:
    for first, second in _SCORE_PAIRS:
        if first in body and second in body:
            _score_input(body, first, many=True)
            _score_input(body, second, many=True)
            return
    raise BadRequest("score needs a pair of inputs: 'queries' and 'documents' (or 'items'), "
                     "'data_1' and 'data_2', or 'text_1' and 'text_2'", param="queries",
                     code="missing_required_parameter")


def validate_utility(endpoint: str, body: dict[str, Any]) -> str:
    """Check one JSON utility route's body; returns the model name."""
    model = require_model(body)
    if endpoint == "tokenize":
        _text_or_messages(body, "prompt")
    elif endpoint == "detokenize":
        _tokens(body)
    elif endpoint == "rerank":
        _rerank(body)
    elif endpoint == "score":
        _score(body)
    elif endpoint == "pooling":
        _text_or_messages(body, "input", extra=("data",))
    elif endpoint == "classify":
        _text_or_messages(body, "input")
    else:  # pragma: no cover - the route table and this function are written together
        raise ValueError(f"no validation for endpoint {endpoint!r}")
    return model


@dataclass(frozen=True, slots=True)
class AudioBody:
    model: str
    stream: bool
    payload: bytes  # what the replica receives: the body without the stripped fields


def audio_body(raw: bytes, content_type: str) -> AudioBody:
    """The model, ``stream`` and forwardable bytes of a transcription/translation form."""
    boundary = boundary_of(content_type)
    parts = parse_parts(raw, boundary)
    fields = {p.name: p for p in parts}
    model_part = fields.get("model")
    if model_part is None:
        raise _missing("model")
    model = require_model({"model": field_text(raw, model_part)})
    file_part = fields.get("file")
    if file_part is None or file_part.filename is None:
        raise BadRequest("'file' is required: the audio as a file part", param="file",
                         code="missing_required_parameter")
    stream_part = fields.get("stream")
    stream = stream_part is not None and field_text(raw, stream_part).strip().lower() in ("true", "1")
    return AudioBody(model, stream, without_fields(raw, parts, STRIPPED_FIELDS))
