"""vLLM's own block hash, reproduced: ``--prefix-caching-hash-algo sha256_cbor``.

What vLLM computes (``vllm/v1/core/kv_cache_utils.py``, ``vllm/utils/hashing.py``):

    NONE_HASH   = sha256_cbor(seed)       seed: PYTHONHASHSEED if set, else "vllm-none-hash"
    block_hash  = sha256_cbor((parent or NONE_HASH, tuple(block_token_ids), extra_keys))
    sha256_cbor = sha256 of the canonical CBOR encoding

``extra_keys`` is None or a tuple of keys tagged by their source:
``("lora", name, path)`` on every block of a LoRA adapter's request, multimodal
identifiers, then ``("cache_salt", salt)`` on the first block only (vLLM 0.33;
the simulator has no multimodal input). Events publish the keys untagged, one
entry per block: ``(name, salt)``, ``(name,)``, ... or ``(salt,)``, None, ... Events carry the low 64 bits of the
32-byte digest, read big-endian, by default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``).

Only the simulator uses this: kvgate never reproduces the engine's hash, it keys
blocks by its own chain over the token ids (``routing.token_keys``). The parity
test checks these digests against vLLM's ``hash_block_tokens``.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Sequence

import cbor2

__all__ = ["DEFAULT_SEED", "sha256_cbor", "none_hash", "resolve_seed", "vllm_block_hashes", "external_hash"]

DEFAULT_SEED = "vllm-none-hash"
_LOW64 = (1 << 64) - 1


def sha256_cbor(obj: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def resolve_seed(seed: str | None = None) -> str:
    """The seed vLLM derives NONE_HASH from: the one given, else PYTHONHASHSEED, else the fixed default."""
    if seed is not None:
        return seed
    return os.environ.get("PYTHONHASHSEED", DEFAULT_SEED)


def none_hash(seed: str | None = None) -> bytes:
    return sha256_cbor(resolve_seed(seed))


def vllm_block_hashes(token_ids: Sequence[int], block_size: int, salt: str | None = None,
                      seed: str | None = None, lora: tuple[str, str] | None = None) -> list[bytes]:
    """The 32-byte hashes vLLM gives the full blocks of ``token_ids`` (a partial tail has none);
    ``lora``: the adapter's (name, path), as vLLM's ``LoRARequest`` carries them."""
    parent = none_hash(seed)
    out: list[bytes] = []
    adapter = [("lora", lora[0], lora[1])] if lora else []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        # vLLM only adds the salt when it is non-empty (an empty one is rejected at the API).
        keys = adapter + ([("cache_salt", salt)] if start == 0 and salt else [])
        extra = tuple(keys) if keys else None
        parent = sha256_cbor((parent, tuple(token_ids[start : start + block_size]), extra))
        out.append(parent)
    return out


def external_hash(digest: bytes, as_int: bool = True) -> int | bytes:
    """How a block hash goes on the event wire: the low 64 bits (default) or the whole digest."""
    return int.from_bytes(digest, "big") & _LOW64 if as_int else digest
