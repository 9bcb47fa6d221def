"""Plain data passed between the cache's seams (no behaviour, no I/O)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

Endpoint = Literal["chat", "completions"]


@dataclass(frozen=True)
class CacheRequest:
    """What the cache needs to know about one request; built by ``cache_request``.

    ``bypass_reason`` set means: do not look up. ``store_ok`` says whether the
    answer may still be stored (true only for ``Cache-Control: no-cache``, a
    refresh: skip the cached answer, replace it with the fresh one).
    """

    bypass_reason: str | None
    endpoint: str
    namespace: str
    model: str
    partition: str = ""
    exact_key: str = ""
    # Normalised final user message (``normalize.query_text``); "" when bypassed.
    query: str = ""
    # Whether the semantic tier applies (else exact tier only).
    semantic: bool = False
    store_ok: bool = False


@dataclass(frozen=True)
class CachedAnswer:
    """A complete, successful upstream answer, as stored and replayed."""

    content: str
    finish_reason: str
    model: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    created: int = 0
    tool_calls: list[dict[str, Any]] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "content": self.content, "finish_reason": self.finish_reason, "model": self.model,
            "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
            "created": self.created, "tool_calls": self.tool_calls,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CachedAnswer":
        return cls(
            content=str(d["content"]), finish_reason=str(d["finish_reason"]), model=str(d["model"]),
            prompt_tokens=int(d.get("prompt_tokens") or 0),
            completion_tokens=int(d.get("completion_tokens") or 0),
            created=int(d.get("created") or 0), tool_calls=d.get("tool_calls"),
        )


@dataclass(frozen=True)
class Lookup:
    """The outcome of ``SemanticCache.lookup``; never an exception."""

    status: Literal["hit", "miss", "bypass"]
    answer: CachedAnswer | None = None
    similarity: float | None = None
    tier: Literal["exact", "semantic"] | None = None
    # Why it was a miss or bypass (e.g. "no_candidate", "verifier:number", "store_degraded").
    reason: str | None = None
    # On a miss: the query's embedding (a vector, or a future of one, or None), for the
    # store to reuse instead of embedding the same text again.
    embedding: Any = field(default=None, repr=False, compare=False)


@dataclass
class Entry:
    """One stored answer with everything needed to index and re-check it.

    ``id`` is the request's exact key: storing the same request again replaces
    the entry instead of duplicating it, and an exact lookup is one read.
    """

    id: str
    namespace: str
    model: str
    partition: str
    endpoint: str
    query: str
    answer: CachedAnswer
    created: float
    expires_at: float
    vector: np.ndarray | None = field(default=None, repr=False)
