"""The text normalisation rule of the semantic cache, in one place.

Three levels, each a superset of the one before, because each use tolerates a
different amount of folding:

1. ``exact_text`` (the exact-tier key). Unicode NFC, so the same characters
   typed on two keyboards (precomposed vs combining accents) hash alike;
   zero-width characters, the BOM and soft hyphens removed (invisible, yet they
   change every hash); lone surrogates replaced by U+FFFD (they cannot be
   encoded); CRLF/CR turned into LF; whitespace stripped at both ends. Inner
   whitespace is kept: indentation changes the meaning of code in a question.
   NFKC is *not* applied: it folds ``x²`` into ``x2``.
2. ``query_text`` (what the verifier compares and ``CacheRequest.query``
   holds): ``exact_text`` with every run of whitespace collapsed to one space.
3. ``embedding_text`` (what the embedder sees): ``query_text`` with NFKC and
   case folding. The embedding only has to be near, not exact, so compatibility
   folding (full-width letters, ligatures) and case help it and cost nothing:
   a verifier on ``query_text`` still sees the original characters.
"""

from __future__ import annotations

import re
import unicodedata

# Invisible code points that change a hash without changing what a person sees.
_INVISIBLE = dict.fromkeys(
    map(ord, "\u200b\u200c\u200d\u200e\u200f\u2060\u2061\u2062\u2063\u2064\ufeff\u00ad\u180e"), None
)
_SURROGATE = re.compile("[\ud800-\udfff]")
_WS = re.compile(r"\s+")


def exact_text(text: str) -> str:
    """Level 1: the text the exact tier hashes (see the module docstring)."""
    text = _SURROGATE.sub("\ufffd", text)
    text = unicodedata.normalize("NFC", text).translate(_INVISIBLE)
    return text.replace("\r\n", "\n").replace("\r", "\n").strip()


def query_text(text: str) -> str:
    """Level 2: ``exact_text`` with whitespace runs collapsed to one space."""
    return _WS.sub(" ", exact_text(text)).strip()


def embedding_text(query: str) -> str:
    """Level 3: the embedder's input, from an already normalised ``query_text``."""
    return unicodedata.normalize("NFKC", query).casefold()
