"""Cache keys and bypass decisions: a pure function of the request.

Two keys, both XXH3-128 hex digests of canonical JSON (sorted keys, no
whitespace, ASCII escapes so lone surrogates cannot break encoding):

* ``partition``: namespace, model, endpoint, and the *whole* context except the
  final user message's text: system prompt, tools, earlier turns, the final
  message's other fields, and every body field that can change the output.
  Entries are only ever compared inside one partition, so an answer can never
  cross a tenant, model, system prompt, tool set or conversation history.
* ``exact_key``: partition plus the final user message (``exact_text``).

Body fields enter the partition by default; only fields known to be transport
or bookkeeping (``stream``, ``user``, ...) are left out. An allow-list would
silently share answers across a new sampling parameter (vLLM accepts many:
``min_p``, ``repetition_penalty``, ``guided_json``...); a deny-list only costs
hit rate when a harmless field is added. Absent and default-valued fields are
*not* unified: vLLM may take defaults from the model's generation config.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

import xxhash

from .models import CacheRequest
from .normalize import exact_text, query_text
from .settings import SemanticCacheSettings

# Bump to invalidate every entry when the key layout changes.
KEY_VERSION = 1

# Fields that do not change the generated text (or are handled on their own).
_NOT_OUTPUT = frozenset({
    "messages", "prompt", "model", "stream", "stream_options", "user", "metadata", "store",
    "cache_salt", "service_tier", "n", "logprobs", "top_logprobs", "priority", "request_id",
})


class _Bypass(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def canonical_json(obj: Any) -> str:
    """Deterministic JSON: key order, spacing and integral floats (1.0 vs 1) don't matter."""
    return json.dumps(_canon(obj), sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def _canon(obj: Any) -> Any:
    if isinstance(obj, float) and obj.is_integer():
        return int(obj)
    if isinstance(obj, dict):
        return {str(k): _canon(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_canon(v) for v in obj]
    return obj


def digest(text: str) -> str:
    return xxhash.xxh3_128_hexdigest(text.encode("utf-8", "surrogatepass"))


def _text_of(content: Any) -> str | None:
    """The text of a message's content, or None when it has non-text parts.

    A list of text parts is joined with newlines, as vLLM's chat templates do,
    so ``"hi"`` and ``[{"type": "text", "text": "hi"}]`` are one prompt.
    """
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                return None
            texts.append(part["text"])
        return "\n".join(texts)
    return None


def _canon_message(msg: Any) -> Any:
    if not isinstance(msg, dict):
        raise _Bypass("invalid_messages")
    text = _text_of(msg.get("content"))
    return {**msg, "content": text} if text is not None else msg


def _client_directives(headers: Mapping[str, str]) -> set[str]:
    found: set[str] = set()
    for name, value in headers.items():
        if name.lower() in ("cache-control", "pragma"):
            found.update(d.split("=", 1)[0].strip().lower() for d in str(value).split(","))
    return found


def _check_body(body: Mapping[str, Any]) -> None:
    n = body.get("n")
    if n is not None and n != 1:
        raise _Bypass("n>1")
    lp = body.get("logprobs")
    if (lp is not None and lp is not False) or body.get("top_logprobs") not in (None, 0):
        raise _Bypass("logprobs")


def _chat_parts(body: Mapping[str, Any]) -> tuple[Any, str]:
    """(context to hash, raw final user text) for /v1/chat/completions."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _Bypass("invalid_messages")
    last = messages[-1]
    if not isinstance(last, dict) or last.get("role") != "user":
        raise _Bypass("no_final_user_message")
    text = _text_of(last.get("content"))
    if text is None:
        raise _Bypass("non_text_content")
    final_meta = {k: v for k, v in last.items() if k != "content"}
    return {"history": [_canon_message(m) for m in messages[:-1]], "final": final_meta}, text


def _completion_prompt(body: Mapping[str, Any]) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        # Token-id prompts and batches of prompts: one cached answer cannot serve them.
        raise _Bypass("unsupported_prompt")
    return prompt


def _keys(endpoint: str, namespace: str, model: str, body: Mapping[str, Any],
          settings: SemanticCacheSettings) -> tuple[str, str, str, bool]:
    """(partition, exact_key, query, semantic) or raise _Bypass."""
    params = {k: v for k, v in body.items() if k not in _NOT_OUTPUT}
    if endpoint == "chat":
        context, raw = _chat_parts(body)
        # Chat text is whitespace-normalised at the ends; inner whitespace (code) is kept.
        exact = exact_text(raw)
        semantic = True
    else:
        context, raw = None, _completion_prompt(body)
        # A completion continues the prompt byte for byte: a trailing space changes the
        # next token, so the exact key takes the prompt verbatim.
        exact = raw
        semantic = settings.semantic_completions
    query = query_text(raw)
    if not query:
        raise _Bypass("empty_query")
    payload = {"v": KEY_VERSION, "endpoint": endpoint, "ns": namespace, "model": model,
               "context": context, "params": params}
    partition = digest(canonical_json(payload))
    exact_key = digest(partition + "\x00" + exact)
    semantic = semantic and settings.semantic_enabled and len(query) <= settings.semantic_max_chars
    return partition, exact_key, query, semantic


def cache_request(endpoint: str, namespace: str, body: dict, headers: Mapping[str, str], *,
                  enabled_for_tenant: bool = True, settings: SemanticCacheSettings) -> CacheRequest:
    """Decide whether a request may use the cache, and compute its keys.

    Pure and total: any body, however malformed, yields a ``CacheRequest``
    (bypassed when it cannot be keyed); it never raises.
    """
    model = body.get("model") if isinstance(body, Mapping) else None
    model = model if isinstance(model, str) else ""

    def bypass(reason: str, store_ok: bool = False) -> CacheRequest:
        return CacheRequest(bypass_reason=reason, endpoint=endpoint, namespace=namespace, model=model,
                            store_ok=store_ok)

    if not settings.enabled:
        return bypass("disabled")
    if not enabled_for_tenant:
        return bypass("tenant_opt_out")
    if endpoint == "responses":
        # Addressable state, not just text: a stored response is retrieved and continued by
        # its id on the replica that made it, and its output items carry ids of their own. A
        # replayed answer would have neither, so the exact guarantees cannot hold (README).
        return bypass("responses_stateful")
    if endpoint not in ("chat", "completions"):
        return bypass("unsupported_endpoint")
    if not isinstance(body, Mapping):
        return bypass("invalid_body")
    if not model:
        return bypass("no_model")
    directives = _client_directives(headers)
    if "no-store" in directives:
        return bypass("no_store")
    try:
        _check_body(body)
        partition, exact_key, query, semantic = _keys(endpoint, namespace, model, body, settings)
    except _Bypass as b:
        return bypass(b.reason)
    except (TypeError, ValueError, RecursionError):
        return bypass("unhashable_request")
    reason = "no_cache" if "no-cache" in directives else None
    return CacheRequest(bypass_reason=reason, endpoint=endpoint, namespace=namespace, model=model,
                        partition=partition, exact_key=exact_key, query=query, semantic=semantic,
                        store_ok=True)
