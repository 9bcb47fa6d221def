"""A ChatML-like chat template, the text the simulator tokenizes for a chat request.

Like vLLM's Jinja templates, it serialises tool schemas and tool calls with
``json.dumps`` exactly as the client sent them: two requests whose tools
differ only in key order render differently and so share no KV past that
point. That is the behaviour a gateway normalising tools has to beat, so the
simulator must not hide it by canonicalising.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["render_chat", "content_text"]


def content_text(content: Any) -> str:
    """Text of a message's content: a string, or a list of parts (text parts concatenated).

    Non-text parts (images, audio, files) render as a ``<|type|>`` placeholder:
    the simulator has no encoder, but a part must still occupy prompt space.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, str):
                out.append(part)
            elif isinstance(part, dict):
                kind = part.get("type", "text")
                out.append(str(part.get("text", "")) if kind == "text" else f"<|{kind}|>")
        return "".join(out)
    return str(content)


def _render_message(message: dict[str, Any]) -> str:
    role = message.get("role", "user")
    body = content_text(message.get("content"))
    for call in message.get("tool_calls") or ():
        body += f"\n<tool_call>\n{json.dumps(call)}\n</tool_call>"
    if role == "tool" and message.get("tool_call_id"):
        body = f"<tool_response id={message['tool_call_id']}>\n{body}\n</tool_response>"
    return f"<|im_start|>{role}\n{body}<|im_end|>\n"


def render_chat(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """The prompt text for a chat request: tools first, then each message, then the reply header."""
    parts = []
    if tools:
        schemas = "\n".join(json.dumps(tool) for tool in tools)
        parts.append(f"<|im_start|>system\n# Tools\n<tools>\n{schemas}\n</tools><|im_end|>\n")
    parts.extend(_render_message(m) for m in messages)
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)
