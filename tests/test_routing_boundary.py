"""Stable-prefix boundaries: client hints, the default cap, candidate cuts, cache_control stripping."""

from __future__ import annotations

import copy

from hypothesis import given
from hypothesis import strategies as st

from routing.block_index import sampled_positions
from routing.boundary import candidate_cuts, default_cap, explicit_cuts, parse_boundary_hint, strip_cache_control
from routing.hashing import render

MARKER = "<!-- kvgate:cache-boundary -->"
POSITIONS = sampled_positions(2048)


def chat(*msgs: tuple[str, object], tools: list | None = None) -> dict:
    body: dict = {"model": "m", "messages": [{"role": r, "content": c} for r, c in msgs]}
    if tools:
        body["tools"] = tools
    return body


def test_strip_cache_control_removes_every_breakpoint_without_mutating() -> None:
    body = {
        "model": "m",
        "tools": [{"type": "function", "function": {"name": "f"}, "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "system", "content": [{"type": "text", "text": "s", "cache_control": {"type": "ephemeral"}}]},
            {"role": "user", "content": "q", "cache_control": {"type": "ephemeral"}},
        ],
    }
    before = copy.deepcopy(body)
    out = strip_cache_control(body)
    assert body == before, "the input must not change"
    assert "cache_control" not in repr(out)
    assert out["messages"][0]["content"][0] == {"type": "text", "text": "s"}
    assert out["tools"][0] == {"type": "function", "function": {"name": "f"}}
    assert out["model"] == "m"


def test_strip_cache_control_returns_the_same_object_when_there_is_nothing_to_strip() -> None:
    body = chat(("user", [{"type": "text", "text": "q"}]))
    assert strip_cache_control(body) is body
    assert strip_cache_control({"prompt": "x"}) == {"prompt": "x"}


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                        max_size=3), max_leaves=10)


@given(body=st.dictionaries(st.sampled_from(["messages", "tools", "model", "x"]), json_values, max_size=4))
def test_strip_cache_control_never_crashes_and_is_idempotent(body: dict) -> None:
    once = strip_cache_control(body)
    assert strip_cache_control(once) == once


def test_marker_breakpoints_and_header_give_explicit_cuts() -> None:
    text = "global rules " + MARKER + " org rules"
    r = render("chat", chat(("system", text), ("user", "q1"), ("assistant", "a1"), ("user", "q2")))
    cuts = explicit_cuts(r, MARKER, None)
    assert len(cuts) == 1 and r.data[: cuts[0]].endswith(MARKER.encode())
    assert explicit_cuts(r, MARKER, "2") == sorted(set(cuts) | {r.spans[1].end})
    for bad in ("", "x", "-1", "99", "1e3"):
        assert explicit_cuts(r, MARKER, bad) == cuts
    assert parse_boundary_hint(" 3 ") == 3 and parse_boundary_hint("abc") is None


def test_default_cap_is_the_first_user_turn() -> None:
    r = render("chat", chat(("system", "s"), ("user", "first"), ("assistant", "a"), ("user", "second")))
    assert default_cap(r) == (r.spans[1].start, r.spans[1].end)
    flat = render("completions", {"prompt": "p" * 500})
    assert default_cap(flat) == (0, len(flat.data))


def test_a_conversation_keeps_its_candidate_cuts_as_it_grows() -> None:
    turns = [("system", "sys " * 100), ("user", "question one " * 30)]
    short = render("chat", chat(*turns))
    long = render("chat", chat(*turns, ("assistant", "answer " * 50), ("user", "question two")))
    a = candidate_cuts(short, [], len(short.data), 64, POSITIONS)
    b = candidate_cuts(long, [], len(long.data), 64, POSITIONS)
    assert a == b
    assert a == sorted(set(a)) and a[-1] == short.spans[1].end
    assert short.spans[0].end in a, "message ends are exact cut points"


def test_breakpoints_past_the_first_turn_extend_the_cap() -> None:
    body = chat(("system", "s" * 100), ("user", "q" * 100), ("assistant", "a" * 100),
                ("user", [{"type": "text", "text": "new", "cache_control": {"type": "ephemeral"}}]))
    r = render("chat", body)
    explicit = explicit_cuts(r, MARKER, None)
    cuts = candidate_cuts(r, explicit, len(r.data), 64, POSITIONS)
    assert cuts[-1] == r.spans[-1].end
    limited = candidate_cuts(r, explicit, 128, 64, POSITIONS)
    assert max(limited) <= 128
