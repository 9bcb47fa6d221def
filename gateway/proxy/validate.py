"""Parse and validate a client's JSON body before anything is forwarded.

Pure: bytes in, a dict or a ``BadRequest`` (with ``param`` set) out. The checks
are the ones a replica would otherwise answer with a confusing error, or that
protect the gateway itself (nesting, sizes, NaN). Unknown fields pass through,
as OpenAI-compatible servers expect.
"""

from __future__ import annotations

import math
from typing import Any

import orjson

from gateway.errors import BadRequest

_BOM = b"\xef\xbb\xbf"
_ROLES = {"system", "developer", "user", "assistant", "tool", "function"}


def parse_json(raw: bytes, *, max_depth: int) -> dict[str, Any]:
    if raw.startswith(_BOM):
        raw = raw[len(_BOM):]
    if not raw.strip():
        raise BadRequest("request body is empty; expected a JSON object", code="invalid_json")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        reason = "nested too deeply" if "depth" in str(e) else "not valid JSON"
        raise BadRequest(f"request body is {reason}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object", code="invalid_json")
    _check_depth(body, max_depth)
    return body


_MAX_TOP_LEVEL_KEYS = 256
_MAX_NODES = 200_000


def _check_depth(value: Any, max_depth: int) -> None:
    # Iterative, so a hostile body cannot exhaust the Python stack; bounded in
    # nodes, so a million tiny keys is refused rather than forwarded.
    if len(value) > _MAX_TOP_LEVEL_KEYS:
        raise BadRequest(f"request body has more than {_MAX_TOP_LEVEL_KEYS} fields", code="invalid_json")
    stack: list[tuple[Any, int]] = [(value, 1)]
    nodes = 0
    while stack:
        node, depth = stack.pop()
        nodes += 1
        if nodes > _MAX_NODES:
            raise BadRequest(f"request body has more than {_MAX_NODES} JSON values", code="invalid_json")
        if depth > max_depth:
            raise BadRequest(f"JSON nesting deeper than {max_depth} levels", code="invalid_json")
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node if isinstance(v, (dict, list)))


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _int_field(body: dict[str, Any], name: str, lo: int, hi: int) -> None:
    if name not in body or body[name] is None:
        return
    v = body[name]
    if not _is_int(v):
        raise BadRequest(f"'{name}' must be an integer", param=name, code="invalid_type")
    if not lo <= v <= hi:
        raise BadRequest(f"'{name}' must be between {lo} and {hi}", param=name, code="invalid_value")


def _num_field(body: dict[str, Any], name: str, lo: float, hi: float) -> None:
    if name not in body or body[name] is None:
        return
    v = body[name]
    if not _is_number(v):
        raise BadRequest(f"'{name}' must be a number", param=name, code="invalid_type")
    if not lo <= v <= hi:
        raise BadRequest(f"'{name}' must be between {lo} and {hi}", param=name, code="invalid_value")


def _bool_field(body: dict[str, Any], name: str) -> None:
    if name in body and body[name] is not None and not isinstance(body[name], bool):
        raise BadRequest(f"'{name}' must be a boolean", param=name, code="invalid_type")


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if model is None:
        raise BadRequest("'model' is required", param="model", code="missing_required_parameter")
    if not isinstance(model, str) or not model or len(model) > 256:
        raise BadRequest("'model' must be a non-empty string", param="model", code="invalid_type")
    return model


def _common(body: dict[str, Any], *, max_n: int, max_tokens: int) -> None:
    _bool_field(body, "stream")
    _int_field(body, "max_tokens", 1, max_tokens)
    _int_field(body, "max_completion_tokens", 1, max_tokens)
    _int_field(body, "n", 1, max_n)
    _num_field(body, "temperature", 0.0, 2.0)
    _num_field(body, "top_p", 0.0, 1.0)
    _num_field(body, "presence_penalty", -2.0, 2.0)
    _num_field(body, "frequency_penalty", -2.0, 2.0)
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise BadRequest("'stream_options' must be an object", param="stream_options", code="invalid_type")
        if "include_usage" in so and not isinstance(so["include_usage"], bool):
            raise BadRequest(
                "'stream_options.include_usage' must be a boolean",
                param="stream_options.include_usage",
                code="invalid_type",
            )
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str):
        if not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
            raise BadRequest("'stop' must be a string or a list of strings", param="stop", code="invalid_type")


def _messages(body: dict[str, Any]) -> None:
    messages = body.get("messages")
    if messages is None:
        raise BadRequest("'messages' is required", param="messages", code="missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array", param="messages", code="invalid_type")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise BadRequest("each message must be an object", param=f"messages.{i}", code="invalid_type")
        role = m.get("role")
        if role not in _ROLES:
            raise BadRequest(
                f"'role' must be one of {sorted(_ROLES)}", param=f"messages.{i}.role", code="invalid_value"
            )
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise BadRequest(
                "'content' must be a string or an array of parts", param=f"messages.{i}.content",
                code="invalid_type",
            )
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise BadRequest("'tools' must be an array", param="tools", code="invalid_type")


def _prompt(body: dict[str, Any]) -> None:
    prompt = body.get("prompt")
    if prompt is None:
        raise BadRequest("'prompt' is required", param="prompt", code="missing_required_parameter")
    ok = isinstance(prompt, str) or (
        isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt)
    ) or (isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt))
    if not ok:
        raise BadRequest("'prompt' must be a string, a list of strings or a list of token ids",
                         param="prompt", code="invalid_type")


def _input(body: dict[str, Any]) -> None:
    value = body.get("input")
    if value is None:
        raise BadRequest("'input' is required", param="input", code="missing_required_parameter")
    if isinstance(value, str):
        return
    if isinstance(value, list) and value and (
        all(isinstance(v, str) for v in value) or all(_is_int(v) for v in value)
        or all(isinstance(v, list) and all(_is_int(t) for t in v) for v in value)
    ):
        return
    raise BadRequest("'input' must be a string or a non-empty array", param="input", code="invalid_type")


def validate(endpoint: str, body: dict[str, Any], *, max_n: int, max_tokens: int) -> str:
    """Check an endpoint's body; returns the model name."""
    model = _model(body)
    if endpoint == "embeddings":
        _input(body)
        return model
    _common(body, max_n=max_n, max_tokens=max_tokens)
    if endpoint == "chat":
        _messages(body)
    else:
        _prompt(body)
    return model
