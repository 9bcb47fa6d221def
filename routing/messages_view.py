"""An Anthropic Messages body seen in the chat shape the canonical stream is defined on.

``/v1/messages`` carries the same layers as a chat request, spelled
differently: ``system`` is a top-level string or list of content blocks,
tools have an ``input_schema``, tool calls and results are ``tool_use`` and
``tool_result`` blocks inside the messages. Routing (``hashing.render``) and
prompt hygiene read a chat body, so this view puts ``system`` in front as a
``system`` message and leaves everything else where the client put it: the
blocks render by the chat rules (text blocks as text, any other block as its
canonical JSON, ``cache_control`` keys as breakpoints, never as bytes).

One thing is dropped because the engine never sees it: vLLM removes system
text blocks that start with Claude Code's ``x-anthropic-billing-header`` (a
per-request hash that would otherwise defeat prefix caching), so a key built
on it would change with every request while vLLM's cache does not.

Pure: the input is never mutated; the view shares the client's objects.
"""

from __future__ import annotations

from typing import Any

__all__ = ["BILLING_HEADER_PREFIX", "chat_view", "is_billing_header"]

BILLING_HEADER_PREFIX = "x-anthropic-billing-header"


def is_billing_header(block: Any) -> bool:
    """A system text block vLLM strips before rendering (see the module docstring)."""
    return (isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str)
            and block["text"].startswith(BILLING_HEADER_PREFIX))


def _system_message(system: Any) -> dict[str, Any] | None:
    if isinstance(system, str):
        return {"role": "system", "content": system} if system else None
    if isinstance(system, list):
        blocks = [b for b in system if not is_billing_header(b)]
        return {"role": "system", "content": blocks} if blocks else None
    return None if system is None else {"role": "system", "content": system}


def chat_view(body: dict[str, Any]) -> dict[str, Any]:
    """``{"tools", "messages"}`` of a Messages body, its ``system`` first among the messages."""
    view: dict[str, Any] = {}
    tools = body.get("tools")
    if tools is not None:
        view["tools"] = tools
    messages = body.get("messages")
    system = _system_message(body.get("system"))
    if system is None:
        view["messages"] = messages
    else:
        view["messages"] = [system, *messages] if isinstance(messages, list) else [system]
    return view
