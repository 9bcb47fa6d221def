"""Deterministic pseudo-English text whose token ids are known without re-tokenising it.

Every segment is a pure function of its name (a seeded draw of vocabulary
words), so runs are reproducible and a segment can be regenerated instead of
stored. Words have 2 to 7 letters, so with ``vllm_sim``'s tokenizer a word,
or a space and a word, is exactly one token; each vocabulary piece is
tokenised once, with the simulator's own tokenizer, and a segment's ids are
those of its words.

Segments are designed to concatenate exactly: a ``paragraph`` starts with a
word and ends with a newline, a ``run`` is a sequence of " word" pieces; at
those seams the tokenizer splits the same way whether it sees the whole text
or the pieces, so a prompt's ids are the concatenation of its segments' ids
(``tests/test_routing_bench.py`` checks this against ``tokenize`` of the
whole text). That keeps a 34K-token prompt from being tokenised per request.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Any

import numpy as np
import xxhash

from vllm_sim.template import render_chat
from vllm_sim.tokenizer import tokenize

__all__ = ["TextBank", "TokenCache", "chat_tokens"]

_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _single(text: str) -> int:
    ids = tokenize(text)
    if len(ids) != 1:
        raise AssertionError(f"{text!r} is {len(ids)} tokens; the text bank needs exactly one")
    return ids[0]


class TextBank:
    """Named segments and their token ids, generated on first use and memoised (LRU)."""

    def __init__(self, seed: int = 0, vocabulary: int = 4096, memo: int = 1 << 16) -> None:
        rng = random.Random(seed)
        words = sorted({"".join(rng.choices(_LETTERS, k=rng.randint(2, 7))) for _ in range(vocabulary)})
        self._seed = seed
        self._vocab = np.array(words, dtype=object)
        self._bare = np.array([_single(w) for w in words], dtype=np.int64)
        self._spaced = np.array([_single(" " + w) for w in words], dtype=np.int64)
        self._newline = _single("\n")
        self._memo: OrderedDict[tuple[str, str, int], Any] = OrderedDict()
        self._capacity = memo

    def _draw(self, name: str, n: int) -> np.ndarray:
        # Always draw in multiples of 512 so a shorter segment is a prefix of a longer one.
        size = -(-max(n, 1) // 512) * 512
        rng = np.random.default_rng(xxhash.xxh64_intdigest(name.encode(), self._seed))
        return rng.integers(0, len(self._vocab), size)[:n]

    def _memoised(self, key: tuple[str, str, int], make) -> Any:
        hit = self._memo.get(key)
        if hit is not None:
            self._memo.move_to_end(key)
            return hit
        value = self._memo[key] = make()
        if len(self._memo) > self._capacity:
            self._memo.popitem(last=False)
        return value

    def run(self, name: str, tokens: int) -> str:
        """``tokens`` pieces of " word": exactly that many tokens."""
        return self._memoised(("rt", name, tokens), lambda: " " + " ".join(self._vocab[self._draw(name, tokens)]))

    def run_ids(self, name: str, tokens: int) -> list[int]:
        return self._memoised(("ri", name, tokens), lambda: self._spaced[self._draw(name, tokens)].tolist())

    def paragraph(self, name: str, tokens: int) -> str:
        """A word, more words, a newline: exactly ``tokens`` tokens (at least 2)."""
        return self._memoised(
            ("pt", name, tokens), lambda: " ".join(self._vocab[self._draw(name, max(1, tokens - 1))]) + "\n")

    def paragraph_ids(self, name: str, tokens: int) -> list[int]:
        def make() -> list[int]:
            idx = self._draw(name, max(1, tokens - 1))
            return [int(self._bare[idx[0]])] + self._spaced[idx[1:]].tolist() + [self._newline]
        return self._memoised(("pi", name, tokens), make)


class TokenCache:
    """Token ids of arbitrary named text (chat-template pieces, real dialogue), LRU-bounded."""

    def __init__(self, capacity: int = 4096) -> None:
        self._ids: OrderedDict[str, list[int]] = OrderedDict()
        self._capacity = capacity

    def get(self, name: str, text: str) -> list[int]:
        ids = self._ids.get(name)
        if ids is None:
            ids = self._ids[name] = tokenize(text)
            if len(self._ids) > self._capacity:
                self._ids.popitem(last=False)
        else:
            self._ids.move_to_end(name)
        return ids


def chat_tokens(cache: TokenCache, messages: list[tuple[str, list[list[int]]]]) -> list[int]:
    """Token ids of ``render_chat`` for messages given as (role, [segment ids, ...]).

    The chat template wraps each message in ``<|im_start|>role\\n ... <|im_end|>\\n``;
    with paragraph segments those seams split cleanly, so the ids concatenate.
    """
    ids: list[int] = []
    for role, segments in messages:
        ids += cache.get(f"<hdr:{role}>", f"<|im_start|>{role}\n")
        for seg in segments:
            ids += seg
        ids += cache.get("<end>", "<|im_end|>\n")
    ids += cache.get("<gen>", render_chat([], add_generation_prompt=True))
    return ids
