"""An approximate index of which replica holds which prefix blocks.

Learned only from this instance's own traffic (``observe`` after each served
request: the replica now holds that prompt's blocks), so it is a hint, never
the truth: replicas evict on their own, other gateway instances route
elsewhere. The policy uses it for one decision only: whether a replica other
than the rendezvous first choice already holds this request's key prefix (or a
clearly deeper one), so the request should follow it there.

Cost and memory are bounded by design:

* Only sampled block positions are indexed, plus (with ``tails``) every block
  of a prompt's tail past its last sampled one: every block of the first 16, then eight
  positions per doubling of depth (16, 18, ..., 32, 36, ...). A prompt of 2,000
  blocks (128K characters) costs at most about 200 entries. A match is exact for
  a prompt that extends a recorded one (a conversation's next turn finds its
  last turn's whole prompt: the cost model charges every block it does not know
  of) and known to within 1/8 of its depth otherwise.
* Entries map a chained block hash (or a routing key, which is the hash of
  the exact prefix it names) to a bitmask of replica ids and live in two
  generations of ``capacity / 2`` entries (recording writes the young one;
  when it is full the old one is dropped): hashes that stop being recorded age
  out, as in an LRU. A prompt extending one recorded in this generation
  records only its new blocks, so routing work grows with what is new in a
  request, not with its length.
* ``depths`` finds every replica's depth in one bisection: the masks along a
  chain only lose bits, so only intervals whose ends differ are split.
* A lookup is a binary search over the sampled positions (a prefix held by a
  replica is held all the way down, so presence is monotone along a chain),
  then one over the blocks up to the next sampled position: only recorded
  tails are there, each recorded from that sampled block on, so presence is
  monotone there too.
"""

from __future__ import annotations

from bisect import bisect_right
from itertools import chain
from typing import Iterable, Iterator, Sequence

__all__ = ["BlockIndex", "MAX_REPLICA_IDS", "ReplicaBits", "sampled_positions"]

# Replica ids in the index's masks; past this many names seen (DNS pods coming and
# going) the ids and the index start afresh.
MAX_REPLICA_IDS = 4096


def sampled_positions(max_blocks: int) -> tuple[int, ...]:
    """Block positions the index records, ascending: dense near the root, then geometric."""
    out: list[int] = []
    i = 0
    while i < max_blocks:
        out.append(i)
        i += 1 if i < 16 else max(1, (1 << (i.bit_length() - 1)) >> 3)
    return tuple(out)


class BlockIndex:
    __slots__ = ("_young", "_old", "_fresh", "_half", "_positions", "_tails")

    def __init__(self, capacity: int, max_blocks: int, tails: bool = False) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        # Two generations instead of one LRU: recording goes to the young one, and when it
        # is full the old one is dropped. An entry not recorded for a whole generation ages
        # out, as in an LRU, but a prompt's blocks need not each be touched on every request.
        self._young: dict[int, int] = {}
        self._old: dict[int, int] = {}
        # Blocks ``add`` recorded in the young generation (bitmask by replica): a chain
        # recorded from its root through such a block needs no recording up to it.
        self._fresh: dict[int, int] = {}
        self._half = max(1, capacity // 2)
        self._positions = sampled_positions(max_blocks)
        # Record each prompt's tail too (exact depths for the cost model).
        self._tails = tails

    def __len__(self) -> int:
        return len(self._young) + len(self._old)

    def clear(self) -> None:
        self._young.clear()
        self._old.clear()
        self._fresh.clear()

    def _upto(self, n_blocks: int) -> int:
        return bisect_right(self._positions, n_blocks - 1)

    def _mask(self, h: int) -> int:
        m = self._young.get(h)
        return self._old.get(h, 0) if m is None else m

    def _age(self) -> None:
        if len(self._young) >= self._half:
            self._old, self._young = self._young, {}
            self._fresh.clear()

    def add(self, hashes: Sequence[int], bit: int, known: int = 0) -> None:
        """Record that replica ``bit`` holds every block of ``hashes``.

        ``known``: how many leading blocks a lookup just found ``bit`` holding. If ``add``
        recorded them in this generation (the next turn of a conversation, another
        question under the same system prompt), only the blocks past them are recorded:
        the work is per new block, not per block of the prompt.
        """
        flag = 1 << bit
        start = known if 0 < known <= len(hashes) and self._fresh.get(hashes[known - 1], 0) & flag else 0
        n = len(hashes)
        upto = self._upto(n)
        positions = self._positions
        at: Iterable[int] = positions[bisect_right(positions, start - 1):upto]
        if upto and self._tails:
            # The tail: exact depth for the next turn.
            at = chain(at, range(max(start, positions[upto - 1] + 1), n))
        self._mark([hashes[p] for p in at], flag)

    def _mark(self, hashes: Sequence[int], flag: int) -> None:
        """Set ``flag`` on each of ``hashes`` (young again, and fresh in this generation), then age."""
        young, old, fresh = self._young, self._old, self._fresh
        for h in hashes:
            m = young.get(h)
            if m is None:
                m = old.pop(h, 0)
            young[h] = m | flag
            fresh[h] = fresh.get(h, 0) | flag
        self._age()

    def positions(self, n_blocks: int) -> list[int]:
        """The positions ``add`` records for a chain of ``n_blocks`` (root first)."""
        upto = self._upto(n_blocks)
        out = list(self._positions[:upto])
        if upto and self._tails:
            out.extend(range(self._positions[upto - 1] + 1, n_blocks))
        return out

    def recorded(self, hashes: Sequence[int], limit: int) -> tuple[int, list[int]]:
        """What another instance needs to repeat ``add(hashes, ...)`` (``routing.gossip``'s block
        fact): the chain's length and its hashes at ``positions``, at most ``limit`` of them. Past
        ``limit``, those of the longest shorter chain that fits: the positions of a chain's prefix
        are a prefix of its positions (sampled ones below it, then its own tail)."""
        at = self.positions(len(hashes))[:limit]
        return (at[-1] + 1 if at else 0), [hashes[p] for p in at]

    def add_recorded(self, blocks: int, recorded: Sequence[int], bit: int) -> bool:
        """``add`` from ``recorded``'s output: a chain of ``blocks`` whose hashes at ``positions(blocks)``
        are ``recorded``. False (nothing recorded) where there are not as many as it records for
        such a chain (another version's fact, or garbage). Chained hashes name their own
        positions, so recording them needs no positions; the count bounds what a fact records."""
        # Counted, not listed: a malformed fact's length must not build a list that long.
        upto = self._upto(blocks)
        count = upto + (blocks - 1 - self._positions[upto - 1] if upto and self._tails else 0)
        if not recorded or len(recorded) != count:
            return False
        self._mark(recorded, 1 << bit)
        return True

    def forget(self, hashes: Sequence[int], bit: int) -> None:
        """Replica ``bit`` no longer holds these entries (its pool evicted them)."""
        keep = ~(1 << bit)
        young, old, fresh = self._young, self._old, self._fresh
        for h in hashes:
            for gen in (young, old, fresh):
                m = gen.get(h)
                if m is not None:
                    m &= keep
                    if m:
                        gen[h] = m
                    else:
                        del gen[h]

    def add_key(self, key: int, bit: int) -> None:
        """Record that replica ``bit`` holds the prefix a routing key names (its exact cut)."""
        young = self._young
        m = young.get(key)
        young[key] = (self._old.pop(key, 0) if m is None else m) | (1 << bit)
        self._age()

    def holders(self, key: int) -> int:
        """Bitmask of replicas believed to hold the prefix ``key`` names (no side effects)."""
        return self._mask(key)

    def deepest(self, hashes: Sequence[int], among: int) -> tuple[int, int]:
        """(blocks matched, bitmask of replicas matching that deep) over replicas in ``among``.

        Binary search for the last sampled position any of ``among`` holds; no
        side effects (a lookup does not refresh recency: only serving does).
        """
        young, old = self._young, self._old
        positions = self._positions
        lo, hi = 0, bisect_right(positions, len(hashes) - 1)
        best_pos, best_mask = -1, 0
        while lo < hi:
            mid = (lo + hi) // 2
            h = hashes[positions[mid]]
            mask = young.get(h)  # ``_mask``, inlined (as in ``_last_held``)
            mask = (old.get(h, 0) if mask is None else mask) & among
            if mask:
                best_pos, best_mask = positions[mid], mask
                lo = mid + 1
            else:
                hi = mid
        if not self._tails:
            return best_pos + 1, best_mask
        # Then between it and the next sampled position, where only tails are recorded.
        lo, hi = best_pos + 1, min(positions[lo] if lo < len(positions) else len(hashes), len(hashes))
        while lo < hi:
            mid = (lo + hi) // 2
            h = hashes[mid]
            mask = young.get(h)
            mask = (old.get(h, 0) if mask is None else mask) & among
            if mask:
                best_pos, best_mask = mid, mask
                lo = mid + 1
            else:
                hi = mid
        return best_pos + 1, best_mask

    def depth_of(self, hashes: Sequence[int], bit: int) -> int:
        """Blocks of this chain that replica ``bit`` is believed to hold."""
        return self.deepest(hashes, 1 << bit)[0]

    def depths(self, hashes: Sequence[int], among: int) -> dict[int, int]:
        """``depth_of`` for every replica bit in ``among`` (those holding none left out), in one pass.

        Presence is monotone along the sampled positions for each replica, so the
        masks along them only lose bits: between two probes whose masks agree
        nothing changes, and a prompt held alike by every replica costs one
        binary search, not one per replica. The tails after each replica's last
        sampled block are searched the same way, replicas that stop there together.
        """
        if among < 0:
            raise ValueError("among must be a non-negative bitmask")
        positions = self._positions
        n = len(hashes)
        out: dict[int, int] = {}
        for i, bits in self._last_held(hashes, positions, 0, self._upto(n), among).items():
            if i < 0:
                continue
            if not self._tails:
                for b in _bits(bits):
                    out[b] = positions[i] + 1
                continue
            gap = range(positions[i] + 1, min(positions[i + 1] if i + 1 < len(positions) else n, n))
            for j, tail in self._last_held(hashes, gap, 0, len(gap), bits).items():
                depth = gap[j] + 1 if j >= 0 else positions[i] + 1
                for b in _bits(tail):
                    out[b] = depth
        return out

    def _last_held(self, hashes: Sequence[int], at: Sequence[int], lo: int, hi: int, among: int) -> dict[int, int]:
        """{i: the bits of ``among`` whose last held block among ``hashes[at[lo:hi]]`` is at[i]} (i = lo - 1: none).

        Each bit is held on a prefix of ``at`` (monotone): bisect, but only where the
        masks at the two ends of an interval differ.
        """
        young, old = self._young, self._old
        out: dict[int, int] = {}
        # at[lo:hi] unknown; ``above``: the mask before it, ``below``: after. An interval
        # whose ends agree holds nothing to find: it is never pushed.
        stack = [(lo, hi, among, 0)] if among else []
        pop, push = stack.pop, stack.append
        while stack:
            lo, hi, above, below = pop()
            if lo >= hi:
                out[lo - 1] = out.get(lo - 1, 0) | (above & ~below)
                continue
            mid = (lo + hi) // 2
            h = hashes[at[mid]]
            m = young.get(h)  # ``_mask``, inlined: the probes are most of a lookup's cost
            m = (old.get(h, 0) if m is None else m) & above
            if m != above:
                push((lo, mid, above, m))
            if m != below:
                push((mid + 1, hi, m, below))
        return out


def _bits(mask: int) -> Iterator[int]:
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


class ReplicaBits:
    """Small integer ids for replica names (bit positions in the block index)."""

    __slots__ = ("_ids",)

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._ids)

    def get(self, name: str) -> int | None:
        return self._ids.get(name)

    def bit_for(self, name: str, index: BlockIndex) -> int:
        """``name``'s id, made on first sight. Past the id space every id and ``index``,
        which is written in them, start afresh rather than grow without bound."""
        b = self._ids.get(name)
        if b is None:
            if len(self._ids) >= MAX_REPLICA_IDS:
                self._ids.clear()
                index.clear()
            b = self._ids[name] = len(self._ids)
        return b
