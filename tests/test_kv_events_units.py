"""Precise mode's pure parts: kvgate's token-block keys, the wire decoder, the event index, and the
simulator's pool events replayed into that index (the index then knows exactly what the pool holds)."""

from __future__ import annotations

import random

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from routing.kv_index import KVEventIndex
from routing.kv_wire import Batch, Cleared, Removed, Stored, WireError, decode_batch
from routing.token_keys import block_keys
from vllm_sim.kv import KVPool
from vllm_sim.kv_events import encode_batch

BS = 4
tokens = st.lists(st.integers(0, 2**32 - 1), max_size=40)


# -- token keys ------------------------------------------------------------------------------------
@given(tokens, tokens, tokens)
def test_keys_agree_exactly_as_far_as_full_blocks_agree(prefix: list[int], a: list[int], b: list[int]) -> None:
    ka, kb = block_keys(prefix + a, BS), block_keys(prefix + b, BS)
    same = 0
    x, y = prefix + a, prefix + b
    while (same + 1) * BS <= min(len(x), len(y)) and x[same * BS:(same + 1) * BS] == y[same * BS:(same + 1) * BS]:
        same += 1
    assert ka[:same] == kb[:same]
    if same < min(len(ka), len(kb)):
        assert ka[same] != kb[same]  # and a difference changes the chain from there on
    assert len(ka) == len(x) // BS


@given(tokens.filter(lambda t: len(t) >= BS), st.text(min_size=1, max_size=8))
def test_a_salt_gives_another_chain_and_a_parent_continues_one(ids: list[int], salt: str) -> None:
    plain, salted = block_keys(ids, BS), block_keys(ids, BS, salt)
    assert not set(plain) & set(salted)
    assert block_keys(ids[BS:], BS, parent=plain[0]) == plain[1:]


# -- wire ------------------------------------------------------------------------------------------
def _stored_map(**kw: object) -> dict[str, object]:
    base: dict[str, object] = {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
                               "token_ids": list(range(8)), "block_size": BS, "lora_id": None, "medium": "GPU",
                               "lora_name": None}
    return {**base, **kw}


def test_decodes_tagged_maps_and_legacy_arrays_alike() -> None:
    tagged = msgpack.packb([1.5, [_stored_map(extra_keys=[["acme"], None]),
                                  {"type": "BlockRemoved", "block_hashes": [2], "medium": "cpu"},
                                  {"type": "AllBlocksCleared"}], 0])
    stored = ["BlockStored", [1, 2], None, list(range(8)), BS, None, "GPU", None, [["acme"], None]]
    legacy = msgpack.packb([1.5, [stored, ["BlockRemoved", [2], "cpu"], ["AllBlocksCleared"]], 0])
    want = Batch(1.5, (Stored((1, 2), None, tuple(range(8)), BS, "GPU", "acme", None), Removed((2,), "CPU"),
                       Cleared()), 0)
    assert decode_batch(tagged) == want
    assert decode_batch(legacy) == want


def test_an_adapters_name_is_not_taken_for_the_salt() -> None:
    # vLLM's untagged keys of a LoRA request's first block: its name, then the salt if any.
    for extra, salt in (([["sql", "acme"], ["sql"]], "acme"), ([["sql"], ["sql"]], None)):
        raw = msgpack.packb([1.0, [_stored_map(extra_keys=extra, lora_name="sql")], 0])
        (stored,) = decode_batch(raw).events
        assert isinstance(stored, Stored) and (stored.salt, stored.lora_name) == (salt, "sql")


def test_bytes_hashes_and_unknown_event_types_and_map_batches() -> None:
    h = bytes(range(32))
    raw = msgpack.packb({"ts": 2.0, "events": [_stored_map(block_hashes=[h], token_ids=[1, 2, 3, 4]),
                                               {"type": "SomethingNew", "x": 1}], "data_parallel_rank": None})
    batch = decode_batch(raw)
    assert batch.events == (Stored((h,), None, (1, 2, 3, 4), BS, "GPU", None, None),)


@pytest.mark.parametrize("payload", [b"", b"\xc1", msgpack.packb([1.0]), msgpack.packb([1.0, [[]]]),
                                     msgpack.packb([1.0, [_stored_map(token_ids="x")]]),
                                     msgpack.packb([1.0, [_stored_map(block_size=0)]]),
                                     msgpack.packb([1.0, [{"no": "type"}]])])
def test_malformed_batches_raise_wire_error(payload: bytes) -> None:
    with pytest.raises(WireError):
        decode_batch(payload)


@settings(max_examples=300)
@given(st.binary(max_size=64))
def test_any_bytes_decode_or_raise_wire_error(payload: bytes) -> None:
    try:
        decode_batch(payload)
    except WireError:
        pass


# -- index -----------------------------------------------------------------------------------------
def _batch(*events: object) -> Batch:
    return Batch(0.0, tuple(events), 0)  # type: ignore[arg-type]


def test_index_finds_the_longest_consecutive_prefix_per_replica() -> None:
    ids = list(range(16))
    keys = block_keys(ids, BS)
    idx = KVEventIndex(BS)
    idx.apply("a", _batch(Stored((10, 11, 12), None, tuple(ids[:12]), BS, "GPU", None, None)))
    idx.apply("b", _batch(Stored((20,), None, tuple(ids[:4]), BS, "GPU", None, None)))
    # b's third block alone, hung on its first: not consecutive, so not counted.
    assert idx.held(keys, ["a", "b", "c"]) == {"a": 3.0, "b": 1.0, "c": 0.0}
    idx.apply("b", _batch(Stored((21,), 20, tuple(ids[4:8]), BS, "GPU", None, None)))
    assert idx.held(keys, ["b"]) == {"b": 2.0}
    idx.apply("a", _batch(Removed((11,), "GPU")))
    assert idx.held(keys, ["a", "b"]) == {"a": 1.0, "b": 2.0}
    idx.apply("a", _batch(Cleared()))
    assert idx.held(keys, ["a", "b"]) == {"a": 0.0, "b": 2.0}
    idx.remove_replica("b")
    assert idx.held(keys, ["a", "b"]) == {"a": 0.0, "b": 0.0} and len(idx) == 0


def test_unknown_parents_partial_blocks_and_salts() -> None:
    ids = list(range(8))
    idx = KVEventIndex(BS)
    idx.apply("a", _batch(Stored((5,), 99, tuple(ids[4:8]), BS, "GPU", None, None),  # parent never seen
                          Stored((6,), None, (1, 2), 2, "GPU", None, None)))  # a partial block
    idx.apply("a", _batch(Stored((7,), None, ("a", "b", "c", "d"), BS, "GPU", None, None)))  # not token ids
    assert len(idx) == 0 and idx.stats("a")["dropped"] == 1 and idx.stats("a")["skipped"] == 2
    idx.apply("a", _batch(Stored((1, 2), None, tuple(ids), BS, "GPU", "acme", None)))
    assert idx.held(block_keys(ids, BS, "acme"), ["a"]) == {"a": 2.0}
    assert idx.held(block_keys(ids, BS), ["a"]) == {"a": 0.0}  # another tenant's chain


def test_lower_tier_blocks_count_at_their_weight_and_overflow_clears() -> None:
    ids = list(range(12))
    idx = KVEventIndex(BS, cpu_weight=0.5)
    idx.apply("a", _batch(Stored((1,), None, tuple(ids[:4]), BS, "GPU", None, None),
                          Stored((2, 3), 1, tuple(ids[4:]), BS, "CPU", None, None)))
    assert idx.held(block_keys(ids, BS), ["a"]) == {"a": 2.0}
    small = KVEventIndex(BS, max_blocks=2)
    small.apply("a", _batch(Stored((1, 2, 3), None, tuple(ids), BS, "GPU", None, None)))
    assert len(small) == 0 and small.stats("a")["overflows"] == 1


SQL = ("sql-lora", "/adapters/sql")


# -- the simulator's pool, seen through its own events --------------------------------------------
@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31), st.sampled_from([False, True]), st.sampled_from(["sim", "vllm"]))
def test_replaying_the_pools_events_gives_the_index_exactly_what_the_pool_holds(seed: int, legacy: bool,
                                                                                   hashing: str) -> None:
    rng = random.Random(seed)
    hasher = None
    if hashing == "vllm":
        from vllm_sim.vllm_hash import vllm_block_hashes

        def hasher(t, bs, salt, lora):  # type: ignore[no-untyped-def]
            return vllm_block_hashes(t, bs, salt, "0", lora)
    pool = KVPool(24, BS, events=True, hasher=hasher)
    idx = KVEventIndex(BS)
    stems = [[rng.randrange(50) for _ in range(rng.randrange(4, 30))] for _ in range(4)]
    held = []
    as_int = rng.random() < 0.5  # a replica sends one hash encoding all its life
    for _ in range(25):
        prompt = rng.choice(stems) + [rng.randrange(50) for _ in range(rng.randrange(0, 12))]
        salt = rng.choice([None, None, "t1"])
        lora = rng.choice([None, None, SQL])  # a LoRA adapter's blocks are apart from its base model's
        hashes = pool.hash_prompt(prompt, salt, lora)
        alloc = pool.allocate(hashes, len(prompt), prompt, salt, lora[0] if lora else None)
        if alloc is not None:
            held.append(alloc)
        if held and (alloc is None or rng.random() < 0.6):
            pool.release(held.pop(rng.randrange(len(held))))
        if rng.random() < 0.05:
            pool.clear()  # a reset: AllBlocksCleared, or removals while requests pin blocks
        events = pool.take_events()
        if events:
            idx.apply("r", decode_batch(encode_batch(events, BS, legacy=legacy, int_hashes=as_int)))
        for stem in stems:
            for s in (None, "t1"):
                for adapter in (None, SQL):
                    want = pool.match(pool.hash_prompt(stem, s, adapter))
                    name = adapter[0] if adapter else None
                    assert idx.held(block_keys(stem, BS, s, lora=name), ["r"]) == {"r": float(want)}
