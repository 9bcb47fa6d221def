"""A Responses API body seen as the chat request it becomes, for the checks written for chat.

vLLM renders a Responses request as chat: ``instructions`` as the system message,
then the input items. Prompt hygiene reads that view, so volatile text in an
agent's instructions is reported exactly as in a chat system prompt. Pure; the
body is not modified.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["as_chat"]

_TEXT = ("input_text", "output_text", "text")


def _content(content: Any) -> Any:
    if not isinstance(content, list):
        return content
    return [{"type": "text", "text": p.get("text", "")} if isinstance(p, dict) and p.get("type") in _TEXT else p
            for p in content]


def as_chat(body: Mapping[str, Any]) -> dict[str, Any]:
    messages: list[dict[str, Any]] = []
    if isinstance(body.get("instructions"), str):
        messages.append({"role": "system", "content": body["instructions"]})
    items = body.get("input")
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    elif isinstance(items, list):
        for item in items:
            if isinstance(item, dict) and item.get("type", "message") == "message" and "role" in item:
                messages.append({"role": item["role"], "content": _content(item.get("content"))})
    view: dict[str, Any] = {"messages": messages}
    if isinstance(body.get("tools"), list):
        view["tools"] = body["tools"]
    return view
