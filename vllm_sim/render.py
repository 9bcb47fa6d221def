"""vLLM's render routes: a request's prompt token ids and sampling parameters, without generating.

``POST /v1/chat/completions/render`` answers one ``GenerateRequest`` and
``POST /v1/completions/render`` a list of them, one per prompt, as vLLM 0.33's
``vllm launch render`` and ``vllm serve`` do. Routers tokenize through these
routes: vLLM's own router (``vllm-router``, policy ``cache_aware``) asks a
worker for the chat render of every request and falls back to ``/tokenize``.

The token ids are the ones a generation request with the same body prefills
here (the same ``parse_generation`` and ``prompt_tokens`` path), so a router
that tokenizes through the simulator hashes what its KV pool caches. The
sampling parameters are what vLLM's ``SamplingParams`` serialises
(``omit_defaults``) for the request fields the simulator reads; fields it does
not model (logit bias, structured outputs, ...) are left at vLLM's defaults
and so omitted, as vLLM omits them when they are unset. The test suite
compares whole responses with vLLM's own render server.
"""

from __future__ import annotations

import uuid
from typing import Any

from vllm_sim.config import SimConfig
from vllm_sim.hf_tokenizer import HFPrompts
from vllm_sim.protocol import Kind, parse_generation, prompt_tokens
from vllm_sim.wire import ApiError

__all__ = ["render_chat", "render_completion"]

# vLLM's RequestOutputKind: what its engine streams back.
_DELTA, _FINAL_ONLY = 1, 2
# vLLM's _SAMPLING_EPS: below it sampling is greedy and top_p, top_k, min_p are reset (so omitted).
_GREEDY = 1e-5
# vLLM 0.33's server-side default chat template kwargs (``--default-chat-template-kwargs``).
_TEMPLATE_DEFAULTS = {"cohere_format": "cmd4"}


def _request_id(body: dict[str, Any], header_id: str | None, prefix: str) -> str:
    # vLLM: the X-Request-Id header, else the body's request_id, else a fresh 16-hex id.
    base = header_id if header_id is not None else body.get("request_id")
    return f"{prefix}-{base if isinstance(base, str) else uuid.uuid4().hex[:16]}"


def _number(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ApiError(400, f"{name} must be a number.", param=name)
    return float(value)


def _stop(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return stop
    raise ApiError(400, "stop must be a string or a list of strings.", param="stop")


def _nonempty(ids: list[int]) -> list[int]:
    if not ids:
        raise ApiError(400, "No token_ids rendered")
    return ids


def _max_tokens(kind: Kind, requested: int | None, num_prompt: int, config: SimConfig) -> int:
    """vLLM's get_max_tokens: the request's max_tokens (chat: none; completions: 16) capped by the room left."""
    limit = config.max_model_len
    if requested is not None and requested > limit:
        raise ApiError(400, f"max_tokens={requested} cannot be greater than max_model_len={limit}. "
                            f"Please request fewer output tokens. (parameter=max_tokens, value={requested})",
                       param="max_tokens")
    if num_prompt > limit:
        # vLLM stops tokenizing one token past the limit, so it reports limit + 1, not the length.
        raise ApiError(400, f"This model's maximum context length is {limit} tokens. However, your prompt "
                            f"contains at least {limit + 1} input tokens, which exceeds this limit even without "
                            f"any output tokens. Please reduce the length of the input prompt. "
                            f"(parameter=input_tokens, value={limit + 1})", param="input_tokens")
    if requested is None and kind == "completions":
        requested = 16  # CompletionRequest's default
    room = limit - num_prompt
    return room if requested is None else min(room, requested)


def _sampling_params(kind: Kind, body: dict[str, Any], max_tokens: int, n: int, stream: bool) -> dict[str, Any]:
    """SamplingParams as vLLM serialises it: fields equal to their defaults are omitted."""
    temperature = _number(body, "temperature", 1.0)
    params: dict[str, Any] = {}
    if n != 1:
        params["n"] = n
    params.update(presence_penalty=_number(body, "presence_penalty", 0.0),
                  frequency_penalty=_number(body, "frequency_penalty", 0.0),
                  repetition_penalty=_number(body, "repetition_penalty", 1.0), temperature=temperature)
    if temperature >= _GREEDY:
        params["top_p"] = _number(body, "top_p", 1.0)
        top_k = body.get("top_k")
        if isinstance(top_k, int) and not isinstance(top_k, bool) and top_k > 0:
            params["top_k"] = top_k
        params["min_p"] = _number(body, "min_p", 0.0)
    seed = body.get("seed")
    if isinstance(seed, int) and not isinstance(seed, bool):
        params["seed"] = seed
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise ApiError(400, "stop_token_ids must be a list of integers.", param="stop_token_ids")
    params.update(stop=_stop(body), stop_token_ids=stop_ids)
    if body.get("ignore_eos") is True:
        params["ignore_eos"] = True
    if max_tokens != 16:  # SamplingParams' own default, so vLLM leaves it out
        params["max_tokens"] = max_tokens
    min_tokens = body.get("min_tokens")
    if isinstance(min_tokens, int) and not isinstance(min_tokens, bool) and min_tokens > 0:
        params["min_tokens"] = min_tokens
    if body.get("skip_special_tokens") is False:
        params["skip_special_tokens"] = False
    params.update(output_kind=_DELTA if stream else _FINAL_ONLY, skip_clone=True, bad_words=[],
                  skip_reading_prefix_cache=False)
    return params


def _stream_options(body: dict[str, Any], stream: bool) -> dict[str, Any] | None:
    options = body.get("stream_options")
    if not stream or not isinstance(options, dict):
        return None
    return {"include_usage": bool(options.get("include_usage", True)),
            "continuous_usage_stats": bool(options.get("continuous_usage_stats", False))}


def _generate_request(kind: Kind, body: dict[str, Any], model: str, rid: str, ids: list[int],
                      max_tokens: int, n: int, stream: bool) -> dict[str, Any]:
    return {"request_id": rid, "token_ids": ids, "token_offsets": None, "features": None, "content_parts": None,
            "sampling_params": _sampling_params(kind, body, max_tokens, n, stream), "model": model,
            "reasoning_ended": None, "reasoning_parser_kwargs": None, "return_token_ids": body.get("return_token_ids"),
            "output_mode": "tokens", "parse_context": _parse_context(body) if kind == "chat" else None,
            "stream": stream, "stream_options": _stream_options(body, stream),
            "cache_salt": body.get("cache_salt"), "priority": body.get("priority") or 0,
            "kv_transfer_params": body.get("kv_transfer_params"), "ec_transfer_params": None}


def _parse_context(body: dict[str, Any]) -> dict[str, Any]:
    """What a generate server needs to parse the chat output (vLLM's ParseContext)."""
    tools = body.get("tools")
    if tools:
        # vLLM's ChatCompletionToolsParam spells out a missing description as null.
        functions = [t["function"] for t in tools if isinstance(t, dict) and isinstance(t.get("function"), dict)]
        tools = [{"type": "function", "function": {"name": f.get("name"), "description": f.get("description"),
                                                    "parameters": f.get("parameters")}} for f in functions]
    kwargs = {**_TEMPLATE_DEFAULTS, **(body.get("chat_template_kwargs") or {}),
              "add_generation_prompt": body.get("add_generation_prompt", True),
              "continue_final_message": body.get("continue_final_message", False)}
    history = sum(len(m.get("tool_calls") or []) for m in body.get("messages") or [] if isinstance(m, dict))
    return {"tools": tools or None, "tool_choice": body.get("tool_choice") or ("auto" if tools else "none"),
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "include_reasoning": body.get("include_reasoning", True), "chat_template_kwargs": kwargs,
            "history_tool_call_cnt": history}


async def render_chat(body: dict[str, Any], config: SimConfig, prompts: HFPrompts | None,
                      header_id: str | None = None) -> dict[str, Any]:
    """vLLM's ``/v1/chat/completions/render``: one GenerateRequest."""
    params = parse_generation("chat", body, config)
    ids = _nonempty(await prompt_tokens(params, prompts))
    max_tokens = _max_tokens("chat", params.max_tokens, len(ids), config)
    return _generate_request("chat", body, params.model, _request_id(body, header_id, "chatcmpl"), ids,
                             max_tokens, params.n, params.stream)


def _prompts(prompt: Any) -> list[Any]:
    # Several prompts (strings or token-id lists) render one entry each, as in vLLM.
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        return prompt
    return [prompt]


async def render_completion(body: dict[str, Any], config: SimConfig, prompts: HFPrompts | None,
                            header_id: str | None = None) -> list[dict[str, Any]]:
    """vLLM's ``/v1/completions/render``: one GenerateRequest per prompt."""
    base = _request_id(body, header_id, "cmpl")
    many = _prompts(body.get("prompt"))
    out = []
    for i, prompt in enumerate(many):
        params = parse_generation("completions", {**body, "prompt": prompt}, config)
        ids = _nonempty(await prompt_tokens(params, prompts))
        max_tokens = _max_tokens("completions", params.max_tokens, len(ids), config)
        rid = base if len(many) == 1 else f"{base}-{i}"
        out.append(_generate_request("completions", body, params.model, rid, ids, max_tokens, params.n,
                                     params.stream))
    return out
