"""The block index: one-pass depths for every replica, recording only new blocks, bounded memory."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from routing.block_index import BlockIndex

MAX_BLOCKS = 300
# Prompts drawn as (root, length, branch point, branch length): chains of three
# roots that share prefixes and fork, as conversations under system prompts do.
prompt = st.tuples(st.integers(0, 2), st.integers(0, MAX_BLOCKS), st.integers(0, MAX_BLOCKS), st.integers(0, 40))
ROOTS = [[(r << 32) | i for i in range(MAX_BLOCKS)] for r in range(3)]


def chain_of(p: tuple[int, int, int, int], salt: int) -> list[int]:
    root, n, fork, extra = p
    head = ROOTS[root][:n]
    if fork < n:  # a branch: its own blocks after ``fork``
        head = head[:fork] + [(1 << 60) | (salt << 8) | i for i in range(extra)]
    return head


@settings(max_examples=60, deadline=None)
@given(st.booleans(), st.lists(st.tuples(prompt, st.integers(0, 4)), min_size=1, max_size=60),
       st.lists(prompt, min_size=1, max_size=5))
def test_depths_agree_with_depth_of_and_new_blocks_only_is_the_same_as_all(tails, adds, queries) -> None:
    skipping = BlockIndex(1 << 30, MAX_BLOCKS, tails=tails)
    full = BlockIndex(1 << 30, MAX_BLOCKS, tails=tails)
    for k, (p, bit) in enumerate(adds):
        hashes = chain_of(p, k)
        skipping.add(hashes, bit, skipping.depth_of(hashes, bit))
        full.add(hashes, bit)
    for k, q in enumerate(queries):
        hashes = chain_of(q, 1000 + k)
        depths = skipping.depths(hashes, 0b11111)
        for bit in range(5):
            assert depths.get(bit, 0) == skipping.depth_of(hashes, bit) == full.depth_of(hashes, bit)
        assert skipping.depths(hashes, 0b00100).keys() <= {2}


def test_a_prompt_under_a_recorded_prefix_records_only_its_new_blocks() -> None:
    index = BlockIndex(1 << 20, 2048, tails=True)
    system = list(range(1, 401))
    index.add(system, 0)
    before = len(index)
    # A question of two new blocks under it: the known 400 are not walked again.
    question = system + [10_001, 10_002]
    index.add(question, 0, index.depth_of(question, 0))
    assert len(index) == before + 2
    assert index.depth_of(question, 0) == 402 and index.depth_of(question, 1) == 0
    # Not known to a replica that never held it: recorded whole there.
    index.add(question, 1, index.depth_of(question, 1))
    assert index.depth_of(question, 1) == 402 and index.depths(question, 0b11) == {0: 402, 1: 402}


def test_memory_stays_within_capacity_and_what_is_recorded_again_survives() -> None:
    index = BlockIndex(1000, 64, tails=True)
    hot = list(range(1, 41))
    for k in range(500):
        index.add(hot, 0, index.depth_of(hot, 0))
        index.add([(k + 1) << 20 | i for i in range(40)], 1)
        assert len(index) <= 1000
    assert index.depth_of(hot, 0) == 40, "a prefix recorded on every request never ages out"
    assert index.depth_of([1 << 20 | i for i in range(40)], 1) == 0, "one recorded once, long ago, has"


@given(st.lists(prompt, min_size=1, max_size=8), st.integers(1, 60))
@settings(max_examples=60)
def test_what_another_instance_records_from_a_block_fact_is_what_add_recorded(adds, limit: int) -> None:
    # A block fact carries ``recorded``'s output (capped at ``limit`` hashes); the receiver's
    # index then answers every depth as the sender's does, for the chain the fact names.
    sender, receiver = BlockIndex(100_000, MAX_BLOCKS, tails=True), BlockIndex(100_000, MAX_BLOCKS, tails=True)
    for i, p in enumerate(adds):
        hashes = chain_of(p, i)
        if not hashes:
            continue
        blocks, recorded = sender.recorded(hashes, limit)
        assert len(recorded) <= limit and recorded == [hashes[q] for q in sender.positions(blocks)]
        sender.add(hashes[:blocks], i % 3)
        assert receiver.add_recorded(blocks, recorded, i % 3)
        # One hash more or fewer than such a chain records is refused.
        assert not receiver.add_recorded(blocks, recorded + [7], 0) and not receiver.add_recorded(blocks, [], 0)
    for i, p in enumerate(adds):
        hashes = chain_of(p, i)
        assert receiver.depths(hashes, 0b111) == sender.depths(hashes, 0b111)
