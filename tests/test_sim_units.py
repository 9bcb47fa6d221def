"""The simulator's pure building blocks: tokenizer, template, block hashes, KV pool, timing."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_sim.kv import KVPool, block_hashes
from vllm_sim.reply import ReplyWriter, default_length, reply_seed
from vllm_sim.template import render_chat
from vllm_sim.timing import TimingModel
from vllm_sim.tokenizer import count_tokens, tokenize

ENGLISH = (
    "Automatic prefix caching is on by default, and only full blocks are cached. A gateway that "
    "routes requests sharing a long system prompt to the same replica saves the prefill of that "
    "prompt, which is most of the time to first token for retrieval-augmented chat workloads."
)


# -- tokenizer -----------------------------------------------------------------------------------
def test_tokenize_is_deterministic_and_about_four_chars_per_token() -> None:
    ids = tokenize(ENGLISH)
    assert ids == tokenize(ENGLISH)
    assert count_tokens(ENGLISH) == len(ids)
    assert 3.3 <= len(ENGLISH) / len(ids) <= 4.7
    assert all(0 <= i < 1 << 32 for i in ids)


def test_tokenize_shares_prefix_ids_for_shared_text_prefix() -> None:
    a = tokenize(ENGLISH + " First question?")
    b = tokenize(ENGLISH + " Second question?")
    common = len(tokenize(ENGLISH))
    assert a[:common] == b[:common]
    assert a != b


def test_tokenize_edge_cases() -> None:
    assert tokenize("") == []
    assert len(tokenize("x" * 400)) == 100  # long words split in 4-character pieces
    assert tokenize("héllo wörld 日本語") == tokenize("héllo wörld 日本語")
    assert len(tokenize("a\n\n  b")) >= 3


# -- template ------------------------------------------------------------------------------------
def test_render_chat_chatml_with_parts_and_tools() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"b": 1, "a": 2}}}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [
            {"type": "text", "text": "look "},
            {"type": "image_url", "image_url": {"url": "x"}},
            {"type": "text", "text": "here"},
        ]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "function": {"name": "f"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]
    text = render_chat(messages, tools)
    assert text.startswith("<|im_start|>system\n# Tools\n<tools>\n" + json.dumps(tools[0]))
    assert "<|im_start|>user\nlook <|image_url|>here<|im_end|>\n" in text
    assert json.dumps({"id": "c1", "function": {"name": "f"}}) in text
    assert text.endswith("<|im_start|>assistant\n")
    assert not render_chat(messages, add_generation_prompt=False).endswith("assistant\n")


def test_render_chat_does_not_canonicalise_tool_key_order() -> None:
    one = [{"type": "function", "function": {"name": "f", "parameters": {"a": 1, "b": 2}}}]
    two = [{"type": "function", "function": {"parameters": {"b": 2, "a": 1}, "name": "f"}}]
    msgs = [{"role": "user", "content": "hi"}]
    assert render_chat(msgs, one) != render_chat(msgs, two)


# -- block hashes ----------------------------------------------------------------------------------
token_lists = st.lists(st.integers(min_value=0, max_value=(1 << 32) - 1), min_size=0, max_size=120)


@settings(max_examples=150, deadline=None)
@given(prefix=token_lists, tail_a=token_lists, tail_b=token_lists)
def test_block_hashes_equal_prefixes_give_equal_leading_hashes(prefix, tail_a, tail_b) -> None:
    bs = 8
    a, b = block_hashes(prefix + tail_a, bs), block_hashes(prefix + tail_b, bs)
    shared = len(prefix) // bs
    assert a[:shared] == b[:shared]
    assert len(a) == len(prefix + tail_a) // bs


@settings(max_examples=150, deadline=None)
@given(tokens=st.lists(st.integers(0, 1000), min_size=16, max_size=96), data=st.data())
def test_block_hashes_change_in_block_i_changes_every_hash_from_i(tokens, data) -> None:
    bs = 8
    position = data.draw(st.integers(0, len(tokens) - 1))
    changed = list(tokens)
    changed[position] += 1
    a, b = block_hashes(tokens, bs), block_hashes(changed, bs)
    i = position // bs
    assert a[:i] == b[:i]
    assert all(x != y for x, y in zip(a[i:], b[i:]))


def test_block_hashes_salt_enters_block_zero_so_nothing_is_shared() -> None:
    ids = list(range(64))
    plain, salted, other = block_hashes(ids), block_hashes(ids, salt="t1"), block_hashes(ids, salt="t2")
    assert len(plain) == 4
    assert all(x != y for x, y in zip(plain, salted))
    assert all(x != y for x, y in zip(salted, other))
    assert block_hashes(ids, salt="t1") == salted
    assert block_hashes(ids, salt="") == plain


# -- KV pool ---------------------------------------------------------------------------------------
def _prompt(seed: int, blocks: int, extra: int = 0) -> list[int]:
    return [seed * 100_000 + i for i in range(blocks * 16 + extra)]


def test_pool_reuses_all_but_the_last_token_block() -> None:
    pool = KVPool(64)
    ids = _prompt(1, 4, extra=5)  # 69 tokens: 4 full blocks + a partial one
    first = pool.allocate(block_hashes(ids), len(ids))
    assert first is not None and first.cached_tokens == 0 and first.num_blocks == 5
    assert pool.usage == 5 / 64
    pool.release(first)
    assert pool.usage == 0 and pool.num_cached_blocks == 4
    again = pool.allocate(block_hashes(ids), len(ids))
    assert again is not None and again.cached_tokens == 64
    pool.release(again)
    # Exactly 4 blocks: the last token must be recomputed, so only 3 blocks are reused.
    exact = ids[:64]
    hit = pool.allocate(block_hashes(exact), len(exact))
    assert hit is not None and hit.cached_tokens == 48
    pool.release(hit)
    assert pool.queries_tokens == 69 + 69 + 64
    assert pool.hits_tokens == 64 + 48


def test_pool_match_has_no_side_effects() -> None:
    pool = KVPool(8)
    ids = _prompt(2, 3)
    pool.release(pool.allocate(block_hashes(ids), len(ids)))
    assert pool.match(block_hashes(ids)) == 3
    assert pool.match(block_hashes(_prompt(3, 3))) == 0
    assert pool.queries_tokens == 48 and pool.usage == 0


def test_pool_evicts_least_recently_used_unpinned_blocks() -> None:
    pool = KVPool(8)
    old, recent, new = _prompt(1, 4), _prompt(2, 4), _prompt(3, 4)
    for ids in (old, recent):
        pool.release(pool.allocate(block_hashes(ids), len(ids) + 1))  # +1: 5 blocks each, 4 cached
    # 8 cached blocks fill the pool; a new 4-block prompt evicts the least recent ones: old's.
    got = pool.allocate(block_hashes(new), len(new))
    assert got is not None
    assert pool.match(block_hashes(old)) == 0
    assert pool.match(block_hashes(recent)) == 4
    pool.release(got)
    assert pool.num_cached_blocks <= 8


def test_pool_evicts_a_released_prompt_tail_first() -> None:
    pool = KVPool(6)
    a = _prompt(1, 4)
    pool.release(pool.allocate(block_hashes(a), len(a) + 1))
    b = _prompt(2, 3)
    # b needs 3 blocks, 2 are free: one of a's 4 cached blocks goes, and it is the tail.
    pool.release(pool.allocate(block_hashes(b), len(b)))
    assert pool.match(block_hashes(a)) == 3


def test_pool_refuses_without_side_effects_when_pinned_blocks_fill_it() -> None:
    pool = KVPool(4)
    held = pool.allocate(block_hashes(_prompt(1, 3)), 48)
    assert held is not None and pool.usage == 0.75
    assert pool.allocate(block_hashes(_prompt(2, 2)), 32) is None
    assert pool.queries_tokens == 48 and pool.usage == 0.75
    assert pool.grow(held, 16) is True and pool.usage == 1.0
    assert pool.grow(held, 16) is False
    pool.release(held)
    pool.release(held)  # idempotent
    assert pool.usage == 0
    assert pool.allocate(block_hashes(_prompt(2, 2)), 32) is not None


def test_a_prompt_prefilled_in_chunks_caches_each_block_once_its_chunk_fills_it() -> None:
    """vLLM's ``allocate_slots`` with a token budget: the whole prompt must fit to be admitted, the
    first chunk gets blocks, and each chunk caches the prompt blocks it completes (one Stored run
    per chunk, chained to the block before it), so a later request finds them at once."""
    pool = KVPool(10, events=True)
    ids = _prompt(1, 6, extra=4)  # 100 tokens: 6 full blocks and a partial one
    hashes = block_hashes(ids)
    held = pool.allocate(hashes, len(ids), ids, limit=40)
    assert held is not None and held.num_blocks == 3 and held.num_tokens == 40
    first_chunk = pool.take_events()
    # Only full blocks of computed tokens are cached: 2 of the 3 (32 of the 40 tokens).
    assert [len(e.hashes) for e in first_chunk] == [2] and pool.match(hashes) == 2
    assert pool.grow(held, 40, hashes, ids) and held.num_tokens == 80 and held.num_blocks == 5
    [second] = pool.take_events()
    assert second.hashes == tuple(hashes[2:5]) and second.parent == hashes[1]
    assert second.token_ids == tuple(ids[32:80]) and pool.match(hashes) == 5
    assert pool.grow(held, 20, hashes, ids) and held.num_blocks == 7 and len(held.pinned) == 6
    # 3 of 10 blocks left: a 3-block prompt fits, and a 4-block one does not, though its first
    # 16-token chunk would.
    assert pool.allocate(block_hashes(_prompt(2, 4)), 64, limit=16) is None
    assert pool.allocate(block_hashes(_prompt(2, 3)), 48, limit=16) is not None


def test_pool_shared_blocks_stay_pinned_until_every_user_releases() -> None:
    pool = KVPool(16)
    ids = _prompt(1, 4, extra=1)
    a = pool.allocate(block_hashes(ids), len(ids))
    b = pool.allocate(block_hashes(ids), len(ids))
    assert a is not None and b is not None and b.cached_tokens == 64
    assert pool.usage == (5 + 1) / 16
    pool.release(a)
    assert pool.usage == 5 / 16
    pool.release(b)
    assert pool.usage == 0
    assert pool.clear() is True and pool.num_cached_blocks == 0 and pool.hits_tokens == 0


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.integers(0, 5), st.integers(1, 90), st.booleans()), max_size=60))
def test_pool_memory_stays_bounded_and_accounting_returns_to_zero(ops) -> None:
    pool = KVPool(12)
    held = []
    for seed, length, release_now in ops:
        ids = _prompt(seed, 0, extra=length)
        allocation = pool.allocate(block_hashes(ids), length)
        if allocation is not None:
            held.append(allocation)
        if release_now and held:
            pool.release(held.pop(0))
        assert pool.num_cached_blocks <= 12 and 0 <= pool.usage <= 1
    for allocation in held:
        pool.release(allocation)
    assert pool.usage == 0


# -- timing and reply ------------------------------------------------------------------------------
def test_timing_model_shapes_and_scale() -> None:
    t = TimingModel()
    assert t.prefill_time(15000) == pytest.approx(1.004)
    assert t.decode_step_time(64) > t.decode_step_time(1)
    fast = TimingModel(time_scale=0.01)
    assert fast.prefill_time(1000) == pytest.approx(t.prefill_time(1000) / 100)
    assert TimingModel(time_scale=0).decode_step_time(64) == 0
    with pytest.raises(ValueError):
        TimingModel(max_num_seqs=0)


def test_reply_is_deterministic_and_one_token_per_word() -> None:
    seed = reply_seed(tokenize(ENGLISH))
    words = [ReplyWriter(seed).next_token() for _ in range(1)]
    writer_a, writer_b = ReplyWriter(seed), ReplyWriter(seed)
    text_a = "".join(writer_a.next_token() for _ in range(40))
    assert text_a == "".join(writer_b.next_token() for _ in range(40))
    assert text_a.startswith(words[0])
    assert count_tokens(text_a) == 40
    assert 16 <= default_length(seed) <= 64
    assert reply_seed(tokenize(ENGLISH), 1) != seed
