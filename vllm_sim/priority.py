"""A request's ``priority``, read as vLLM 0.33's OpenAI server reads it.

The chat, completions and Responses request models carry ``priority: int = 0``
(``ge=-2**63, le=2**63-1``); the Anthropic Messages model has none. An
``X-Vllm-Priority`` header that parses as an integer wins over the body
(``GenerateBaseServing._get_priority``, vllm/entrypoints/generate/base/serving.py).

Under ``--scheduling-policy fcfs`` vLLM 0.33 accepts a non-zero priority and
ignores it: the field's description says it "will raise an error", but no code
path in 0.33 checks it (the V0 engine's "Got priority ... but Priority
scheduling is not enabled." is gone), so neither does the simulator.

A body value pydantic would reject gets vLLM's global validation answer:
400, type "Bad Request", param "body.priority", pydantic's wording.
"""

from __future__ import annotations

from typing import Any, Iterable

from vllm_sim.wire import ApiError

__all__ = ["PRIORITY_HEADER", "body_priority", "header_priority"]

PRIORITY_HEADER = b"x-vllm-priority"
_MIN, _MAX = -(2**63), 2**63 - 1


def body_priority(body: dict[str, Any]) -> int:
    """The body's ``priority`` (0 when absent); raises ``ApiError`` for a value vLLM's model refuses."""
    if "priority" not in body:
        return 0
    return _validate(body["priority"])


def header_priority(headers: Iterable[tuple[bytes, bytes]], body_value: int) -> int:
    """The header's integer if it has one, else ``body_value`` (the body was validated first, as by pydantic)."""
    for name, value in headers:
        if name.lower() == PRIORITY_HEADER:
            try:
                return int(value.decode("latin-1"))
            except ValueError:
                return body_value  # vLLM falls back to the body when the header is not an integer
    return body_value


def _validate(value: Any) -> int:
    """Pydantic's lax ``int`` with vLLM's bounds: bools, integral floats and numeric strings pass."""
    if isinstance(value, bool):
        number = int(value)
    elif isinstance(value, int):
        number = value
    elif isinstance(value, float):
        if not value.is_integer():
            raise _invalid("int_from_float", "Input should be a valid integer, got a number with a fractional "
                           "part", value)
        number = int(value)
    elif isinstance(value, str):
        try:
            number = int(value.strip())
        except ValueError:
            raise _invalid("int_parsing", "Input should be a valid integer, unable to parse string as an "
                           "integer", value) from None
    else:
        raise _invalid("int_type", "Input should be a valid integer", value)
    if number > _MAX:
        raise _invalid("less_than_equal", f"Input should be less than or equal to {_MAX}", value, {"le": _MAX})
    if number < _MIN:
        raise _invalid("greater_than_equal", f"Input should be greater than or equal to {_MIN}", value,
                       {"ge": _MIN})
    return number


def _invalid(kind: str, msg: str, value: Any, ctx: dict[str, int] | None = None) -> ApiError:
    # vLLM's validation_exception_handler: "1 validation error:" then each error dict's str().
    error: dict[str, Any] = {"type": kind, "loc": ("body", "priority"), "msg": msg, "input": _shown(value)}
    if ctx:
        error["ctx"] = ctx
    return ApiError(400, f"1 validation error:\n  {error}", "Bad Request", "body.priority")


def _shown(value: Any) -> str:
    """vLLM's ``_summarize_error_input``: containers described, everything else as ``str``, 200 characters."""
    if isinstance(value, (list, dict)):
        return f"<{type(value).__name__} of {len(value)} items>"
    text = str(value)
    return text[:200] + "...[truncated]" if len(text) > 200 else text
