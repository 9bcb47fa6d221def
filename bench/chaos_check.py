"""The one right answer for a chat request to vllm_sim, and a verdict on what a client received.

vllm_sim is deterministic: choice ``i`` of a chat request is
``ReplyWriter(reply_seed(tokenize(render_chat(messages, tools)), i))`` called
``max_tokens`` times (or ``default_length(seed)`` times, ending with "stop",
when the request sets no limit). So a load generator can judge every response
it gets — from a replica, a retry or the semantic cache — against that answer.

Verdicts (``Verdict.kind``):

* ``ok``: a complete, correct answer (text, finish_reason, and usage when asked for).
* ``clean``: a failure the client can understand: an OpenAI-shaped HTTP error,
  or a stream that carries a correct prefix of the answer and ends with exactly
  one ``data: {"error": ...}`` event (no ``[DONE]``).
* ``lost``: no usable ending: a transport error, a stream ending with neither
  ``[DONE]`` nor an error event, an error body that is not OpenAI-shaped.
* ``wrong``: served text that is not the answer (or, for a failed stream, not a
  prefix of it), a ``finish_reason`` or ``[DONE]`` invented after a failure,
  garbage passed through as a success.

Everything here is pure: bytes in, a verdict out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from vllm_sim.reply import ReplyWriter, default_length, reply_seed
from vllm_sim.template import render_chat
from vllm_sim.tokenizer import tokenize

__all__ = ["Expected", "Verdict", "expected_answer", "judge_unary", "judge_stream", "split_events"]

Kind = Literal["ok", "clean", "lost", "wrong"]


@dataclass(frozen=True, slots=True)
class Expected:
    texts: tuple[str, ...]  # one per choice index
    finish_reason: str
    completion_tokens: int

    @property
    def n(self) -> int:
        return len(self.texts)


@dataclass(frozen=True, slots=True)
class Verdict:
    kind: Kind
    detail: str  # short and stable: counted per scenario
    tokens_before_error: int = 0


def expected_answer(body: dict[str, Any]) -> Expected:
    """What vllm_sim answers to this chat body, whatever replica or cache serves it."""
    ids = tokenize(render_chat(body["messages"], body.get("tools")))
    limit = body.get("max_completion_tokens")
    if limit is None:
        limit = body.get("max_tokens")
    texts = []
    total = 0
    for index in range(body.get("n") or 1):
        seed = reply_seed(ids, index)
        count = max(1, limit if limit is not None else default_length(seed))
        writer = ReplyWriter(seed)
        texts.append("".join(writer.next_token() for _ in range(count)))
        total += count
    return Expected(tuple(texts), "length" if limit is not None else "stop", total)


# -- errors ---------------------------------------------------------------------------------------
def _openai_error(obj: Any) -> bool:
    err = obj.get("error") if isinstance(obj, dict) else None
    return isinstance(err, dict) and isinstance(err.get("message"), str) and bool(err["message"])


def _judge_error_status(status: int, body: bytes) -> Verdict:
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return Verdict("lost", f"http {status} with a non-JSON body")
    if not _openai_error(obj):
        return Verdict("lost", f"http {status} with a non-OpenAI body")
    return Verdict("clean", f"http {status}: {_message(obj)}")


def _message(obj: dict[str, Any]) -> str:
    # Replica names and ports vary from run to run; the rest of the message is the stable part.
    text = str(obj["error"]["message"])[:90]
    return " ".join("r#" if w.rstrip(",.:;)").startswith("r") and w.rstrip(",.:;)")[1:].isdigit() else w
                    for w in text.split())


# -- non-streaming --------------------------------------------------------------------------------
def judge_unary(exp: Expected, status: int, body: bytes, *, transport_error: str | None = None) -> Verdict:
    if transport_error is not None:
        return Verdict("lost", f"transport: {transport_error}")
    if status != 200:
        return _judge_error_status(status, body)
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return Verdict("wrong", "200 with a body that is not JSON")
    if not isinstance(obj, dict) or not isinstance(obj.get("choices"), list):
        return Verdict("wrong", "200 without choices")
    choices = {c.get("index"): c for c in obj["choices"] if isinstance(c, dict)}
    if set(choices) != set(range(exp.n)):
        return Verdict("wrong", "wrong set of choice indexes")
    for index, text in enumerate(exp.texts):
        choice = choices[index]
        message = choice.get("message") or {}
        if (message.get("content") or "") != text:
            return Verdict("wrong", "unary text differs from the answer")
        if choice.get("finish_reason") != exp.finish_reason:
            return Verdict("wrong", f"unary finish_reason {choice.get('finish_reason')!r}")
    usage = obj.get("usage")
    if isinstance(usage, dict) and usage.get("completion_tokens") not in (None, exp.completion_tokens):
        return Verdict("wrong", "unary usage.completion_tokens differs")
    return Verdict("ok", "unary")


# -- streaming ------------------------------------------------------------------------------------
def split_events(raw: bytes) -> tuple[list[bytes], bytes]:
    """SSE ``data`` payloads of each complete event, and any unterminated tail."""
    text = raw.replace(b"\r\n", b"\n")
    parts = text.split(b"\n\n")
    tail = parts.pop()
    events = []
    for part in parts:
        lines = [ln[5:].lstrip(b" ") if ln.startswith(b"data:") else None for ln in part.split(b"\n")]
        data = [ln for ln in lines if ln is not None]
        if data:
            events.append(b"\n".join(data))
    return events, tail


@dataclass
class _StreamState:
    exp: Expected
    include_usage: bool
    texts: list[str] = field(default_factory=list)
    finished: list[bool] = field(default_factory=list)
    done: bool = False
    errors: int = 0
    usage: dict[str, Any] | None = None
    problem: Verdict | None = None

    def __post_init__(self) -> None:
        self.texts = [""] * self.exp.n
        self.finished = [False] * self.exp.n

    def fail(self, kind: Kind, detail: str) -> None:
        if self.problem is None:
            self.problem = Verdict(kind, detail)

    def feed(self, data: bytes) -> None:
        if self.done or self.errors:
            # Anything after a terminal event: a second error, or text/[DONE] invented after a failure.
            self.fail("wrong", "event after [DONE]" if self.done else "event after the error event")
            return
        if data == b"[DONE]":
            self.done = True
            return
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            self.fail("wrong", "malformed event passed through")
            return
        if not isinstance(obj, dict):
            self.fail("wrong", "non-object event")
        elif "error" in obj:
            self.errors += 1
            if not _openai_error(obj):
                self.fail("lost", "error event without an OpenAI error object")
        else:
            self._chunk(obj)

    def _chunk(self, obj: dict[str, Any]) -> None:
        if obj.get("usage") is not None:
            if not self.include_usage:
                self.fail("wrong", "usage chunk the client did not ask for")
            self.usage = obj["usage"]
        for choice in obj.get("choices") or ():
            index = choice.get("index") if isinstance(choice, dict) else None
            if not isinstance(index, int) or not 0 <= index < self.exp.n:
                self.fail("wrong", "chunk for a choice index that does not exist")
                continue
            if self.finished[index]:
                self.fail("wrong", "text after finish_reason")
            delta = choice.get("delta") or {}
            self.texts[index] += delta.get("content") or ""
            if not self.exp.texts[index].startswith(self.texts[index]):
                self.fail("wrong", "streamed text is not a prefix of the answer")
            reason = choice.get("finish_reason")
            if reason is not None:
                self.finished[index] = True
                if reason != self.exp.finish_reason or self.texts[index] != self.exp.texts[index]:
                    self.fail("wrong", f"invented finish_reason {reason!r}")

    def verdict(self, tail: bytes, transport_error: str | None) -> Verdict:
        if self.problem is not None:
            return self.problem
        sent = sum(len(t) for t in self.texts)
        tokens = sum(len(t.split(" ")) if t else 0 for t in self.texts)
        if self.done:
            if not all(self.finished) or self.texts != list(self.exp.texts):
                return Verdict("wrong", "[DONE] after an incomplete answer")
            if self.include_usage and (self.usage is None
                                       or self.usage.get("completion_tokens") != self.exp.completion_tokens):
                return Verdict("wrong", "usage missing or wrong")
            if transport_error is not None:
                return Verdict("lost", f"transport after [DONE]: {transport_error}")
            return Verdict("ok", "stream")
        if self.errors == 1:
            if tail.strip():
                return Verdict("lost", "bytes after the error event")
            if transport_error is not None:
                return Verdict("lost", f"transport after the error event: {transport_error}")
            where = "after tokens" if sent else "before any token"
            return Verdict("clean", f"stream error event {where}", tokens)
        if transport_error is not None:
            return Verdict("lost", f"stream cut: {transport_error}")
        return Verdict("lost", "stream ended with neither [DONE] nor an error event")


def judge_stream(exp: Expected, status: int, content_type: str, raw: bytes, *,
                 include_usage: bool = False, transport_error: str | None = None) -> Verdict:
    if status != 200:
        if transport_error is not None:
            return Verdict("lost", f"transport: {transport_error}")
        return _judge_error_status(status, raw)
    if not content_type.startswith("text/event-stream"):
        return Verdict("wrong", f"200 stream with content-type {content_type or '-'}")
    state = _StreamState(exp, include_usage)
    events, tail = split_events(raw)
    for data in events:
        state.feed(data)
    return state.verdict(tail, transport_error)
