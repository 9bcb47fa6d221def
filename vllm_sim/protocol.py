"""Parse and validate request bodies the way vLLM's OpenAI server does, raising ``ApiError``.

Unknown fields are ignored (vLLM accepts extra fields), so a gateway can pass
anything through. Messages mirror vLLM's wording where a client or gateway
might match on it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Literal

import orjson

from vllm_sim.config import SimConfig
from vllm_sim.hf_tokenizer import HFPrompts
from vllm_sim.priority import body_priority
from vllm_sim.template import render_chat
from vllm_sim.tokenizer import tokenize
from vllm_sim.wire import ApiError

__all__ = ["GenerationParams", "kv_transfer_params", "parse_json", "parse_generation", "prompt_tokens",
           "resolve_max_tokens", "resolve_model"]

Kind = Literal["chat", "completions"]
_MAX_N = 128
# Tokenize prompts longer than this off the event loop (about 3 ms of work).
_OFFLOAD_CHARS = 16_384


@dataclass(slots=True)
class GenerationParams:
    kind: Kind
    model: str
    prompt_text: str | None  # None when the prompt was given as token ids
    prompt_ids: list[int] | None
    max_tokens: int | None
    n: int
    stream: bool
    include_usage: bool
    cache_salt: str | None
    # The request as sent, for a real tokenizer's chat template (HFPrompts).
    body: dict[str, Any] | None = None
    # vLLM's scheduling priority (vllm_sim.priority); the Messages route has none.
    priority: int = 0
    # P/D disaggregation's per-request params (vllm_sim.pd), as sent; None when absent.
    kv_transfer_params: dict[str, Any] | None = None


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"Invalid JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    return body


def resolve_model(body: dict[str, Any], config: SimConfig) -> str:
    model = body.get("model")
    if model is None:
        return config.model  # vLLM serves the default model when none is named
    if not isinstance(model, str) or model not in config.models:
        raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
    return model


def parse_generation(kind: Kind, body: dict[str, Any], config: SimConfig) -> GenerationParams:
    model = resolve_model(body, config)
    text: str | None
    ids: list[int] | None
    if kind == "chat":
        text, ids = _chat_prompt(body), None
        max_tokens = _opt_int(body, "max_completion_tokens", 1)
        if max_tokens is None:
            max_tokens = _opt_int(body, "max_tokens", 1)
    else:
        text, ids = _completion_prompt(body.get("prompt"))
        max_tokens = _opt_int(body, "max_tokens", 1)
    n = _opt_int(body, "n", 1)
    if n is not None and n > _MAX_N:
        raise ApiError(400, f"n must be at most {_MAX_N}.", param="n")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise ApiError(400, "stream must be a boolean.", param="stream")
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            message = "Stream options can only be defined when `stream=True`."
            raise ApiError(400, message, param="stream_options")
        if not isinstance(options, dict):
            raise ApiError(400, "stream_options must be an object.", param="stream_options")
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        message = "Parameter 'cache_salt' must be a non-empty string if provided."
        raise ApiError(400, message, param="cache_salt")
    return GenerationParams(
        kind=kind, model=model, prompt_text=text, prompt_ids=ids, max_tokens=max_tokens,
        n=n or 1, stream=bool(stream), include_usage=bool(options and options.get("include_usage")),
        cache_salt=salt, body=body, priority=body_priority(body),
        kv_transfer_params=kv_transfer_params(body),
    )


def kv_transfer_params(body: dict[str, Any]) -> dict[str, Any] | None:
    """The request's ``kv_transfer_params``: an object or null, as vLLM's models type it."""
    params = body.get("kv_transfer_params")
    if params is not None and not isinstance(params, dict):
        raise ApiError(400, "kv_transfer_params must be an object.", param="kv_transfer_params")
    return params


async def prompt_tokens(params: GenerationParams, prompts: HFPrompts | None = None) -> list[int]:
    """The prompt's token ids; long texts are tokenized in a worker thread to keep the loop free.

    With ``prompts`` (a real tokenizer), chat requests go through its chat template
    and completions text through its tokenizer; otherwise the built-in stand-in."""
    if params.prompt_ids is not None:
        return params.prompt_ids
    text = params.prompt_text or ""
    if prompts is not None:
        body = params.body or {}
        if params.kind == "chat":
            work: Callable[[], list[int]] = partial(prompts.chat, body)
        else:
            work = partial(prompts.completion, text, body)
    else:
        work = partial(tokenize, text)
    if len(text) > _OFFLOAD_CHARS:
        return await asyncio.to_thread(work)
    return work()


def resolve_max_tokens(params: GenerationParams, num_prompt: int, config: SimConfig) -> int | None:
    """Check the context length; returns the explicit max_tokens (None: default length)."""
    limit = config.max_model_len
    if num_prompt == 0:
        raise ApiError(400, "The decoder prompt cannot be empty", param="prompt")
    if num_prompt >= limit:
        raise ApiError(
            400,
            f"This model's maximum context length is {limit} tokens. However, your request has "
            f"{num_prompt} input tokens. Please reduce the length of the input messages.",
        )
    if params.max_tokens is not None and num_prompt + params.max_tokens > limit:
        raise ApiError(
            400,
            f"'max_tokens' or 'max_completion_tokens' is too large: {params.max_tokens}. This model's "
            f"maximum context length is {limit} tokens and your request has {num_prompt} input tokens "
            f"({params.max_tokens} > {limit} - {num_prompt}).",
            param="max_tokens",
        )
    return params.max_tokens


def _chat_prompt(body: dict[str, Any]) -> str:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list.", param="messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a string 'role'.", param="messages")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise ApiError(400, "tools must be a list.", param="tools")
    return render_chat(messages, tools)


def _completion_prompt(prompt: Any) -> tuple[str | None, list[int] | None]:
    # A string, a list of one string, token ids, or a list of one list of token ids.
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, list) and prompt and all(_is_token_id(t) for t in prompt):
        return None, prompt
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str) for p in prompt):
        raise ApiError(400, "The simulator accepts one prompt per request.", param="prompt")
    raise ApiError(400, "prompt must be a string or a list of token ids.", param="prompt")


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 32


def _opt_int(body: dict[str, Any], name: str, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ApiError(400, f"{name} must be an integer >= {minimum}.", param=name)
    return value
