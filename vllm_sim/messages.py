"""``/v1/messages`` and ``/v1/messages/count_tokens``: vLLM 0.33's Anthropic Messages API, simulated.

vLLM serves this route by converting the request into a chat completion
(``vllm/entrypoints/anthropic/serving.py``) and the chat stream back into
Anthropic events; the simulator does the same over its own engine, so the
prefix cache, faults, aborts and timing are the chat route's. What it mirrors:

* the conversion: ``system`` (a string or text blocks, Claude Code's
  ``x-anthropic-billing-header`` blocks dropped) becomes one system message,
  ``tool_use`` blocks become tool calls, a user's ``tool_result`` becomes a
  ``tool`` message, tools become functions. ``cache_control`` is accepted and
  ignored (vLLM's models ignore unknown keys), ``cache_salt`` salts the blocks;
* the events: ``message_start`` (with the first token, after prefill),
  ``content_block_start`` / ``_delta`` / ``_stop``, ``message_delta`` with the
  stop reason and usage, ``message_stop``; no ``ping``, no ``[DONE]``;
* the usage: ``input_tokens`` is the uncached part of the prompt,
  ``cache_read_input_tokens`` the prefix-cache hit and
  ``cache_creation_input_tokens`` the tokens newly written to the cache (as
  if ``--enable-prompt-tokens-details`` were on). ``message_start`` carries
  the whole prompt as ``input_tokens`` and no cache figures, as vLLM's first
  chunk has none yet;
* the errors: a body its pydantic models reject comes back in OpenAI's shape
  (vLLM's validation handler is global), everything else in Anthropic's,
  typed by status.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

from vllm_sim import wire
from vllm_sim.asgi import Receive, Send, Sender
from vllm_sim.engine import GenRequest, Generation, TokenEvent
from vllm_sim.handlers import GenerationEndpoint, _Format, open_request
from vllm_sim.protocol import GenerationParams, kv_transfer_params, parse_json, resolve_model
from vllm_sim.hf_tokenizer import HFPrompts
from vllm_sim.replica import Replica
from vllm_sim.template import render_chat
from vllm_sim.tokenizer import tokenize

__all__ = ["MessagesEndpoint", "CountTokensEndpoint", "to_chat", "anthropic_error"]

_BLOCK_TYPES = frozenset({"text", "image", "tool_use", "tool_result", "tool_reference", "thinking",
                          "redacted_thinking", "tool_addition", "tool_removal"})
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
_BILLING = "x-anthropic-billing-header"
_MAX_SALT = 128
_GARBAGE = b'event: content_block_delta\ndata: {"type": "content_block_delta", "delta": \n\n'


class _Invalid(wire.ApiError):
    """What vLLM's pydantic models reject: answered by the global handler, in OpenAI's shape."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(400, message, "Bad Request", param)


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def _event(kind: str, payload: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **payload}) + b"\n\n"


# -- the request -------------------------------------------------------------------------
def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(content, list):
        raise _Invalid(f"{where}: Input should be a valid string or list", where)
    for i, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") not in _BLOCK_TYPES:
            raise _Invalid(f"{where}.{i}.type: Input should be one of {sorted(_BLOCK_TYPES)}", f"{where}.{i}")
    return content


def _system_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return "" if content.startswith(_BILLING) else content
    return "".join(b["text"] for b in _blocks(content, where)
                   if b["type"] == "text" and isinstance(b.get("text"), str) and b["text"]
                   and not b["text"].startswith(_BILLING))


def _tool_result(block: dict[str, Any]) -> dict[str, Any]:
    content = block.get("content")
    if isinstance(content, list):
        content = "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("type") == "text")
    return {"role": "tool", "tool_call_id": block.get("tool_use_id") or "", "content": content or ""}


def _message(msg: dict[str, Any], where: str, out: list[dict[str, Any]]) -> None:
    role = msg["role"]
    content = msg.get("content")
    if isinstance(content, str):
        out.append({"role": role, "content": content})
        return
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for block in _blocks(content, f"{where}.content"):
        kind = block["type"]
        if kind == "text" and block.get("text"):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image":
            parts.append({"type": "image_url"})
        elif kind == "tool_use":
            function = {"name": block.get("name") or "", "arguments": json.dumps(block.get("input") or {})}
            calls.append({"id": block.get("id") or "call", "type": "function", "function": function})
        elif kind == "tool_result" and role == "user":
            out.append(_tool_result(block))
        elif kind == "tool_result":
            parts.append({"type": "text", "text": f"Tool result: {block.get('content') or ''}"})
    chat: dict[str, Any] = {"role": role}
    if calls:
        chat["tool_calls"] = calls
    if parts:
        chat["content"] = parts[0]["text"] if len(parts) == 1 and parts[0]["type"] == "text" else parts
    if role != "user" or "content" in chat:
        out.append(chat)


def to_chat(body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The chat messages and tools vLLM renders for a Messages body; raises ``_Invalid``."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise _Invalid("messages: Field required" if messages is None else "messages: Input should be a valid list",
                       "messages")
    out: list[dict[str, Any]] = []
    system = body.get("system")
    text = "" if system is None else _system_text(system, "system")
    if text:
        out.append({"role": "system", "content": text})
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or msg.get("role") not in ("user", "assistant", "system"):
            raise _Invalid(f"messages.{i}.role: Input should be 'user', 'assistant' or 'system'", f"messages.{i}")
        if msg.get("content") is None:
            raise _Invalid(f"messages.{i}.content: Field required", f"messages.{i}.content")
        if msg["role"] == "system":
            inline = _system_text(msg["content"], f"messages.{i}.content")
            if inline:
                out.append({"role": "system", "content": inline})
            continue
        _message(msg, f"messages.{i}", out)
    tools = body.get("tools")
    if tools is None:
        return out, None
    if not isinstance(tools, list):
        raise _Invalid("tools: Input should be a valid list", "tools")
    functions = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) \
                or not isinstance(tool.get("input_schema"), dict):
            raise _Invalid(f"tools.{i}: 'name' (string) and 'input_schema' (object) are required", f"tools.{i}")
        functions.append({"type": "function", "function": {"name": tool["name"], "description": tool.get("description"),
                                                           "parameters": tool["input_schema"]}})
    return out, functions


def _model(body: dict[str, Any], replica: Replica) -> str:
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise _Invalid("model: Field required", "model")
    return resolve_model(body, replica.config)


def _params(body: dict[str, Any], replica: Replica) -> GenerationParams:
    model = _model(body, replica)
    messages, tools = to_chat(body)
    max_tokens = body.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens <= 0:
        raise _Invalid("max_tokens: Field required" if max_tokens is None else "max_tokens must be positive",
                       "max_tokens")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _Invalid("stream: Input should be a valid boolean", "stream")
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt or len(salt) > _MAX_SALT
                             or any(c in salt for c in "@/\\\x00")):
        raise wire.ApiError(400, "Parameter 'cache_salt' must be at most 128 characters and must not contain "
                                 "'@', '/', '\\\\', or NUL.", param="cache_salt")
    return GenerationParams(kind="chat", model=model, prompt_text=render_chat(messages, tools), prompt_ids=None,
                            max_tokens=max_tokens, n=1, stream=bool(stream), include_usage=False, cache_salt=salt,
                            kv_transfer_params=kv_transfer_params(body))


# -- the answer --------------------------------------------------------------------------
def _usage(gen: Generation, block_size: int) -> dict[str, Any]:
    # vLLM's PrefillStats: tokens now in cached blocks minus those that were already there.
    created = max(0, min(len(gen.hashes) * block_size, gen.prompt_tokens) - gen.cached_tokens)
    return {"input_tokens": max(0, gen.prompt_tokens - gen.cached_tokens - created),
            "output_tokens": gen.completion_tokens, "cache_creation_input_tokens": created,
            "cache_read_input_tokens": gen.cached_tokens}


class _MessagesFormat(_Format):
    garbage = _GARBAGE

    def __init__(self, params: GenerationParams, rid: str, prompt_tokens: int, block_size: int) -> None:
        super().__init__(params, rid)
        self.prompt_tokens = prompt_tokens
        self.block_size = block_size

    def opening(self) -> bytes:
        # Sent with the first token: the prompt's size is known, its cache figures not yet.
        return b"".join((
            _event("message_start", {"message": {
                "id": self.rid, "type": "message", "role": "assistant", "content": [], "model": self.model,
                "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0}}}),
            _event("content_block_start", {"content_block": {"type": "text", "text": ""}, "index": 0}),
        ))

    def token(self, ev: TokenEvent) -> bytes:
        return _event("content_block_delta", {"delta": {"type": "text_delta", "text": ev.text}, "index": 0})

    def last_token(self, ev: TokenEvent, kv_params: dict[str, Any]) -> bytes:
        # A streamed prefill leg's params are not sent here (the blocks are held all the same).
        return self.token(ev)

    def closing(self, gen: Generation) -> bytes:
        return b"".join((
            _event("content_block_stop", {"index": 0}),
            _event("message_delta", {"delta": {"stop_reason": _STOP_REASONS.get(gen.finish_reasons[0] or "stop"),
                                               "stop_sequence": None},
                                     "usage": _usage(gen, self.block_size)}),
            _event("message_stop", {}),
        ))

    def response(self, gen: Generation, texts: list[list[str]]) -> dict[str, Any]:
        return {"id": self.rid, "type": "message", "role": "assistant",
                "content": [{"type": "text", "text": "".join(texts[0])}], "model": self.model,
                "stop_reason": _STOP_REASONS.get(gen.finish_reasons[0] or "", None),
                "usage": _usage(gen, self.block_size)}


class MessagesEndpoint(GenerationEndpoint):
    """``POST /v1/messages``: the chat engine behind Anthropic's request and event shapes."""

    # vLLM's AnthropicMessagesRequest has no priority: its requests all schedule at 0.
    takes_priority = False

    def __init__(self, replica: Replica) -> None:
        super().__init__(replica, "chat")

    def _error_body(self, exc: wire.ApiError) -> dict[str, Any]:
        return exc.body() if isinstance(exc, _Invalid) else anthropic_error(exc.status, exc.message)

    def _params(self, body: dict[str, Any]) -> GenerationParams:
        return _params(body, self.replica)

    def _prompts(self) -> HFPrompts | None:
        return None  # the real-tokenizer source renders chat bodies only: the simulator's own ids here

    def _format(self, params: GenerationParams, request: GenRequest) -> _Format:
        return _MessagesFormat(params, request.request_id, len(request.prompt_tokens), self.replica.config.block_size)


class CountTokensEndpoint:
    """``POST /v1/messages/count_tokens``: the rendered prompt's length, nothing generated."""

    def __init__(self, replica: Replica) -> None:
        self.replica = replica

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        sender = Sender(send)
        opened = await open_request(self.replica, receive, sender,
                                    anthropic_error(413, "Request body too large."))
        if opened is None:
            return
        raw, faults = opened
        try:
            payload = parse_json(raw)
            _model(payload, self.replica)
            messages, tools = to_chat(payload)
        except _Invalid as exc:
            await sender.json(exc.status, exc.body())
            return
        except wire.ApiError as exc:
            await sender.json(exc.status, anthropic_error(exc.status, exc.message))
            return
        n = len(tokenize(render_chat(messages, tools)))
        await sender.json(200, {"input_tokens": n, "context_management": {"original_input_tokens": n}})
