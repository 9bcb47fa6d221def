"""Anthropic's Messages API: the body and header checks, and the headers that travel upstream.

* ``validate_messages``: the body checks a replica would otherwise answer with
  a pydantic dump (vLLM validates ``/v1/messages`` with its own models and
  answers validation errors in OpenAI's shape), plus the ``anthropic-version``
  header. Unknown fields and block types pass through: the replica decides.
* ``upstream_headers``: ``anthropic-version`` / ``anthropic-beta`` travel on
  (vLLM ignores them today; a replica that reads them gets what the client
  said). Credentials never do: the proxy builds upstream headers from scratch.

Authentication needs nothing here: ``x-api-key`` is one of the headers
``policies.keys`` reads, so a tenant key there authenticates exactly as
``Authorization: Bearer`` does.
"""

from __future__ import annotations

import re
from typing import Any

from gateway.errors import BadRequest
from gateway.proxy.validate import _bool_field, _int_field, _model, _num_field

__all__ = ["validate_messages", "upstream_headers"]

# vLLM accepts these roles on /v1/messages (system messages inline, too).
_ROLES = frozenset({"user", "assistant", "system"})
# A version is a date ("2023-06-01"); a beta list is comma-separated tokens.
_VERSION = re.compile(r"[0-9A-Za-z._-]{1,32}")
_BETA = re.compile(r"[0-9A-Za-z._\-, ]{1,512}")


def upstream_headers(headers: dict[str, str]) -> dict[str, str]:
    out = {}
    for name in ("anthropic-version", "anthropic-beta"):
        value = headers.get(name)
        if value is not None and (_VERSION if name == "anthropic-version" else _BETA).fullmatch(value):
            out[name] = value
    return out


def _check_version(headers: dict[str, str]) -> None:
    # Optional (curl users and OpenAI-style clients omit it), but never forwarded malformed.
    version = headers.get("anthropic-version")
    if version is not None and not _VERSION.fullmatch(version):
        raise BadRequest("'anthropic-version' header must be a version such as 2023-06-01",
                         param="anthropic-version", code="invalid_header")


def _bad(message: str, param: str, code: str = "invalid_type") -> BadRequest:
    return BadRequest(message, param=param, code=code)


def _blocks(content: Any, where: str) -> None:
    """A list of content blocks: objects with a string ``type`` (text blocks with string text)."""
    if not isinstance(content, list):
        raise _bad(f"'{where}' must be a string or an array of content blocks", where)
    for i, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise _bad("each content block must be an object with a string 'type'", f"{where}.{i}")
        if block["type"] == "text" and not isinstance(block.get("text"), str):
            raise _bad("a text block needs a string 'text'", f"{where}.{i}.text")


def _messages(body: dict[str, Any]) -> None:
    messages = body.get("messages")
    if messages is None:
        raise _bad("'messages' is required", "messages", "missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty array", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise _bad("each message must be an object", f"messages.{i}")
        if m.get("role") not in _ROLES:
            raise _bad(f"'role' must be one of {sorted(_ROLES)}", f"messages.{i}.role", "invalid_value")
        content = m.get("content")
        if content is None:
            raise _bad("'content' is required", f"messages.{i}.content", "missing_required_parameter")
        if not isinstance(content, str):
            _blocks(content, f"messages.{i}.content")


def _tools(body: dict[str, Any]) -> None:
    system = body.get("system")
    if system is not None and not isinstance(system, str):
        _blocks(system, "system")
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise _bad("'tools' must be an array", "tools")
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
                raise _bad("each tool must be an object with a string 'name'", f"tools.{i}")
            if "input_schema" in tool and not isinstance(tool["input_schema"], dict):
                raise _bad("'input_schema' must be an object", f"tools.{i}.input_schema")
    choice = body.get("tool_choice")
    if choice is not None and not (isinstance(choice, dict) and isinstance(choice.get("type"), str)):
        raise _bad("'tool_choice' must be an object with a string 'type'", "tool_choice")


def validate_messages(endpoint: str, body: dict[str, Any], headers: dict[str, str], *, max_tokens: int) -> str:
    """Check a /v1/messages (or count_tokens) body and its headers; returns the model name."""
    _check_version(headers)
    model = _model(body)
    _messages(body)
    _tools(body)
    if endpoint == "count_tokens":
        return model
    if body.get("max_tokens") is None:
        raise _bad("'max_tokens' is required", "max_tokens", "missing_required_parameter")
    _int_field(body, "max_tokens", 1, max_tokens)
    _bool_field(body, "stream")
    # vLLM's sampling ranges (Anthropic's own API stops temperature at 1).
    _num_field(body, "temperature", 0.0, 2.0)
    _num_field(body, "top_p", 0.0, 1.0)
    _int_field(body, "top_k", -1, 1 << 31)
    stops = body.get("stop_sequences")
    if stops is not None and not (isinstance(stops, list) and all(isinstance(s, str) for s in stops)):
        raise _bad("'stop_sequences' must be an array of strings", "stop_sequences")
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise _bad("'metadata' must be an object", "metadata")
    return model
