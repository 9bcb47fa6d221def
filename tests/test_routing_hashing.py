"""Prefix hashing: chained block hashes over a canonical rendering (properties, purity, speed)."""

from __future__ import annotations

import copy
import time

from hypothesis import given, settings
from hypothesis import strategies as st

from routing.hashing import chain_hashes, cut_hash, prefix_seed, render

BLOCK = 64
SEED = prefix_seed("m", "tenant")

texts = st.binary(min_size=0, max_size=2000)


@given(prefix=texts, a=texts, b=texts)
def test_equal_prefixes_give_equal_leading_hashes(prefix: bytes, a: bytes, b: bytes) -> None:
    ha = chain_hashes(prefix + a, SEED, BLOCK, 10_000)
    hb = chain_hashes(prefix + b, SEED, BLOCK, 10_000)
    shared = len(prefix) // BLOCK
    assert ha[:shared] == hb[:shared]


@given(data=st.binary(min_size=BLOCK, max_size=3000), at=st.integers(min_value=0), flip=st.integers(1, 255))
def test_a_difference_changes_every_later_hash(data: bytes, at: int, flip: int) -> None:
    at %= len(data)
    other = bytearray(data)
    other[at] ^= flip
    ha = chain_hashes(data, SEED, BLOCK, 10_000)
    hb = chain_hashes(bytes(other), SEED, BLOCK, 10_000)
    first = at // BLOCK
    assert ha[:first] == hb[:first]
    assert all(x != y for x, y in zip(ha[first:], hb[first:]))


@given(data=texts)
def test_hashing_is_pure_and_deterministic(data: bytes) -> None:
    frozen = bytes(data)
    assert chain_hashes(data, SEED, BLOCK, 100) == chain_hashes(frozen, SEED, BLOCK, 100)
    assert data == frozen


@given(data=st.binary(min_size=0, max_size=1000), cut=st.integers(min_value=0, max_value=1000))
def test_cut_hash_on_a_block_boundary_is_the_chain_hash(data: bytes, cut: int) -> None:
    hashes = chain_hashes(data, SEED, BLOCK, 10_000)
    cut = min(cut, len(data))
    h = cut_hash(data, hashes, SEED, BLOCK, cut)
    if cut % BLOCK == 0:
        assert h == (hashes[cut // BLOCK - 1] if cut else SEED)
    # The key of a prefix depends only on the prefix.
    assert h == cut_hash(data[:cut], chain_hashes(data[:cut], SEED, BLOCK, 10_000), SEED, BLOCK, cut)


def test_only_full_blocks_are_hashed_and_max_blocks_caps_work() -> None:
    assert chain_hashes(b"x" * 63, SEED, BLOCK, 100) == []
    assert len(chain_hashes(b"x" * 640, SEED, BLOCK, 100)) == 10
    assert len(chain_hashes(b"x" * 640, SEED, BLOCK, 3)) == 3


def test_model_and_namespace_seed_every_hash() -> None:
    data = b"the same prompt text " * 20
    base = chain_hashes(data, prefix_seed("m", "a"), BLOCK, 100)
    for seed in (prefix_seed("m", "b"), prefix_seed("m2", "a")):
        assert all(x != y for x, y in zip(base, chain_hashes(data, seed, BLOCK, 100)))


messages = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": st.text(max_size=200)}),
    max_size=6,
)


@given(msgs=messages, more=messages)
def test_rendering_a_longer_conversation_extends_the_shorter_one(msgs: list, more: list) -> None:
    short = render("chat", {"messages": msgs}).data
    long = render("chat", {"messages": msgs + more}).data
    assert long.startswith(short)


@given(msgs=messages)
def test_rendering_is_pure(msgs: list) -> None:
    body = {"model": "m", "messages": msgs, "tools": [{"type": "function", "function": {"name": "f"}}]}
    before = copy.deepcopy(body)
    assert render("chat", body) == render("chat", copy.deepcopy(body))
    assert body == before


def test_rendering_separates_roles_and_fields() -> None:
    a = render("chat", {"messages": [{"role": "user", "content": "ab"}]}).data
    b = render("chat", {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}).data
    c = render("chat", {"messages": [{"role": "system", "content": "ab"}]}).data
    assert len({a, b, c}) == 3


def test_cache_control_never_changes_the_stream_but_marks_breakpoints() -> None:
    plain = {"messages": [{"role": "system", "content": [{"type": "text", "text": "stable"}]},
                          {"role": "user", "content": "q"}]}
    marked = copy.deepcopy(plain)
    marked["messages"][0]["content"][0]["cache_control"] = {"type": "ephemeral"}
    r_plain, r_marked = render("chat", plain), render("chat", marked)
    assert r_plain.data == r_marked.data
    assert r_plain.breakpoints == ()
    assert r_marked.breakpoints == (r_marked.spans[0].end,)


def test_tool_order_is_part_of_the_prefix() -> None:
    t1, t2 = {"type": "function", "function": {"name": "a"}}, {"type": "function", "function": {"name": "b"}}
    assert render("chat", {"tools": [t1, t2], "messages": []}).data != \
        render("chat", {"tools": [t2, t1], "messages": []}).data


def test_completions_prompts_and_odd_inputs_render() -> None:
    assert render("completions", {"prompt": "hello"}).data.endswith(b"hello")
    assert render("completions", {"prompt": ["first", "second"]}).data.endswith(b"first")
    assert render("completions", {"prompt": [1, 2, 3]}).data != render("completions", {"prompt": [1, 2, 4]}).data
    assert render("chat", {"messages": [{"role": "user", "content": "\ud800 lone surrogate"}]}).data
    assert render("chat", {"messages": ["not a dict", None]}).spans
    assert render("embeddings", {"input": "x"}).data.endswith(b"x")


@settings(deadline=None, max_examples=1)
@given(st.just(None))
def test_a_100k_character_prompt_hashes_in_linear_time(_: None) -> None:
    text = ("lorem ipsum dolor sit amet " * 4000)[:100_000]
    body = {"messages": [{"role": "system", "content": text}, {"role": "user", "content": "hi"}]}
    best = float("inf")
    for _ in range(20):
        started = time.perf_counter()
        data = render("chat", body).data
        chain_hashes(data, SEED, BLOCK, 4096)
        best = min(best, time.perf_counter() - started)
    # 0.3-0.7 ms depending on the machine (python -m bench.routing prints it); this
    # only catches a pathological regression, not a slower CI machine.
    assert best < 20e-3, f"{best * 1e3:.2f} ms"
