"""Token ids of rendered-prompt segments seen before, so a shared system prompt is tokenized once.

Measured (bench/tokenization.py): tokenizing the whole rendered prompt is
nearly all of the in-process cost, and a chat's system turn is nearly all of
its text; what follows it tokenizes in a fraction of the time. A Hugging Face
tokenizer splits its input at added tokens (``<|im_end|>``, ...) before
anything else runs, and tokenizes the pieces between them independently, so
the ids of a segment that ends with such a token do not depend on what comes
after it: they can be kept and reused exactly. Which tokens are safe cut
points, and whether a tokenizer has that property at all, is decided once per
tokenizer (``cut_points``); a tokenizer that fails the check gets no cache.

Short segments (one-line turns) are kept in runs: consecutive ones from the
last cut up to the first cut where the run reaches ``MIN_SEGMENT_CHARS``. Where
those runs end depends only on the text before, so a conversation's next
request finds all its earlier runs and tokenizes only the new turns; an
agent's prompt of many short tool turns is mostly such runs.

Keys are xxh3-128 digests of the segment text, seeded by the request's
``cache_salt`` so that tenants never share an entry (a collision is beyond any
practical concern and costs a wrong routing hint at worst, never a wrong
answer); values are tuples of ids: about 36 bytes a token (a pointer and an
int object), but extending the request's list from a tuple is a copy, where a
packed ``array`` of 4 bytes a token makes an int object per token on every
hit (0.6 ms for a 16K-token segment on the loaded box). Bounded by total
tokens held, least recently used first out.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any, Callable

import xxhash

__all__ = ["CutPoints", "SegmentCache", "cut_points", "MIN_SEGMENT_CHARS", "CAPACITY_TOKENS"]

log = logging.getLogger("kvgate.routing")

# Segments shorter than this are tokenized with their neighbours in one call
# rather than looked up alone: below a few hundred characters a tokenizer call
# costs about what a lookup and its bookkeeping do. Runs of them this long are
# looked up (see the module docstring).
MIN_SEGMENT_CHARS = 512
# About 36 MiB: some 250 distinct 4K-token system prompts, more than a fleet
# serves at once in any workload we know of.
CAPACITY_TOKENS = 1024 * 1024

_PROBES = ("Hello world", " leading space", "\nnew line", "x", "  two spaces")


class CutPoints:
    """Where a text may be cut: just after each occurrence of one of ``tokens``.

    ``str.find`` per token rather than one regular expression: an alternation of
    literals makes ``re`` try every position (milliseconds on a 64 KB prompt);
    ``find`` scans at memory speed. Overlaps resolve as the tokenizer's own
    matching does, leftmost first and then longest."""

    def __init__(self, tokens: list[str]) -> None:
        self.tokens = sorted(set(tokens), key=len, reverse=True)

    def ends(self, text: str) -> list[int]:
        found: list[tuple[int, int]] = []
        for token in self.tokens:
            i = text.find(token)
            while i >= 0:
                found.append((i, -len(token)))
                i = text.find(token, i + 1)
        found.sort()
        out: list[int] = []
        covered = 0
        for start, neg_len in found:
            if start >= covered:
                covered = start - neg_len
                out.append(covered)
        return out


def cut_points(tokenizer: Any, encode: Callable[[str], list[int]]) -> CutPoints | None:
    """The added tokens a rendered prompt may be cut after, or None.

    A token is a safe cut point if it is matched on the raw text (not normalised)
    and does not reach past itself (no ``rstrip``, ``single_word``). The tokenizer
    as a whole must then tokenize ``a + token + b`` as ``a + token`` followed by
    ``b``; some do not (a Metaspace pre-tokenizer that marks only the very first
    piece, for one), and the probe finds that out.
    """
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    # Only tokens the chat template writes (or names: BOS, EOS): those are where turns
    # meet; cutting at fewer places is always correct, and each token costs a scan.
    template = str(getattr(tokenizer, "chat_template", None) or "")
    named = {str(getattr(tokenizer, name, None) or "") for name in ("bos_token", "eos_token")}
    tokens = sorted({t.content for t in decoder.values()
                     if t.content and (t.content in template or t.content in named)
                     and not t.normalized and not t.rstrip and not t.single_word}, key=len, reverse=True)
    if not tokens:
        return None
    for token in tokens:
        for a in _PROBES:
            for b in _PROBES:
                if encode(a + token + b) != encode(a + token) + encode(b):
                    log.info("tokenizer splits are not independent around %r: no segment cache", token)
                    return None
    return CutPoints(tokens)


class SegmentCache:
    def __init__(self, capacity_tokens: int = CAPACITY_TOKENS) -> None:
        self.capacity_tokens = capacity_tokens
        self._entries: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()
        self._tokens = 0
        # The loop thread and the tokenizer thread both use it; held for dict operations only.
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @staticmethod
    def seed(scope: str) -> int:
        """The key seed of ``scope``, the request's ``cache_salt`` (its tenant's namespace); once a request.

        A hit saves milliseconds of tokenizing, so a cache shared across tenants would
        let one tenant time whether another sends a prompt: the very leak ``cache_salt``
        closes in vLLM. Each namespace has its own keys."""
        return xxhash.xxh3_64_intdigest(scope.encode("utf-8", "surrogatepass")) if scope else 0

    @staticmethod
    def key(segment: str, seed: int = 0) -> bytes:
        """The segment's key under ``seed`` (``seed(scope)``)."""
        return xxhash.xxh3_128_digest(segment.encode("utf-8", "surrogatepass"), seed)

    def get(self, key: bytes) -> tuple[int, ...] | None:
        with self._lock:
            ids = self._entries.get(key)
            if ids is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return ids

    def put(self, key: bytes, ids: list[int]) -> None:
        if len(ids) > self.capacity_tokens:
            return
        packed = tuple(ids)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._tokens -= len(old)
            self._entries[key] = packed
            self._tokens += len(packed)
            while self._tokens > self.capacity_tokens:
                _, evicted = self._entries.popitem(last=False)
                self._tokens -= len(evicted)

    def stats(self) -> dict[str, int]:
        return {"segments": len(self._entries), "tokens": self._tokens, "hits": self.hits, "misses": self.misses}
