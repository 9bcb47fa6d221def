"""Prefix hashing: a request's prompt as a canonical byte stream and chained block hashes.

A gateway cannot reproduce vLLM's token-block hashes (it would need the
tokenizer and the chat template), so, like every production router, kvgate
computes its own keys with the same *shape*: the prompt is cut into
fixed-size blocks (``block_chars`` bytes, about 16 tokens at 4 characters a
token) and each block's hash chains its parent's, seeded by the model and the
tenant namespace (the ``cache_salt`` seed, so two tenants never share keys,
exactly as they never share KV). Two requests therefore share leading hashes
exactly as far as their canonical streams agree, and a difference anywhere
changes every later hash: the cache matches a prefix, not a set.

The canonical stream keeps everything that changes the prompt the engine sees,
in order (tools, then each message's role, name, content parts and tool calls,
or the completions prompt), with control-character separators so that moving
text between fields cannot produce the same bytes. It drops what never reaches
the engine: ``cache_control`` keys on content parts, messages and tools.

Everything here is pure: the same body always gives the same bytes and hashes.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

import xxhash

from .messages_view import chat_view

__all__ = ["Rendered", "Span", "render", "prefix_seed", "chain_hashes", "cut_hash"]

_xxh = xxhash.xxh3_64_intdigest

# Separators never produced by printable text: a record separator opens a
# message, a unit separator ends its header, a group separator opens a field.
_MSG = b"\x1e"
_HDR = b"\x1f"
_FIELD = b"\x1d"

# Text parts render as their text: chat's "text", the Responses API's input and output text.
_TEXT_PARTS = ("text", "input_text", "output_text")
# Keys of a Responses input item that never reach the engine (item ids, status).
_ITEM_NOISE = ("id", "status")


# Span and Rendered are named tuples, not frozen dataclasses: made for every message of
# every request, and a frozen dataclass costs three times as much to build.
class Span(NamedTuple):
    """One message (or the tools block, or a completions prompt) in the stream."""

    role: str
    start: int  # byte offset of the span's first byte (its separator)
    end: int  # byte offset just past it


class Rendered(NamedTuple):
    """A request's canonical stream plus the structure routing needs."""

    data: bytes
    spans: tuple[Span, ...]
    # Offsets just past each content part, message or tool that carried an
    # Anthropic-style ``cache_control`` breakpoint.
    breakpoints: tuple[int, ...]


def prefix_seed(model: str, namespace: str) -> int:
    """The chain's root: requests for another model or tenant share no block."""
    return _xxh(model.encode("utf-8", "surrogatepass") + b"\x00" + namespace.encode("utf-8", "surrogatepass"))


def _enc(text: str) -> bytes:
    # Lone surrogates are legal in JSON strings; they must hash, not crash.
    return text.encode("utf-8", "surrogatepass")


def _json(value: Any) -> bytes:
    return _enc(json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True, default=str))


def _without_cache_control(obj: Any) -> Any:
    if isinstance(obj, dict) and "cache_control" in obj:
        return {k: v for k, v in obj.items() if k != "cache_control"}
    return obj


class _Writer:
    """Accumulates byte pieces and knows the running offset."""

    __slots__ = ("pieces", "pos", "spans", "breakpoints")

    def __init__(self) -> None:
        self.pieces: list[bytes] = []
        self.pos = 0
        self.spans: list[Span] = []
        self.breakpoints: list[int] = []

    def put(self, piece: bytes) -> None:
        self.pieces.append(piece)
        self.pos += len(piece)

    def finish(self) -> Rendered:
        return Rendered(b"".join(self.pieces), tuple(self.spans), tuple(self.breakpoints))


def _put_content(w: _Writer, content: Any) -> None:
    if content is None:
        return
    if isinstance(content, str):
        w.put(_enc(content))
        return
    if not isinstance(content, list):
        w.put(_json(content))
        return
    for part in content:
        if isinstance(part, str):
            w.put(_enc(part))
        elif isinstance(part, dict):
            if part.get("type", "text") in _TEXT_PARTS and isinstance(part.get("text"), str):
                w.put(_FIELD + b"text" + _HDR + _enc(part["text"]))
            else:
                # Images, audio, files: their canonical JSON stands for their content.
                w.put(_FIELD + _json(_without_cache_control(part)))
            if "cache_control" in part:
                w.breakpoints.append(w.pos)
        else:
            w.put(_FIELD + _json(part))


def _put_message(w: _Writer, message: Any) -> None:
    start = w.pos
    if not isinstance(message, dict):
        w.put(_MSG + _json(message))
        w.spans.append(Span("unknown", start, w.pos))
        return
    role = message.get("role")
    role = role if isinstance(role, str) else "unknown"
    header = role
    if isinstance(message.get("name"), str):
        header += ":" + message["name"]
    if isinstance(message.get("tool_call_id"), str):
        header += "#" + message["tool_call_id"]
    w.put(_MSG + _enc(header) + _HDR)
    content = message.get("content")
    if isinstance(content, str):
        w.put(_enc(content))  # the common case, without the detour
    else:
        _put_content(w, content)
    if message.get("tool_calls"):
        w.put(_FIELD + b"tool_calls" + _HDR + _json(message["tool_calls"]))
    if "cache_control" in message:
        w.breakpoints.append(w.pos)
    w.spans.append(Span(role, start, w.pos))


def _put_tools(w: _Writer, tools: list[Any]) -> None:
    start = w.pos
    w.put(_FIELD + b"tools" + _HDR)
    for tool in tools:
        # Tools render in the client's order: vLLM's template does too, so a
        # reordered tool list really is a different prefix.
        w.put(_json(_without_cache_control(tool)) + b"\n")
        if isinstance(tool, dict) and "cache_control" in tool:
            w.breakpoints.append(w.pos)
    w.spans.append(Span("tools", start, w.pos))


def _put_prompt(w: _Writer, prompt: Any, role: str) -> None:
    start = w.pos
    w.put(_FIELD + _enc(role) + _HDR)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch: each prompt is served separately; route on the first
    if isinstance(prompt, str):
        w.put(_enc(prompt))
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        w.put(b"".join(int(t & 0xFFFFFFFF).to_bytes(4, "little") for t in prompt))
    elif prompt is not None:
        w.put(_json(prompt))
    w.spans.append(Span(role, start, w.pos))


def _put_responses(w: _Writer, body: dict[str, Any]) -> None:
    """A Responses request as the chat stream it becomes: instructions as the system
    message, then the stored conversation (stood for by its id), then the input items.

    So tools + instructions, the part agents keep stable, are the shared head; a
    ``previous_response_id`` continues a history only its replica knows, so it
    opens a span of its own after that head.
    """
    if isinstance(body.get("instructions"), str):
        _put_message(w, {"role": "system", "content": body["instructions"]})
    prev = body.get("previous_response_id")
    if isinstance(prev, str):
        start = w.pos
        w.put(_MSG + b"previous_response" + _HDR + _enc(prev))
        w.spans.append(Span("previous_response", start, w.pos))
    items = body.get("input")
    if isinstance(items, str):
        _put_message(w, {"role": "user", "content": items})
        return
    if not isinstance(items, list):
        return
    for item in items:
        if isinstance(item, dict) and item.get("type", "message") == "message" and "role" in item:
            _put_message(w, item)
        elif isinstance(item, dict):
            # function_call, function_call_output, reasoning...: their canonical JSON,
            # less the keys the engine never sees, under the item type as the role.
            kind = item.get("type")
            start = w.pos
            w.put(_MSG + _enc(kind if isinstance(kind, str) else "item") + _HDR
                  + _json({k: v for k, v in item.items() if k not in _ITEM_NOISE}))
            w.spans.append(Span(kind if isinstance(kind, str) else "item", start, w.pos))
        else:
            _put_message(w, item)


# Anthropic Messages bodies render as the chat body they are (``routing.messages_view``).
MESSAGES_ENDPOINTS = frozenset({"messages", "count_tokens"})


def render(endpoint: str, body: dict[str, Any]) -> Rendered:
    """The canonical byte stream of a request body (chat, completions, embeddings, responses or messages)."""
    if endpoint in MESSAGES_ENDPOINTS:
        body = chat_view(body)
    w = _Writer()
    tools = body.get("tools")
    if isinstance(tools, list) and tools:
        _put_tools(w, tools)
    if endpoint == "responses":
        _put_responses(w, body)
        return w.finish()
    messages = body.get("messages")
    if isinstance(messages, list):
        for message in messages:
            _put_message(w, message)
    elif "prompt" in body:
        _put_prompt(w, body.get("prompt"), "prompt")
    elif "input" in body:
        _put_prompt(w, body.get("input"), "input")
    return w.finish()


def chain_hashes(data: bytes, seed: int, block: int, max_blocks: int, start: int = 0) -> list[int]:
    """xxh3-64 of each full ``block``-byte block, each seeded by its parent's hash.

    Only full blocks are hashed, as vLLM caches only full blocks. With ``start``,
    the chain's blocks from ``start`` on, ``seed`` being the hash of block
    ``start - 1`` (a known prefix's chain continued). Bytes slices beat memoryview
    slices here (measured: about 0.2 us a block).
    """
    n = min(len(data) // block, max_blocks)
    out: list[int] = []
    append = out.append
    h = seed
    for off in range(start * block, n * block, block):
        h = _xxh(data[off : off + block], h)
        append(h)
    return out


def cut_hash(data: bytes, hashes: list[int], seed: int, block: int, offset: int) -> int:
    """Hash of the exact prefix ``data[:offset]``, reusing the chain for its full blocks.

    Equals ``hashes[offset // block - 1]`` when ``offset`` is block-aligned, so a
    key on a block boundary and the block index agree.
    """
    full = offset // block
    if full > len(hashes):
        raise ValueError("offset lies past the hashed blocks (max_blocks); clamp it first")
    parent = hashes[full - 1] if full else seed
    base = full * block
    if base == offset:
        return parent
    return _xxh(data[base:offset], parent)
