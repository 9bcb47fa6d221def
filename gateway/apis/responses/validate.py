"""Validate a Responses API body (``POST /v1/responses``) before anything is forwarded.

Pure, like ``validate``: a dict in, the model name or a ``BadRequest`` (with
``param`` set, in OpenAI's shape) out. It checks what the gateway relies on
(the model, the input items it routes by, the flags it acts on) and what a
replica would otherwise answer confusingly; the replica checks the rest, and
unknown fields pass through.
"""

from __future__ import annotations

from typing import Any

from gateway.errors import BadRequest
from gateway.proxy.validate import _bool_field, _int_field, _model, _num_field

_ROLES = {"user", "assistant", "system", "developer"}


def _input_item(i: int, item: Any) -> None:
    where = f"input.{i}"
    if not isinstance(item, dict):
        raise BadRequest("each input item must be an object", param=where, code="invalid_type")
    kind = item.get("type", "message")
    if not isinstance(kind, str):
        raise BadRequest("'type' must be a string", param=f"{where}.type", code="invalid_type")
    if kind != "message":
        return  # function_call, function_call_output, reasoning, ...: the replica knows their fields
    if item.get("role") not in _ROLES:
        raise BadRequest(f"'role' must be one of {sorted(_ROLES)}", param=f"{where}.role", code="invalid_value")
    content = item.get("content")
    if not isinstance(content, (str, list)):
        raise BadRequest("'content' must be a string or an array of parts", param=f"{where}.content",
                         code="invalid_type")
    if isinstance(content, list) and not all(isinstance(p, dict) for p in content):
        raise BadRequest("each content part must be an object", param=f"{where}.content", code="invalid_type")


def validate_responses(body: dict[str, Any], *, max_tokens: int) -> str:
    """Check a Responses body; returns the model name."""
    model = _model(body)
    value = body.get("input")
    if value is None:
        raise BadRequest("'input' is required", param="input", code="missing_required_parameter")
    if isinstance(value, list):
        if not value:
            raise BadRequest("'input' must not be an empty array", param="input", code="invalid_value")
        for i, item in enumerate(value):
            _input_item(i, item)
    elif not isinstance(value, str):
        raise BadRequest("'input' must be a string or an array of input items", param="input",
                         code="invalid_type")
    for name in ("stream", "store", "background", "parallel_tool_calls"):
        _bool_field(body, name)
    _int_field(body, "max_output_tokens", 1, max_tokens)
    _num_field(body, "temperature", 0.0, 2.0)
    _num_field(body, "top_p", 0.0, 1.0)
    for name in ("instructions", "previous_response_id"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise BadRequest(f"'{name}' must be a string", param=name, code="invalid_type")
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise BadRequest("'tools' must be an array of objects", param="tools", code="invalid_type")
    if body.get("background") and body.get("store") is False:
        raise BadRequest("'background' needs 'store': a background response is only reachable once stored",
                         param="background", code="invalid_value")
    return model
