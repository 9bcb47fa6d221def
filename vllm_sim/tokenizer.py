"""A deterministic stand-in for a BPE tokenizer: about 4 characters per token on English.

Why not a real tokenizer: the simulator must start in milliseconds and push
thousands of requests a second without model files. What matters for prefix
caching is only that the same text always yields the same ids, that a shared
text prefix yields a shared id prefix (up to the piece straddling the end of
the shared text, as with real BPE) and that counts are plausible.

Pieces follow GPT-2's split: a word or punctuation run keeps one leading space,
whitespace runs stand alone. A piece longer than 8 characters is cut into
4-character chunks, which puts ordinary English prose near 4 characters per
token. Ids are ``zlib.crc32`` of the piece, deliberately independent of the
xxhash kvgate itself uses, so the gateway cannot accidentally agree with the
simulator by sharing code.
"""

from __future__ import annotations

import re
import zlib
from functools import lru_cache

__all__ = ["tokenize", "count_tokens", "token_strs"]

_PIECES = re.compile(r" ?\w+| ?[^\s\w]+|\s+(?!\S)|\s+")
_WHOLE_MAX = 8
_CHUNK = 4


@lru_cache(maxsize=1 << 17)
def _piece_ids(piece: str) -> tuple[int, ...]:
    # The memo is bounded, so a benchmark streaming random text cannot grow it without limit.
    if len(piece) <= _WHOLE_MAX:
        return (zlib.crc32(piece.encode()),)
    return tuple(zlib.crc32(piece[i : i + _CHUNK].encode()) for i in range(0, len(piece), _CHUNK))


def tokenize(text: str) -> list[int]:
    """Token ids for ``text``; the same text always gives the same ids (unsigned 32-bit)."""
    ids: list[int] = []
    extend = ids.extend
    for piece in _PIECES.findall(text):
        extend(_piece_ids(piece))
    return ids


def count_tokens(text: str) -> int:
    """Number of tokens ``tokenize(text)`` would return."""
    return sum(len(_piece_ids(piece)) for piece in _PIECES.findall(text))


def token_strs(text: str) -> list[str]:
    """The text of each token ``tokenize(text)`` returns, in order (joined, they give ``text``)."""
    out: list[str] = []
    for piece in _PIECES.findall(text):
        if len(piece) <= _WHOLE_MAX:
            out.append(piece)
        else:
            out.extend(piece[i : i + _CHUNK] for i in range(0, len(piece), _CHUNK))
    return out
