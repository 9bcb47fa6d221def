"""Decoding vLLM's KV-event wire format (``vllm/distributed/kv_events.py``).

A message on the PUB socket is three frames: topic, sequence number (8 bytes,
big-endian, from 0 at every start of the engine process) and a msgpack
payload. The payload is a batch ``[ts, events, data_parallel_rank]`` (a map
with those keys is accepted too). Events come in two encodings, both accepted:

* a map tagged by ``"type"`` (vLLM since PR #42892): ``{"type": "BlockStored",
  "block_hashes": [...], ...}``;
* an array whose first element is the tag (vLLM before it), the fields in
  declaration order: ``["BlockStored", block_hashes, parent_block_hash,
  token_ids, block_size, lora_id, medium, lora_name, extra_keys, ...]``,
  ``["BlockRemoved", block_hashes, medium]``, ``["AllBlocksCleared"]``.

A block hash is an int (the low 64 bits of the engine's digest, vLLM's
default) or bytes (the whole digest); both are kept as they come, since they
are only ever compared with hashes from the same replica.

Anything malformed raises ``WireError``: the consumer counts it and treats the
batch as lost (a gap), never as data. Unknown event types (later vLLM
versions) are skipped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

import msgpack

__all__ = ["WireError", "Stored", "Removed", "Cleared", "Event", "Batch", "decode_batch", "decode_seq",
           "END_SEQ"]

BlockHash = Union[int, bytes]
END_SEQ = -1


class WireError(ValueError):
    """A frame that is not a KV-event batch."""


@dataclass(slots=True, frozen=True)
class Stored:
    block_hashes: tuple[BlockHash, ...]
    parent: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str  # "GPU" unless the event says otherwise ("CPU", ...)
    # The first block's cache_salt, from the event's extra keys (vLLM sends them untagged).
    salt: str | None
    lora_name: str | None


@dataclass(slots=True, frozen=True)
class Removed:
    block_hashes: tuple[BlockHash, ...]
    medium: str


@dataclass(slots=True, frozen=True)
class Cleared:
    pass


Event = Union[Stored, Removed, Cleared]


@dataclass(slots=True, frozen=True)
class Batch:
    ts: float
    events: tuple[Event, ...]
    dp_rank: int | None


def decode_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise WireError(f"sequence frame of {len(frame)} bytes, not 8")
    return int.from_bytes(frame, "big", signed=True)


def decode_batch(payload: bytes) -> Batch:
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise WireError(f"not msgpack: {type(exc).__name__}") from None
    if isinstance(raw, dict):
        raw = [raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")]
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise WireError("a batch is [ts, events, data_parallel_rank]")
    ts = raw[0] if isinstance(raw[0], (int, float)) else 0.0
    rank = raw[2] if len(raw) > 2 and isinstance(raw[2], int) else None
    events = tuple(e for e in (_event(x) for x in raw[1]) if e is not None)
    return Batch(float(ts), events, rank)


_STORED = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
           "extra_keys")
_REMOVED = ("block_hashes", "medium")


def _fields(raw: Any, names: tuple[str, ...]) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw
    return dict(zip(names, raw[1:]))


def _event(raw: Any) -> Event | None:
    if isinstance(raw, dict):
        tag = raw.get("type")
    elif isinstance(raw, list) and raw:
        tag = raw[0]
    else:
        raise WireError("an event is a tagged map or a tagged array")
    if tag == "BlockStored":
        f = _fields(raw, _STORED)
        hashes = _hashes(f.get("block_hashes"))
        parent = f.get("parent_block_hash")
        tokens = f.get("token_ids")
        size = f.get("block_size")
        if parent is not None and not isinstance(parent, (int, bytes)):
            raise WireError("parent_block_hash must be an int, bytes or nil")
        if not isinstance(tokens, list):
            raise WireError("token_ids must be a list of ints")  # their type is checked where they are keyed
        if not isinstance(size, int) or size < 1:
            raise WireError("block_size must be a positive int")
        lora = f.get("lora_name") if isinstance(f.get("lora_name"), str) else None
        return Stored(hashes, parent, tuple(tokens), size, _medium(f.get("medium")), _salt(f.get("extra_keys"), lora),
                      lora)
    if tag == "BlockRemoved":
        f = _fields(raw, _REMOVED)
        return Removed(_hashes(f.get("block_hashes")), _medium(f.get("medium")))
    if tag == "AllBlocksCleared":
        return Cleared()
    if isinstance(tag, str):
        return None  # an event type of a later vLLM: not ours to interpret
    raise WireError("event without a type tag")


def _hashes(raw: Any) -> tuple[BlockHash, ...]:
    if not isinstance(raw, list) or not all(isinstance(h, (int, bytes)) for h in raw):
        raise WireError("block_hashes must be a list of ints or bytes")
    return tuple(raw)


def _medium(raw: Any) -> str:
    return raw.upper() if isinstance(raw, str) and raw else "GPU"


def _salt(extra: Any, lora: str | None = None) -> str | None:
    """The cache_salt among the first block's extra keys: vLLM puts it after LoRA and multimodal keys.

    Untagged on the wire, it is the plain string after the adapter's: a LoRA
    request's keys start with its name (``lora_name``), which is skipped.
    """
    if not isinstance(extra, list) or not extra or not isinstance(extra[0], (list, tuple)):
        return None
    strings = [k for k in extra[0] if isinstance(k, str)]
    if lora is not None and strings and strings[0] == lora:
        strings = strings[1:]
    return strings[-1] if strings else None
