"""Deterministic reply text: the same prompt always gets the same answer.

Determinism lets tests compare a cached answer with a fresh one, and lets a
benchmark replay a trace. Every word is short enough to be exactly one token
of ``vllm_sim.tokenizer``, so ``count_tokens(reply) == completion_tokens``.
"""

from __future__ import annotations

import random
import struct
import zlib
from typing import Sequence

__all__ = ["reply_seed", "default_length", "ReplyWriter"]

_WORDS = (
    "the of and to in is it that for on with as was by at be this from are or an we can "
    "not all new one more will out up has its may our data time use any how each model "
    "cache block token fast slow route reply node queue load warm cold hit miss key value"
).split()


def reply_seed(prompt_tokens: Sequence[int], index: int = 0) -> int:
    """A 32-bit seed from the prompt's ids; ``index`` separates the choices of an n > 1 request."""
    packed = struct.pack(f"<{len(prompt_tokens)}q", *prompt_tokens)
    return zlib.crc32(packed, index)


def default_length(seed: int) -> int:
    """Reply length (16..64 tokens) when the request sets no max_tokens: stands in for EOS."""
    return 16 + seed % 49


class ReplyWriter:
    """Yields the reply one token's text at a time."""

    __slots__ = ("_rng", "_first")

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)
        self._first = True

    def next_token(self) -> str:
        word = self._rng.choice(_WORDS)
        if self._first:
            self._first = False
            return word
        return " " + word
