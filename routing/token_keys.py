"""kvgate's own keys for token blocks: a chained hash over token ids, as vLLM chains its blocks.

vLLM's block hash cannot be reproduced in general (its default algorithm
pickles Python objects; the seed may be random), so kvgate keys each full
block of ``block_size`` tokens by its own chain, exactly as llm-d's precise
scorer does: key(i) = xxh3_64(token ids of block i, seed = key(i - 1)), with
the first block seeded by the request's ``cache_salt`` (vLLM mixes it into the
first block only, so the same prompt under two salts is two chains) and by
the LoRA adapter the request names (vLLM mixes it into every block, so under an
adapter and under its base model the same prompt shares nothing; seeding the
first block is enough, since every later key is chained to it). Two token
sequences share leading keys exactly as far as their full blocks agree.

The event index (``routing.kv_index``) re-keys every ``BlockStored`` this way
from the token ids the event carries, and the cost model keys a request's
``token_ids`` the same way, so both meet without knowing the engine's hash.
"""

from __future__ import annotations

from array import array
from typing import Sequence

import xxhash

__all__ = ["root_key", "block_keys"]

_xxh = xxhash.xxh3_64_intdigest
# The seed of an unsalted chain: any fixed value; this one names what it is.
_ROOT = _xxh(b"kvgate token blocks")


def root_key(salt: str | None, lora: str | None = None) -> int:
    """The parent key of a chain's first block (``lora``: the adapter's name, vLLM's ``lora_name``)."""
    root = _xxh(b"lora\x00" + lora.encode(), seed=_ROOT) if lora else _ROOT
    return _xxh(b"salt\x00" + salt.encode(), seed=root) if salt else root


def block_keys(token_ids: Sequence[int], block_size: int, salt: str | None = None,
               parent: int | None = None, lora: str | None = None) -> list[int]:
    """Keys of the full blocks of ``token_ids``; ``parent`` continues a chain (then ``salt`` and
    ``lora`` are unused)."""
    key = root_key(salt, lora) if parent is None else parent
    n = len(token_ids) - len(token_ids) % block_size
    # One buffer for the whole prompt; each block hashes a slice of it. Token ids are
    # non-negative and below 2**32 in every tokenizer vLLM loads; wider ones still
    # hash uniquely as 64-bit.
    data = array("q", token_ids[:n]).tobytes()
    step = 8 * block_size
    out: list[int] = []
    append = out.append
    for start in range(0, len(data), step):
        key = _xxh(data[start : start + step], seed=key)
        append(key)
    return out
