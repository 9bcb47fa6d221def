"""A real Hugging Face tokenizer and chat template for the simulator (``--tokenizer DIR``).

By default the simulator tokenizes with its own stand-in (``vllm_sim.tokenizer``):
fast, file-free, and deliberately unlike anything kvgate computes. Precise
routing needs the opposite: the replica's prompt ids must be the ones vLLM
would prefill, so that block hashes and KV events name the same tokens the
gateway computed. With a tokenizer directory (``vllm_sim.tokenizer_dir``
builds one) the simulator renders and tokenizes as vLLM does: the template
applied by ``transformers`` with the tools, tokenized inside that call (no
extra BOS); completions text encoded with the tokenizer's special tokens.

This is written apart from kvgate's ``routing.tokens`` on purpose: the two
share only the files, and the parity tests hold both to vLLM's render server.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vllm_sim.wire import ApiError

__all__ = ["HFPrompts"]

_TEXT = {"text": "text", "input_text": "text", "output_text": "text", "thinking": "thinking", "refusal": "refusal"}


class HFPrompts:
    def __init__(self, directory: str | Path) -> None:
        from transformers import AutoTokenizer

        self.directory = str(directory)
        self.tokenizer = AutoTokenizer.from_pretrained(self.directory, local_files_only=True)
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"{directory}: the tokenizer has no chat template")

    def chat(self, body: dict[str, Any]) -> list[int]:
        add_generation_prompt = body.get("add_generation_prompt", True)
        continue_final = body.get("continue_final_message", False)
        if add_generation_prompt and continue_final:
            raise ApiError(400, "Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        messages = [self._message(m) for m in body["messages"]]
        extra = body.get("chat_template_kwargs")
        kwargs = dict(extra) if isinstance(extra, dict) else {}
        try:
            ids = self.tokenizer.apply_chat_template(
                messages, tools=body.get("tools") or None, tokenize=True, return_dict=False,
                add_generation_prompt=bool(add_generation_prompt), continue_final_message=bool(continue_final),
                **kwargs)
        except Exception as exc:  # the template rejected the conversation: vLLM answers 400
            raise ApiError(400, f"Chat template error: {exc}") from None
        return list(ids)

    def completion(self, text: str, body: dict[str, Any]) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=bool(body.get("add_special_tokens", True))).input_ids)

    @staticmethod
    def _message(message: dict[str, Any]) -> dict[str, Any]:
        role = message["role"]
        out: dict[str, Any] = {"role": role, "content": _text(message.get("content"))}
        if role == "assistant" and message.get("tool_calls"):
            out["tool_calls"] = [_call(c) for c in message["tool_calls"]]
        if role == "tool" and "tool_call_id" in message:
            out["tool_call_id"] = message["tool_call_id"]
        if isinstance(message.get("name"), str):
            out["name"] = message["name"]
        return out


def _text(content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ApiError(400, "content must be a string or a list of parts.", param="messages")
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type") in _TEXT:
            if part.get(_TEXT[part["type"]]) is not None:
                texts.append(str(part[_TEXT[part["type"]]]))
        else:
            raise ApiError(400, "This simulated model accepts text content only.", param="messages")
    return "\n".join(texts)


def _call(call: Any) -> dict[str, Any]:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise ApiError(400, "assistant tool_calls entries must be objects.", param="tool_calls")
    fn = call["function"]
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args else {}
        except ValueError:
            args = {}
    return {**call, "function": {**fn, "arguments": args if isinstance(args, dict) else {}}}
