"""Prefix-cached KV block accounting, modelled on vLLM V1's block pool.

Only full blocks are cached. A block's hash chains its parent's hash with its
token ids (blake2b here; vLLM defaults to sha256, the chaining is what
matters), and ``cache_salt`` enters block 0 only, so two requests share
blocks only when their salts are equal and every earlier token matches.

The pool holds ``num_blocks`` blocks. A block is *pinned* while a running
request uses it, or *cached* (kept by hash, free, evictable) after release.
Eviction takes the least recently used cached block. A released request's
blocks are queued tail first, so its long shared head outlives its tail,
as in vLLM, and a cached prefix stays contiguous.

With ``events`` on, the pool also records what it caches and evicts, in
vLLM's terms (``BlockStored`` for each run of newly cached blocks with its
parent and token ids, ``BlockRemoved`` per eviction, ``AllBlocksCleared`` on a
reset) for ``vllm_sim.kv_events`` to publish; ``hasher`` picks the block hash
(``vllm_sim.vllm_hash`` reproduces vLLM's sha256_cbor).

Reuse rule (vLLM's): at least the last prompt token is always recomputed,
because the engine needs its logits. A fully cached prompt of P tokens
therefore reuses ``(P - 1) // block_size`` blocks: with a 32-token prompt seen
before, 16 tokens are reported cached, not 32.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from dataclasses import dataclass, field
from hashlib import blake2b
from typing import Callable, Sequence, Union

__all__ = ["block_hashes", "KVPool", "Allocation", "Hasher", "Stored", "Removed", "Cleared", "PoolEvent"]

# (token ids, block size, salt) -> one hash per full block.
# (token ids, block size, cache_salt, LoRA adapter as (name, path) or None) -> full-block hashes.
Lora = Union[tuple[str, str], None]
Hasher = Callable[[Sequence[int], int, Union[str, None], Lora], list[bytes]]

_ROOT = b"vllm_sim:root"
_DIGEST = 16


def block_hashes(token_ids: Sequence[int], block_size: int = 16, salt: str | None = None,
                 lora: Lora = None) -> list[bytes]:
    """Chained hashes of the full blocks of ``token_ids`` (a trailing partial block has none).

    An empty ``salt`` counts as no salt (vLLM rejects an empty ``cache_salt``). A LoRA
    adapter goes into every block, as vLLM's extra keys put it: the same prompt under an
    adapter and under the base model shares no block.
    """
    tag = b"\x00lora\x00" + lora[0].encode() + b"\x00" + lora[1].encode() if lora else b""
    out: list[bytes] = []
    parent = _ROOT
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        h = blake2b(parent, digest_size=_DIGEST)
        h.update(struct.pack(f"<{block_size}q", *token_ids[start : start + block_size]))
        if tag:
            h.update(tag)
        if start == 0 and salt:
            # The separator keeps a salt from colliding with token bytes.
            h.update(b"\x00salt\x00" + salt.encode())
        parent = h.digest()
        out.append(parent)
    return out


@dataclass(slots=True, frozen=True)
class Stored:
    """A run of newly cached blocks: ``parent`` is the hash of the block before the first (None at 0)."""

    hashes: tuple[bytes, ...]
    parent: bytes | None
    token_ids: tuple[int, ...]
    # The salt went into the first block's hash (the run starts at block 0).
    salt: str | None
    # The LoRA adapter's name, which went into every block's hash (vLLM's lora_name).
    lora: str | None = None


@dataclass(slots=True, frozen=True)
class Removed:
    hashes: tuple[bytes, ...]


@dataclass(slots=True, frozen=True)
class Cleared:
    pass


PoolEvent = Union[Stored, Removed, Cleared]


@dataclass(slots=True, eq=False)
class Allocation:
    """The blocks one request holds; give it back with ``KVPool.release``."""

    pinned: list[bytes]  # hashed blocks (reused and newly cached), in prompt order
    anonymous: int  # blocks without a hash: duplicates, the partial tail, decode growth
    cached_blocks: int
    cached_tokens: int
    num_tokens: int  # tokens its blocks hold: the prompt so far, while it is prefilled in chunks
    released: bool = field(default=False)
    # Leading prompt blocks already accounted, hashed or (a copy of a cached one) anonymous:
    # a chunked prefill caches each prompt block once its tokens are computed, as vLLM does.
    covered: int = 0

    @property
    def num_blocks(self) -> int:
        return len(self.pinned) + self.anonymous


class KVPool:
    """A bounded pool of KV blocks with an LRU prefix cache; all operations are O(blocks touched)."""

    def __init__(self, num_blocks: int, block_size: int = 16, *, events: bool = False,
                 hasher: Hasher | None = None) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._hasher: Hasher = hasher or block_hashes
        # What changed since the last ``take_events``; None: not recorded.
        self._events: list[PoolEvent] | None = [] if events else None
        self._refs: dict[bytes, int] = {}  # every hashed block, pinned or cached
        self._evictable: OrderedDict[bytes, None] = OrderedDict()  # refs == 0, oldest first
        self._pinned = 0  # blocks in use by requests (hashed with refs > 0, plus anonymous)
        self.queries_tokens = 0
        self.hits_tokens = 0

    # -- read-only views -------------------------------------------------------------------
    @property
    def usage(self) -> float:
        """Pinned fraction, 0..1. Cached-but-free blocks count as free, as in kv_cache_usage_perc."""
        return self._pinned / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._refs)

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new request could get: never used, or cached and evictable."""
        return self.num_blocks - self._pinned

    @property
    def records_events(self) -> bool:
        return self._events is not None

    def hash_prompt(self, token_ids: Sequence[int], salt: str | None = None, lora: Lora = None) -> list[bytes]:
        """The full-block hashes of a prompt, with this pool's hash function."""
        return self._hasher(token_ids, self.block_size, salt, lora)

    def take_events(self) -> list[PoolEvent]:
        """The cache changes since the last call, oldest first (empty when not recorded)."""
        if not self._events:
            return []
        out, self._events = self._events, []
        return out

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match(self, hashes: Sequence[bytes]) -> int:
        """Number of leading blocks of ``hashes`` present in the pool. No side effects."""
        n = 0
        for h in hashes:
            if h not in self._refs:
                break
            n += 1
        return n

    # -- mutation ----------------------------------------------------------------------------
    def allocate(self, hashes: list[bytes], total_tokens: int, token_ids: Sequence[int] | None = None,
                 salt: str | None = None, lora: str | None = None, *, count: bool = True,
                 limit: int | None = None) -> Allocation | None:
        """Pin the reusable prefix and allocate blocks for the rest of a ``total_tokens`` prompt.

        ``hashes`` are the prompt's full-block hashes (``block_hashes``). Returns None,
        changing nothing, when the blocks cannot be found even after evicting every
        cached block. Prefix-cache counters move only on success, once per admission, and
        not with ``count=False`` (a preempted request resuming: vLLM counts those apart).
        ``token_ids``, ``salt`` and ``lora`` (the prompt's, the adapter's name) are what a
        ``Stored`` event reports. With ``limit``, only that many tokens past the cached prefix
        get blocks now (a chunked prefill's first chunk: vLLM's ``allocate_slots`` with the
        step's token budget); ``grow`` adds the rest as the chunks are scheduled.
        """
        hits = min(self.match(hashes), max(0, (total_tokens - 1) // self.block_size))
        upto = total_tokens if limit is None else min(total_tokens, hits * self.block_size + limit)
        reused_free = sum(1 for h in hashes[:hits] if self._refs[h] == 0)
        # The whole sequence must fit, not only the first chunk (vLLM 0.33's admission gate,
        # --scheduler-reserve-full-isl, on by default), though only the chunk gets blocks now.
        if self._pinned + reused_free + self.blocks_for(total_tokens) - hits > self.num_blocks:
            return None
        new = self.blocks_for(upto) - hits
        for h in hashes[:hits]:
            if self._refs[h] == 0:
                del self._evictable[h]
            self._refs[h] += 1
        self._pinned += reused_free
        self._make_room(new)
        self._pinned += new
        allocation = Allocation(list(hashes[:hits]), new, hits, hits * self.block_size, upto, covered=hits)
        self._cache(allocation, hashes, token_ids, salt, lora)
        if count:
            self.queries_tokens += total_tokens
            self.hits_tokens += hits * self.block_size
        return allocation

    def _cache(self, allocation: Allocation, hashes: Sequence[bytes], token_ids: Sequence[int] | None,
               salt: str | None, lora: str | None) -> None:
        """Give a hash to each prompt block the allocation now holds in full (vLLM's ``cache_blocks``)."""
        end = min(allocation.num_tokens // self.block_size, len(hashes))
        run_start = -1  # first block of the current run of newly cached blocks
        for i in range(allocation.covered, end):
            h = hashes[i]
            # Already present (the forced-recompute last block, or a block whose
            # parent was evicted): vLLM computes a fresh, unshared copy, so do we.
            if h not in self._refs:
                self._refs[h] = 1
                allocation.pinned.append(h)
                allocation.anonymous -= 1
                if run_start < 0:
                    run_start = i
            elif run_start >= 0:
                self._stored(hashes, run_start, i, token_ids, salt, lora)
                run_start = -1
        if run_start >= 0:
            self._stored(hashes, run_start, end, token_ids, salt, lora)
        allocation.covered = max(allocation.covered, end)

    def _stored(self, hashes: Sequence[bytes], start: int, end: int, token_ids: Sequence[int] | None,
                salt: str | None, lora: str | None = None) -> None:
        if self._events is None:
            return
        bs = self.block_size
        tokens = tuple(token_ids[start * bs : end * bs]) if token_ids is not None else ()
        self._events.append(Stored(tuple(hashes[start:end]), hashes[start - 1] if start else None, tokens,
                                   salt if start == 0 else None, lora))

    def grow(self, allocation: Allocation, new_tokens: int, hashes: Sequence[bytes] = (),
             token_ids: Sequence[int] | None = None, salt: str | None = None, lora: str | None = None) -> bool:
        """Account ``new_tokens`` more tokens; False (nothing changed) if no block is left.

        A prompt's next chunk passes its ``hashes`` (and what a ``Stored`` event reports): the
        prompt blocks it fills are cached. Decode blocks are never cached: a follow-up turn
        re-renders the reply through the chat template, so its tokens rarely line up with the
        decoded ones anyway.
        """
        total = allocation.num_tokens + new_tokens
        extra = self.blocks_for(total) - allocation.num_blocks
        if extra > 0:
            if self._pinned + extra > self.num_blocks:
                return False
            self._make_room(extra)
            self._pinned += extra
            allocation.anonymous += extra
        allocation.num_tokens = total
        if hashes:
            self._cache(allocation, hashes, token_ids, salt, lora)
        return True

    def release(self, allocation: Allocation) -> None:
        """Unpin a request's blocks; its hashed blocks stay cached. Idempotent."""
        if allocation.released:
            return
        allocation.released = True
        # Tail first: the head becomes the most recently used and is evicted last.
        for h in reversed(allocation.pinned):
            refs = self._refs[h] - 1
            self._refs[h] = refs
            if refs == 0:
                self._evictable[h] = None
                self._evictable.move_to_end(h)
                self._pinned -= 1
        self._pinned -= allocation.anonymous

    def clear(self) -> bool:
        """Drop every cached block and zero the counters; True if nothing was pinned.

        Blocks pinned by running requests stay (vLLM refuses a prefix-cache reset
        while requests run; the simulator resets what it can).
        """
        if self._events is not None:
            # vLLM reports a prefix-cache reset as one event (it refuses one while blocks
            # are in use); with pinned blocks kept, only the dropped ones are removed.
            self._events.append(Cleared() if not self._refs.keys() - self._evictable.keys()
                                else Removed(tuple(self._evictable)))
        for h in self._evictable:
            del self._refs[h]
        self._evictable.clear()
        self.queries_tokens = 0
        self.hits_tokens = 0
        return self._pinned == 0

    def _make_room(self, blocks: int) -> None:
        # Callers checked that pinned + blocks fits, so evictable blocks suffice.
        free_now = self.num_blocks - self._pinned - len(self._evictable)
        events = self._events
        for _ in range(max(0, blocks - free_now)):
            h, _ = self._evictable.popitem(last=False)
            del self._refs[h]
            if events is not None:
                events.append(Removed((h,)))
