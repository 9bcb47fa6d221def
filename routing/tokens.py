"""The token ids vLLM will prefill for a request, so routing can key on real tokens.

A ``TokenSource`` answers ``prompt_ids(endpoint, body)`` for one served model:

* ``HFTokenSource(dir)``: in process, with the model's Hugging Face tokenizer
  directory and chat template (the files the replicas load). It follows vLLM's
  own preprocessing (``vllm/entrypoints/chat_utils.py`` and the serving
  classes): text parts of a message joined with newlines, tool-call arguments
  given to the template as objects, the template rendered to text and then
  tokenized with ``add_special_tokens`` False for chat and True for
  completions, ``truncate_prompt_tokens`` keeping the tail. Messages and
  Responses bodies first become the chat body vLLM makes of them
  (``routing.vllm_chat``), then take the chat path. The parity tests
  compare it with vLLM's render server (tests/test_tokens_parity.py).
* ``RenderTokenSource(url)`` (``routing.render_tokens``): asks a vLLM render
  server, for models whose preprocessing kvgate does not reproduce.

``None`` means "no exact ids for this request" (a part kvgate cannot render, a
template error, a request vLLM will reject): routing then falls back to its
approximate keys for that request. A token source never raises into the
request path and never turns a request into a client error.
"""

from __future__ import annotations

import asyncio
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Protocol, TypeVar, runtime_checkable

from .token_cache import MIN_SEGMENT_CHARS, SegmentCache, cut_points
from .vllm_chat import DISABLED_THINKING_PROBE, EFFORTS, Unrenderable, chat_tools, messages_as_chat, \
    needs_system_first, responses_as_chat

__all__ = ["TokenSource", "HFTokenSource", "INLINE_MAX_CHARS", "TOKEN_ENDPOINTS"]

log = logging.getLogger("kvgate.routing")

_T = TypeVar("_T")

# Text up to this many characters is tokenized on the event loop; more goes to the
# tokenizer thread. A hop to a thread and back costs some tens of microseconds,
# about what tokenizing this much text costs (WordPiece or BPE, a few characters
# a microsecond): past it the loop would be held for longer than the hop costs.
INLINE_MAX_CHARS = 512


@runtime_checkable
class TokenSource(Protocol):
    async def prompt_ids(self, endpoint: str, body: dict[str, Any]) -> list[int] | None:
        """The ids vLLM will prefill for this request body, or None when they cannot be known."""
        ...


# Arguments the gateway passes itself; a request naming them in chat_template_kwargs
# is one whose rendering vLLM decides differently (or rejects).
_RESERVED_KWARGS = frozenset({"chat_template", "tokenize", "tools", "conversation", "messages",
                              "add_generation_prompt", "continue_final_message", "documents", "return_dict"})


_BACKEND_PROBES = ("Hello, World! café 日本 🙂", "  leading and trailing  ", "a<|im_start|>b<|im_end|>\n[CLS]x",
                   "line\n\nbreaks\ttabs")


# The endpoints whose requests carry token ids: each prefills a prompt vLLM renders
# through the chat template (Messages and Responses after vLLM's own conversion to
# chat, routing.vllm_chat) or tokenizes as text. count_tokens prefills nothing, and
# embeddings and the utility routes are routed by load, so ids would buy them nothing.
TOKEN_ENDPOINTS = frozenset({"chat", "completions", "messages", "responses"})


_TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "thinking": "thinking",
               "refusal": "refusal"}
# Claude Code's attribution line: vLLM drops it from system text (it changes every request).
_BILLING_HEADER = "x-anthropic-billing-header"


def _flatten_content(content: Any, role: str) -> str:
    """A message's content as a string-format template sees it (vLLM: text parts joined by "\\n")."""
    if content is None:
        return ""
    parts = [content] if isinstance(content, str) else content
    if not isinstance(parts, list):
        raise Unrenderable("content")
    texts = []
    for part in parts:
        if isinstance(part, str):
            text: Any = part
        elif isinstance(part, dict) and part.get("type") in _TEXT_PARTS:
            text = part.get(_TEXT_PARTS[part["type"]])
            if text is None:
                continue  # vLLM skips a text part without text
            if not isinstance(text, str):
                raise Unrenderable("text part")
        else:
            # Images, audio, files: the replica's encoder output is not text we can tokenize.
            raise Unrenderable("non-text content part")
        if role == "system" and text.startswith(_BILLING_HEADER):
            text = text.partition("\n")[2]
            if not text:
                continue
        texts.append(text)
    return "\n".join(texts)


def _arguments(value: Any) -> dict[str, Any]:
    # vLLM hands templates the arguments as an object, not the JSON string the
    # client sent; anything that is not a JSON object becomes {} (as vLLM does).
    if isinstance(value, dict):
        return value
    if isinstance(value, str) and value:
        try:
            parsed = json.loads(value)
        except ValueError:
            return {}
        return parsed if isinstance(parsed, dict) else {}
    return {}


def _conversation(messages: Any) -> list[dict[str, Any]]:
    """The messages as vLLM rebuilds them for the template (chat_utils.parse_chat_messages).

    vLLM keeps only the fields it knows of each message, so an unknown field a
    client sends changes nothing here either.
    """
    if not isinstance(messages, list) or not messages:
        raise Unrenderable("messages")
    out = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise Unrenderable("message")
        role = message["role"]
        m: dict[str, Any] = {"role": role, "content": _flatten_content(message.get("content"), role)}
        if role == "assistant":
            calls = message.get("tool_calls")
            if isinstance(calls, list) and calls:
                fixed = []
                for call in calls:
                    if not isinstance(call, dict) or call.get("type", "function") != "function" \
                            or not isinstance(call.get("function"), dict):
                        raise Unrenderable("tool call")  # vLLM answers 400
                    fixed.append({**call, "function": {**call["function"],
                                                       "arguments": _arguments(call["function"].get("arguments"))}})
                m["tool_calls"] = fixed
            elif calls is not None and not isinstance(calls, list):
                m["tool_calls"] = calls
            reasoning = message.get("reasoning")
            if reasoning is not None:
                m["reasoning"] = m["reasoning_content"] = reasoning
        elif role == "tool" and "tool_call_id" in message:
            m["tool_call_id"] = message["tool_call_id"]
        if isinstance(message.get("name"), str):
            m["name"] = message["name"]
        if isinstance(message.get("task"), str):
            m["task"] = message["task"]
        if role == "developer":
            m["tools"] = message.get("tools")
        out.append(m)
    return out


def _developer_as_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM's fallback for templates without a developer role: system messages, merged into one first."""
    converted = [{k: v for k, v in m.items() if k != "tools"} | {"role": "system"} if m["role"] == "developer"
                 else m for m in conversation]
    systems = [i for i, m in enumerate(converted) if m["role"] == "system"]
    if not systems or systems == [0]:
        return converted
    merged = "\n\n".join(c for m in converted if m["role"] == "system" and (c := m.get("content")))
    return [{"role": "system", "content": merged}, *(m for m in converted if m["role"] != "system")]


def _keep_tail(ids: list[int], body: dict[str, Any]) -> list[int]:
    """``truncate_prompt_tokens``: vLLM keeps the last k tokens (the first k with truncation_side right)."""
    k = body.get("truncate_prompt_tokens")
    if k is None:
        return ids
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise Unrenderable("truncate_prompt_tokens")  # -1 means the model's length: unknown here
    if k >= len(ids):
        return ids
    return ids[:k] if body.get("truncation_side") == "right" else ids[-k:]


class HFTokenSource:
    """vLLM's prompt ids computed in process from a Hugging Face tokenizer directory."""

    def __init__(self, tokenizer_dir: str | Path, *, inline_max_chars: int = INLINE_MAX_CHARS) -> None:
        from transformers import AutoTokenizer

        self.tokenizer_dir = str(tokenizer_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_dir, local_files_only=True)
        self.chat_template: str | None = getattr(self.tokenizer, "chat_template", None) or None
        # vLLM turns developer messages into system ones for a template that does not name the role.
        self.template_has_developer = bool(self.chat_template) and (
            '"developer"' in str(self.chat_template) or "'developer'" in str(self.chat_template))
        if self.chat_template is None:
            log.warning("tokenizer %s has no chat template; chat requests route approximately", self.tokenizer_dir)
        self.inline_max_chars = inline_max_chars
        # One thread: a tokenizer is not safe to reconfigure from two threads at once,
        # and one long prompt at a time is all the cores can spare from the proxy anyway.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvgate-tokenize")
        # The first call settles the tokenizer's truncation/padding state; doing it
        # here means no two threads ever race to change it.
        self.tokenizer("warm up", add_special_tokens=True)
        self.failures = 0
        self.offloaded = 0
        self._truncating_tok: Any = None
        # The Rust tokenizer behind a fast one, called directly for segments: the
        # transformers wrapper costs more per call than a short segment's tokenization.
        # Used only if it gives the wrapper's ids (checked here).
        self._backend: Any = None
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None and all(
                backend.encode_batch([t], add_special_tokens=False)[0].ids
                == list(self.tokenizer(t, add_special_tokens=False).input_ids) for t in _BACKEND_PROBES):
            self._backend = backend
        # Rendered chat prompts are cut after added tokens (<|im_end|>, ...) and the ids
        # of long segments kept (routing.token_cache), when this tokenizer allows it.
        self._cuts = cut_points(self.tokenizer, self._encode)
        self.cache: SegmentCache | None = SegmentCache() if self._cuts is not None else None
        # The ids the tokenizer puts around a text when asked for special tokens (BOS, ...),
        # for requests tokenized with them through the segment cache; None if it does more.
        self._wrap = _special_wrap(self.tokenizer, self._encode)
        # What vLLM decides once per model for /v1/messages, decided here the same way.
        templates = self.chat_template.values() if isinstance(self.chat_template, dict) else [self.chat_template]
        self.merge_inline_system = any(needs_system_first(t) for t in templates)
        self.disabled_thinking_effort = self._disabled_thinking_effort()

    def _disabled_thinking_effort(self) -> str:
        """vLLM's DisabledThinkingEffortResolver: "none" unless the template rejects or ignores it."""
        if self.chat_template is None:
            return "none"  # chat is never rendered here then
        try:
            none = self._chat_ids({"messages": DISABLED_THINKING_PROBE, "reasoning_effort": "none"})
            if any(self._chat_ids({"messages": DISABLED_THINKING_PROBE, "reasoning_effort": e}) == none
                   for e in EFFORTS):
                return "low"
        except Exception:  # the template refuses "none"
            return "low"
        return "none"

    def _as_chat(self, endpoint: str, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """Messages and Responses bodies as the chat body vLLM renders for them."""
        if endpoint == "messages":
            return "chat", messages_as_chat(body, merge_inline_system=self.merge_inline_system,
                                            disabled_thinking_effort=self.disabled_thinking_effort)
        if endpoint == "responses":
            return "chat", responses_as_chat(body)
        return endpoint, body

    async def prompt_ids(self, endpoint: str, body: dict[str, Any]) -> list[int] | None:
        if endpoint not in TOKEN_ENDPOINTS:
            return None
        try:
            endpoint, body = self._as_chat(endpoint, body)
            size = _size(endpoint, body)
            if endpoint == "chat" and self._segmented(body):
                # Render and look the segments up here (cheap); tokenize what is new
                # here or in the thread, by how much of it there is.
                items, uncached = self._chat_plan(body)
                if uncached <= self.inline_max_chars:
                    return _keep_tail(self._finish(items), body)
                return _keep_tail(await self._offload(self._finish, items), body)
            truncating = endpoint == "completions" and body.get("truncate_prompt_tokens") is not None
            if size <= self.inline_max_chars and not truncating:
                return self._ids(endpoint, body)
            return await self._offload(self._ids, endpoint, body)
        except Unrenderable:
            return None
        except Exception:  # a template error or a body vLLM would reject: route approximately
            self.failures += 1
            log.debug("tokenization failed; routing approximately", exc_info=True)
            return None

    async def _offload(self, fn: Callable[..., _T], *args: Any) -> _T:
        self.offloaded += 1
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def ids(self, endpoint: str, body: dict[str, Any]) -> list[int] | None:
        """Synchronous ``prompt_ids`` (benchmarks, tests): same answer, on the calling thread."""
        try:
            return self._ids(*self._as_chat(endpoint, body))
        except Exception:
            return None

    def _ids(self, endpoint: str, body: dict[str, Any]) -> list[int]:
        if endpoint == "chat" and self._segmented(body):
            return _keep_tail(self._finish(self._chat_plan(body)[0]), body)
        if endpoint == "chat":
            return _keep_tail(self._chat_ids(body), body)
        if endpoint == "completions":
            return _keep_tail(self._completion_ids(body), body)
        raise Unrenderable(endpoint)

    def _segmented(self, body: dict[str, Any]) -> bool:
        """Whether this chat request goes through the segment cache (its special tokens can be added to it)."""
        return self.cache is not None and (self._wrap is not None or not _special_tokens(body))

    def _chat_ids(self, body: dict[str, Any]) -> list[int]:
        # Without the segment cache: as vLLM's renderer calls it (renderers/hf.py safe_apply_chat_template):
        # tokenized by the template call itself, so no BOS is added a second time.
        conversation, tools, kwargs = self._template_args(body)
        if _special_tokens(body):
            # vLLM renders the text, then encodes it with the tokenizer's special tokens (a
            # second BOS where the template writes one: vLLM does that too).
            text = self.tokenizer.apply_chat_template(conversation, tools=tools, tokenize=False, **kwargs)
            return list(self.tokenizer(text, add_special_tokens=True).input_ids)
        ids = self.tokenizer.apply_chat_template(conversation, tools=tools, tokenize=True, return_dict=False,
                                                 **kwargs)
        return list(ids)

    def _chat_plan(self, body: dict[str, Any]) -> tuple[list[Any], int]:
        """The rendered prompt as cached ids (tuples) and [text, cache key or None] still to tokenize,
        and how many characters those hold.

        The same ids as ``_chat_ids``: the template's text tokenized without special
        tokens, piece by piece at cut points (``routing.token_cache``)."""
        assert self.cache is not None and self._cuts is not None
        conversation, tools, kwargs = self._template_args(body)
        text = self.tokenizer.apply_chat_template(conversation, tools=tools, tokenize=False, **kwargs)
        if not isinstance(text, str):
            raise Unrenderable("template output")
        items: list[Any] = []
        uncached = 0
        pending = start = 0  # text[pending:start] is short segments not yet handed on
        salt = body.get("cache_salt")
        seed = self.cache.seed(salt if isinstance(salt, str) else "")  # one namespace's entries

        def segment(begin: int, end: int) -> None:
            nonlocal uncached
            assert self.cache is not None
            piece = text[begin:end]
            key = self.cache.key(piece, seed)
            cached = self.cache.get(key)
            if cached is None:
                items.append([piece, key])
                uncached += len(piece)
            else:
                items.append(cached)

        for end in [*self._cuts.ends(text), len(text)]:
            if end - start >= MIN_SEGMENT_CHARS:
                # A long segment (a system prompt) is looked up alone, so the short turns
                # before it (which vary) do not change its key.
                if pending < start:
                    items.append([text[pending:start], None])
                    uncached += start - pending
                segment(start, end)
                pending = end
            elif end - pending >= MIN_SEGMENT_CHARS:
                # Short turns are kept in runs of at least MIN_SEGMENT_CHARS, cut where the
                # run first reaches it: a function of the text before the cut only, so the
                # next request of a conversation (the same turns, then new ones) finds every
                # run again and tokenizes only its new turns (an agent's many short turns).
                segment(pending, end)
                pending = end
            start = end
        if pending < len(text):
            items.append([text[pending:], None])
            uncached += len(text) - pending
        if _special_tokens(body):
            assert self._wrap is not None
            items = [self._wrap[0], *items, self._wrap[1]]
        return items, uncached

    def _finish(self, items: list[Any]) -> list[int]:
        assert self.cache is not None
        out: list[int] = []
        for item in items:
            if isinstance(item, list):
                segment, key = item
                ids = self._encode(segment)
                if key is not None:
                    self.cache.put(key, ids)
                out.extend(ids)
            else:
                out.extend(item)
        return out

    def _encode(self, text: str) -> list[int]:
        if self._backend is not None:
            # encode_batch, not encode: only the batch call lets go of the GIL while the
            # Rust code runs, so the event loop goes on serving during a long segment.
            return self._backend.encode_batch([text], add_special_tokens=False)[0].ids  # type: ignore[no-any-return]
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def _template_args(self, body: dict[str, Any]) -> tuple[list[dict[str, Any]], Any, dict[str, Any]]:
        template = self.chat_template
        if template is None or body.get("chat_template") is not None:
            # A request-supplied template is refused by vLLM unless the operator trusts it.
            raise Unrenderable("chat template")
        add_generation_prompt = body.get("add_generation_prompt", True)
        continue_final = body.get("continue_final_message", False)
        if add_generation_prompt and continue_final:
            raise Unrenderable("vLLM rejects add_generation_prompt with continue_final_message")
        extra = body.get("chat_template_kwargs") or {}
        if not isinstance(extra, dict) or _RESERVED_KWARGS & extra.keys():
            raise Unrenderable("chat_template_kwargs")
        kwargs: dict[str, Any] = {**extra, "add_generation_prompt": bool(add_generation_prompt),
                                  "continue_final_message": bool(continue_final)}
        for name in ("documents", "reasoning_effort"):
            if body.get(name) is not None:
                kwargs[name] = body[name]
        if body.get("reasoning_effort") is not None and "enable_thinking" not in extra:
            # vLLM turns thinking on for templates that need asking (Qwen3, Gemma 4) unless told "none".
            kwargs["enable_thinking"] = body["reasoning_effort"] != "none"
        conversation = _conversation(body.get("messages"))
        if not self.template_has_developer and any(m["role"] == "developer" for m in conversation):
            conversation = _developer_as_system(conversation)
        return conversation, chat_tools(body.get("tools")), kwargs

    def _completion_ids(self, body: dict[str, Any]) -> list[int]:
        prompt = body.get("prompt")
        # A list of prompts is a batch: vLLM runs each as its own request; the
        # gateway routes the batch as one, keyed on its first prompt.
        if isinstance(prompt, list) and prompt and not _is_ids(prompt):
            prompt = prompt[0]
        if isinstance(prompt, list) and _is_ids(prompt):
            return list(prompt)
        if not isinstance(prompt, str):
            raise Unrenderable("prompt")
        special = bool(body.get("add_special_tokens", True))
        k = body.get("truncate_prompt_tokens")
        if _positive_int(k) and body.get("truncation_side") is None:
            # vLLM truncates text in the tokenizer (left side), which keeps the special
            # tokens and drops text: not the same as slicing the ids afterwards.
            return list(self._truncating()(prompt, add_special_tokens=special, truncation=True,
                                           max_length=k).input_ids)
        return list(self.tokenizer(prompt, add_special_tokens=special).input_ids)

    def _truncating(self) -> Any:
        """A second instance for truncating calls, only ever used on the tokenizer thread:
        truncation is tokenizer state, and changing it under a concurrent call on the
        loop thread would break that call."""
        if self._truncating_tok is None:
            from transformers import AutoTokenizer

            self._truncating_tok = AutoTokenizer.from_pretrained(self.tokenizer_dir, local_files_only=True,
                                                                 truncation_side="left")
        return self._truncating_tok

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _special_tokens(body: dict[str, Any]) -> bool:
    """A chat request's ``add_special_tokens`` (False unless set; Responses bodies set it, routing.vllm_chat)."""
    value = body.get("add_special_tokens", False)
    if not isinstance(value, bool):
        raise Unrenderable("add_special_tokens")
    return value


def _special_wrap(tokenizer: Any, encode: Callable[[str], list[int]]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(before, after): the ids ``tokenizer(text, add_special_tokens=True)`` adds around ``encode(text)``,
    if it only ever adds those (checked on the backend probes)."""
    wrap = None
    for text in _BACKEND_PROBES:
        plain = encode(text)
        full = list(tokenizer(text, add_special_tokens=True).input_ids)
        before = next((i for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain), None)
        if before is None:
            return None
        found = (tuple(full[:before]), tuple(full[before + len(plain):]))
        if wrap is not None and found != wrap:
            return None
        wrap = found
    return wrap


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in value)


def _size(endpoint: str, body: dict[str, Any]) -> int:
    """Roughly how many characters a chat or completions request will tokenize."""
    if endpoint == "chat":
        total = 0
        for m in body.get("messages") or ():
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, str):
                total += len(content)
            elif isinstance(content, list):
                total += sum(len(p.get("text", "")) for p in content if isinstance(p, dict)
                             and isinstance(p.get("text"), str))
        if body.get("tools"):
            total += 200 * len(body["tools"])
        return total
    if endpoint == "completions":
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return len(prompt)
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            return len(prompt[0])
    return 0
