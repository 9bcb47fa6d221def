"""Which replica holds which token block, learned from each replica's own KV events.

The truth prefix affinity reads in precise mode (``routing.prefix_affinity``). Every
kvgate instance subscribes to every replica's events (``routing.kv_consumer``)
and applies them here, so instances that share nothing hold the same index.

Keys: vLLM's block hashes cannot be reproduced in general, so each
``BlockStored`` is re-keyed by kvgate's own chain over the token ids it carries
(``routing.token_keys``; llm-d's design), continuing from the key of its parent
block (the first block's chain starts from the event's ``cache_salt`` and
``lora_name``). The map engine hash -> own key, kept per replica and tier, is
what lets ``BlockRemoved`` (which carries only engine hashes) apply. A stored block whose
parent this index never saw cannot be keyed and is dropped (counted): it is
unreachable by a prefix lookup anyway until its chain is stored again.

Tiers: a block on the GPU counts in full; in a lower tier (vLLM's CPU offload,
any medium but "GPU") it counts ``cpu_weight`` of a block: a hit there saves the
prefill compute but pays a copy back over the host link first.

Memory is bounded: a replica's map can never legitimately exceed the blocks its
caches hold (``max_blocks`` per replica, set above any real pool). Past that,
removals were lost, so the map is wrong in unknown places: it is cleared and
relearned (counted as an overflow). Measured cost: ``bench/kv_events.py``
prints bytes per million blocks.

Lookups do not allocate per block: one dict probe per block of the request
for all replicas at once, stopping when no replica holds the next block.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

from .kv_wire import Batch, BlockHash, Cleared, Removed, Stored
from .token_keys import block_keys, root_key

__all__ = ["KVEventIndex", "GPU"]

GPU = "GPU"
_MAX_REPLICAS = 64
_MAX_ADAPTERS = 10_000


@dataclass(slots=True)
class _Replica:
    bit: int
    # medium -> engine hash -> own key
    maps: dict[str, dict[BlockHash, int]] = field(default_factory=dict)
    stored: int = 0
    removed: int = 0
    dropped: int = 0  # stored blocks whose parent was unknown
    skipped: int = 0  # partial blocks, or blocks of another block size
    clears: int = 0
    overflows: int = 0

    @property
    def size(self) -> int:
        return sum(len(m) for m in self.maps.values())


class KVEventIndex:
    def __init__(self, block_size: int = 16, *, cpu_weight: float = 0.5, max_blocks: int = 1 << 21) -> None:
        self.block_size = block_size
        self.cpu_weight = cpu_weight
        self.max_blocks = max_blocks
        self._gpu: dict[int, int] = {}  # own key -> bitmask of replicas holding it on the GPU
        self._low: dict[int, int] = {}  # ... in a lower tier
        self._replicas: dict[str, _Replica] = {}
        # The LoRA adapters' names the events showed: a request naming one is keyed under it
        # (``token_keys``), since its blocks are not its base model's. Bounded: past it, a new
        # adapter's requests are keyed as its base model's, which costs misses, never answers.
        self.adapters: set[str] = set()

    def note_adapters(self, names: Iterable[str]) -> None:
        """LoRA adapters known by name (from the events, or the replicas' /v1/models)."""
        for name in names:
            if len(self.adapters) >= _MAX_ADAPTERS:
                return
            self.adapters.add(name)

    # -- membership -----------------------------------------------------------------
    def _replica(self, name: str) -> _Replica:
        st = self._replicas.get(name)
        if st is None:
            used = {r.bit for r in self._replicas.values()}
            bit = next(b for b in range(_MAX_REPLICAS + 1) if b not in used)
            if bit >= _MAX_REPLICAS:
                raise ValueError(f"more than {_MAX_REPLICAS} replicas publish KV events")
            st = self._replicas[name] = _Replica(bit)
        return st

    def remove_replica(self, name: str) -> None:
        """Forget a replica that left membership (its bit is free for a newcomer)."""
        if name in self._replicas:
            self.clear(name)
            del self._replicas[name]

    def clear(self, name: str) -> None:
        st = self._replicas.get(name)
        if st is None:
            return
        keep = ~(1 << st.bit)
        for medium, m in st.maps.items():
            tier = self._gpu if medium == GPU else self._low
            for key in m.values():
                mask = tier.get(key, 0) & keep
                if mask:
                    tier[key] = mask
                else:
                    tier.pop(key, None)
        st.maps.clear()
        st.clears += 1

    # -- events ---------------------------------------------------------------------
    def apply(self, name: str, batch: Batch) -> None:
        st = self._replica(name)
        for e in batch.events:
            if isinstance(e, Stored):
                self._stored(st, e)
            elif isinstance(e, Removed):
                self._removed(st, e)
            elif isinstance(e, Cleared):
                self.clear(name)
        if st.size > self.max_blocks:
            self.clear(name)
            st.overflows += 1

    def _stored(self, st: _Replica, e: Stored) -> None:
        bs = e.block_size
        if bs != self.block_size or len(e.token_ids) != bs * len(e.block_hashes):
            st.skipped += len(e.block_hashes)
            return
        if e.lora_name is not None and e.lora_name not in self.adapters:
            self.note_adapters((e.lora_name,))
        if e.parent is None:
            parent = root_key(e.salt, e.lora_name)
        else:
            found = None
            for m in st.maps.values():
                found = m.get(e.parent)
                if found is not None:
                    break
            if found is None:
                st.dropped += len(e.block_hashes)
                return
            parent = found
        try:
            keys = block_keys(e.token_ids, bs, parent=parent)
        except (TypeError, OverflowError):  # a token id that is not a 64-bit int
            st.skipped += len(e.block_hashes)
            return
        m = st.maps.setdefault(e.medium, {})
        tier = self._gpu if e.medium == GPU else self._low
        flag = 1 << st.bit
        for h, key in zip(e.block_hashes, keys):
            m[h] = key
            tier[key] = tier.get(key, 0) | flag
        st.stored += len(keys)

    def _removed(self, st: _Replica, e: Removed) -> None:
        m = st.maps.get(e.medium)
        if not m:
            return
        tier = self._gpu if e.medium == GPU else self._low
        keep = ~(1 << st.bit)
        for h in e.block_hashes:
            key = m.pop(h, None)
            if key is None:
                continue
            st.removed += 1
            mask = tier.get(key, 0) & keep
            if mask:
                tier[key] = mask
            else:
                tier.pop(key, None)

    # -- lookups --------------------------------------------------------------------
    def held(self, keys: Sequence[int], names: Iterable[str]) -> dict[str, float]:
        """Per replica, the blocks of the longest consecutive prefix of ``keys`` it holds (tier-weighted)."""
        bits = {st.bit: n for n in names if (st := self._replicas.get(n)) is not None}
        out = {n: 0.0 for n in names}
        alive = 0
        for b in bits:
            alive |= 1 << b
        gpu, low = self._gpu, self._low
        lower: dict[int, int] = {}
        depth = len(keys)
        for i, key in enumerate(keys):
            g = gpu.get(key, 0) & alive
            c = (low.get(key, 0) & alive & ~g) if low else 0
            if c:
                for b in bits:
                    if c >> b & 1:
                        lower[b] = lower.get(b, 0) + 1
            m = g | c
            if m != alive:
                gone = alive & ~m
                for b in bits:
                    if gone >> b & 1:
                        out[bits[b]] = self._weigh(i, lower.get(b, 0))
                alive = m
                if not alive:
                    depth = -1
                    break
        if alive:
            for b in bits:
                if alive >> b & 1:
                    out[bits[b]] = self._weigh(depth, lower.get(b, 0))
        return out

    def has(self, name: str, key: int) -> bool:
        """Whether ``name`` holds the block ``key`` in any tier (a chain's last key: the whole chain)."""
        st = self._replicas.get(name)
        return st is not None and bool((self._gpu.get(key, 0) | self._low.get(key, 0)) >> st.bit & 1)

    def _weigh(self, blocks: int, lower: int) -> float:
        return blocks - lower * (1.0 - self.cpu_weight)

    def size(self, name: str) -> int:
        st = self._replicas.get(name)
        return st.size if st else 0

    def __len__(self) -> int:
        return sum(st.size for st in self._replicas.values())

    def stats(self, name: str) -> dict[str, int]:
        st = self._replicas.get(name)
        if st is None:
            return {"blocks": 0}
        return {"blocks": st.size, "stored": st.stored, "removed": st.removed, "dropped": st.dropped,
                "skipped": st.skipped, "clears": st.clears, "overflows": st.overflows}
