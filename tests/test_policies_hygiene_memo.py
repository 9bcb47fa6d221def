"""Hygiene's memos: the same warnings and reports as without them, each text scanned once, bounded memory."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from policies import PolicyEngine, RateLimiter, Tenant, TenantRegistry, scan_memo
from policies.hygiene import MAX_SCAN_CHARS, PrefixWarning, analyze, findings
from policies.hygiene_state import HygieneTracker
from policies.memo import DigestMemo, digest
from policies.normalize import tool_fingerprints

# Pieces that trip each detector, their near misses and the words that decide a date's context.
PIECES = [
    "Current time: 2025-03-03T10:22:01Z", "Generated at Mon, 03 Mar 2025 10:22:01 +0000", "now 14:05",
    "Server clock 10:22:01.", '{"ts": 1741000000123}', "Today is Monday, March 3 2025.", "as of 2024-05-05",
    "founded 2024-05-05", "today 03/03/2025", "550e8400-e29b-41d4-a716-446655440000",
    "9f86d081884c7d659a2feaa0c55ad015", "AbC9xYz2QwErTy7UiOp3Lk5", "request_id: req-8812abc",
    "trace-id=4bf92f3577b34da6a3ce929d0e0e4736", "Session ID: 9f1c2e7a", "v3.2.1", "9:00-17:00",
    "HTTPRequestHandler2", "Follow the style guide.", "Escalate refunds over 500 dollars.", " ", "\n", "today ",
    "<!-- b -->",
]
# Any character, lone surrogates included (a JSON body may carry them; the digest must not choke).
texts = st.lists(st.one_of(st.sampled_from(PIECES), st.text(st.characters(exclude_categories=()), max_size=24)),
                 max_size=12).map("".join)
roles = st.sampled_from(["system", "developer", "user", "assistant", "tool"])
contents = st.one_of(texts, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": texts}), max_size=3))
messages = st.lists(st.fixed_dictionaries({"role": roles, "content": contents}), min_size=1, max_size=5)


def exact(warnings: list[PrefixWarning]) -> list[tuple[PrefixWarning, int]]:
    """Warnings with their fingerprints, which equality leaves out."""
    return [(w, w.fingerprint) for w in warnings]


def chat(system: str, user: str = "hi", tools: list[Any] | None = None) -> dict[str, Any]:
    b: dict[str, Any] = {"model": "m", "messages": [{"role": "system", "content": system},
                                                    {"role": "user", "content": user}]}
    if tools is not None:
        b["tools"] = tools
    return b


SHARED_MEMO = scan_memo(8)  # small: across examples it both hits and evicts


@given(messages, st.sampled_from([None, 0, 1, 3]), st.sampled_from([None, "<!-- b -->"]))
def test_a_memoized_analysis_equals_a_fresh_one(msgs: list[dict[str, Any]], boundary: int | None,
                                                marker: str | None) -> None:
    body = {"model": "m", "messages": msgs}
    fresh = exact(analyze(body, boundary=boundary, marker=marker))
    memo = scan_memo()
    for m in (memo, memo, SHARED_MEMO):  # a miss, a hit, either
        assert exact(analyze(body, boundary=boundary, marker=marker, memo=m, scope="acme")) == fresh


def test_the_scan_budget_cuts_the_same_text_with_a_memo() -> None:
    first = "Stable rules. " * (MAX_SCAN_CHARS // 20)
    second = "request_id: r-1111 " + "x " * 40_000 + "Current time: 2025-03-03T10:22:01Z"
    body = {"messages": [{"role": "system", "content": first}, {"role": "system", "content": second},
                         {"role": "user", "content": "hi"}]}
    fresh = exact(analyze(body))
    assert [w.kind for w, _ in fresh] == ["request_id"]  # the timestamp is past the budget
    memo = scan_memo()
    assert exact(analyze(body, memo=memo)) == fresh == exact(analyze(body, memo=memo))


def test_a_hit_still_counts_the_losses_of_this_request() -> None:
    # The memo keeps what depends on the text alone; the loss runs to this request's boundary.
    memo = scan_memo()
    system = "Current time: 2025-03-03T10:22:01Z. " + "Follow the guide. " * 20
    for turns in (0, 3, 1, 6):
        history = [{"role": "user" if j % 2 == 0 else "assistant", "content": "x" * (10 + j)} for j in range(turns)]
        body = {"messages": [{"role": "system", "content": system}, *history, {"role": "user", "content": "q"}]}
        assert exact(analyze(body, memo=memo)) == exact(analyze(body))
    assert memo.computed == 1


def test_a_repeated_system_prompt_is_scanned_once_per_namespace() -> None:
    memo = scan_memo()
    system = "You are the support assistant. " * 800 + "Agent 550e8400-e29b-41d4-a716-446655440000."
    for i in range(50):
        [w] = analyze(chat(system, user=f"Question {i}"), memo=memo, scope="acme")
        assert w.kind == "uuid"
    assert memo.computed == 1
    # The same text for another namespace is its own entry: a hit's timing tells no tenant what
    # another sends. A changed prompt is a new text.
    analyze(chat(system), memo=memo, scope="beta")
    analyze(chat(system + " Be brief."), memo=memo, scope="acme")
    assert memo.computed == 3
    analyze(chat(system, user="again"), memo=memo, scope="beta")
    assert memo.computed == 3


@pytest.mark.anyio
async def test_the_engine_scans_a_prompt_once_over_many_requests() -> None:
    scans = scan_memo()
    e = PolicyEngine(TenantRegistry([], "s"), RateLimiter(None), HygieneTracker(), scans=scans)
    t = e.authenticate({})
    system = "You are the support assistant. " * 800
    for i in range(20):
        history = [{"role": "user", "content": f"turn {j}"} for j in range(i)]
        body = {"model": "m", "messages": [{"role": "system", "content": system}, *history,
                                           {"role": "user", "content": f"Question {i}"}]}
        assert (await e.admit(t, "chat", body)).warnings == ()
    assert scans.computed == 1  # past user turns are not scanned, so nothing else is either


def test_the_memo_stays_bounded_and_keeps_what_is_used() -> None:
    memo: DigestMemo[int] = DigestMemo(64)
    sizes = []
    for k in range(10_000):
        assert memo.get(k, lambda x: x * 2, k) == 2 * k
        assert memo.get(-1, lambda x: x * 2, -1) == -2  # a prompt sent with every request
        sizes.append(len(memo))
    assert max(sizes) <= 64
    assert memo.computed == 10_001  # -1 computed once, never evicted
    with pytest.raises(ValueError):
        DigestMemo(1)


@given(st.lists(st.integers(0, 40), max_size=200), st.integers(2, 16))
def test_the_memo_returns_what_the_function_would(keys: list[int], capacity: int) -> None:
    memo: DigestMemo[str] = DigestMemo(capacity)
    for k in keys:
        assert memo.get(k, str, k) == str(k)
        assert len(memo) <= capacity


def test_digests_separate_scopes_and_take_any_string() -> None:
    assert digest("abc") != digest("abc", seed=1)
    assert digest("\ud800 lone surrogate") != digest("\udc00 lone surrogate")
    assert findings("request_id: r-1111") == findings("request_id: r-1111")


TOOL_A = {"type": "function", "function": {"name": "a", "parameters": {"y": 1, "x": 2.0}}}
TOOL_B = {"type": "function", "function": {"name": "b", "description": "b tool", "parameters": {}}}
TOOL_A_KEYS = {"function": {"parameters": {"x": 2.0, "y": 1}, "name": "a"}, "type": "function"}
TOOL_BIG = {"type": "function", "function": {"name": "c", "parameters": {"max": 2**70}}}  # json.dumps fallback
TOOL_LISTS = [[TOOL_A, TOOL_B], [TOOL_B, TOOL_A], [TOOL_A_KEYS, TOOL_B], [TOOL_BIG], [TOOL_A, TOOL_BIG], None]
SYSTEMS = ["You are assisting Alice Smith. " + "Follow the company style guide. " * 8,
           "You are assisting Bob Jones. " + "Follow the company style guide. " * 8,
           "Current time: 2025-03-03T10:22:01Z. Follow the guide.",
           "Agent 550e8400-e29b-41d4-a716-446655440000 configuration. Follow the guide.",
           "request_id: r-1111 " + "Follow the company style guide. " * 3]


@given(st.lists(st.tuples(st.sampled_from(["acme", "beta"]), st.sampled_from(SYSTEMS),
                          st.sampled_from(TOOL_LISTS)), max_size=30))
def test_the_policy_path_gives_the_same_warnings_and_reports_with_memos(
        requests: list[tuple[str, str, list[Any] | None]]) -> None:
    plain = PolicyEngine(TenantRegistry([], "s"), RateLimiter(None), HygieneTracker(tool_memo=0))
    memoized = PolicyEngine(TenantRegistry([], "s"), RateLimiter(None), HygieneTracker(tool_memo=4),
                            scans=scan_memo(4))

    async def run() -> None:
        for i, (name, system, tools) in enumerate(requests):
            t = Tenant(name, name, cache_salt="salt")
            a = await plain.admit(t, "chat", chat(system, f"q{i}", tools))
            b = await memoized.admit(t, "chat", chat(system, f"q{i}", tools))
            assert exact(list(a.warnings)) == exact(list(b.warnings))
            assert a.response_headers == b.response_headers

    asyncio.run(run())
    assert plain.tracker is not None and memoized.tracker is not None
    assert plain.tracker.report().to_dict() == memoized.tracker.report().to_dict()


def test_tool_fingerprints_are_computed_once_per_tool_json_and_tenant() -> None:
    memo: DigestMemo[Any] = DigestMemo(64)
    for tools in itertools.islice(itertools.cycle(TOOL_LISTS[:-1]), 50):
        assert tool_fingerprints(tools, memo, seed=7) == tool_fingerprints(tools)
    assert memo.computed == 5
    tool_fingerprints(TOOL_LISTS[0], memo, seed=8)  # another tenant's entry
    assert memo.computed == 6


def test_the_trackers_tool_memo_is_bounded() -> None:
    t = HygieneTracker(tool_memo=16)
    for i in range(500):
        t.observe("acme", chat("Follow the guide.", tools=[{"type": "function", "function": {"name": f"f{i}"}}]),
                  [])
    assert t._tool_memo is not None and len(t._tool_memo) <= 16
