"""Cross-request hygiene: tool nondeterminism, per-user names, stable values, the bounded report."""

from __future__ import annotations

import json
from typing import Any

from policies.hygiene import analyze
from policies.hygiene_state import HygieneTracker, differing_span

SHARED = ("Follow the company style guide. Answer in at most three paragraphs and cite the knowledge base "
          "articles you used. Escalate refunds over 500 dollars to a human agent. ") * 4


def body(system: str, tools: list[Any] | None = None, user: str = "hi") -> dict[str, Any]:
    b: dict[str, Any] = {"model": "m", "messages": [{"role": "system", "content": system},
                                                    {"role": "user", "content": user}]}
    if tools is not None:
        b["tools"] = tools
    return b


def observe(tracker: HygieneTracker, tenant: str, b: dict[str, Any]) -> list[str]:
    return [w.kind for w in tracker.observe(tenant, b, analyze(b))]


def tool(name: str, params: dict[str, Any]) -> dict[str, Any]:
    fn = {"name": name, "description": f"{name} tool", "parameters": params}
    return {"type": "function", "function": fn}


SEARCH = tool("search", {"type": "object", "properties": {"q": {"type": "string"}, "k": {"type": "integer"}}})
FETCH = tool("fetch", {"type": "object", "properties": {"url": {"type": "string"}}})
SEARCH_KEYS = {"function": {"parameters": {"properties": {"k": {"type": "integer"}, "q": {"type": "string"}},
                                           "type": "object"}, "description": "search tool", "name": "search"},
               "type": "function"}


def test_same_tools_rendered_the_same_raise_nothing() -> None:
    t = HygieneTracker()
    for _ in range(3):
        assert observe(t, "acme", body(SHARED, [SEARCH, FETCH])) == []


def test_tool_key_order_change_is_flagged() -> None:
    t = HygieneTracker()
    assert observe(t, "acme", body(SHARED, [SEARCH, FETCH])) == []
    [w] = t.observe("acme", body(SHARED, [SEARCH_KEYS, FETCH]), [])
    assert (w.kind, w.message_index, w.role, w.location) == ("tool_key_order", None, "tools", "tools")
    assert w.tokens_lost_estimate >= len(SHARED) // 4


def test_tool_order_change_is_flagged() -> None:
    t = HygieneTracker()
    observe(t, "acme", body(SHARED, [SEARCH, FETCH]))
    assert observe(t, "acme", body(SHARED, [FETCH, SEARCH])) == ["tool_order"]


def test_tools_are_remembered_per_tenant() -> None:
    t = HygieneTracker()
    observe(t, "acme", body(SHARED, [SEARCH, FETCH]))
    assert observe(t, "beta", body(SHARED, [FETCH, SEARCH])) == []


def test_a_per_user_name_in_a_shared_system_prompt_is_flagged() -> None:
    t = HygieneTracker()
    assert observe(t, "acme", body("You are assisting Alice Smith. " + SHARED)) == []
    [w] = t.observe("acme", body("You are assisting Bob Jones. " + SHARED), [])
    assert w.kind == "per_user_name" and w.offset == len("You are assisting ")
    assert "Bob" not in w.excerpt and len(w.excerpt) <= 40
    assert w.tokens_lost_estimate == (len("Bob Jones. " + SHARED)) // 4
    # names that share letters are still whole words
    assert observe(t, "acme", body("You are assisting Alan Smith. " + SHARED)) == ["per_user_name"]


def test_unrelated_or_identical_prompts_are_not_per_user() -> None:
    t = HygieneTracker()
    observe(t, "acme", body("You are a billing assistant. " + SHARED))
    assert observe(t, "acme", body("You are a billing assistant. " + SHARED)) == []
    other = "Translate everything the user says into French, word for word. " * 5
    assert observe(t, "acme", body(other)) == []


def test_differing_span_rules() -> None:
    tail = "x" * 60
    assert differing_span("Hi Alice, " + tail, "Hi Bob, " + tail) == (3, 8)
    assert differing_span("Plan: gold. " + tail, "Plan: silver. " + tail) == (6, 10)
    assert differing_span("Hello. " + tail, "Hello Bob. " + tail) == (5, 5)  # a name inserted
    assert differing_span("Hi Alice, " + tail, "Hi Alice, " + tail) is None
    assert differing_span("Hi Alice, short", "Hi Bob, short") is None  # too little agrees after
    assert differing_span("Order 12345. " + tail, "Order 67890. " + tail) is None  # digits: not a name
    assert differing_span("A" * 50 + tail, "B" * 50 + tail) is None  # too long to be a name


def test_a_value_that_never_changes_stops_being_reported() -> None:
    t = HygieneTracker(stable_after=3)
    fixed = body("Agent 550e8400-e29b-41d4-a716-446655440000 configuration. " + SHARED)
    kinds = [observe(t, "acme", fixed) for _ in range(6)]
    assert kinds == [["uuid"]] * 3 + [[]] * 3


def test_values_that_alternate_keep_being_reported() -> None:
    t = HygieneTracker(stable_after=2)
    a = body("request_id: r-1111 " + SHARED)
    b = body("request_id: r-2222 " + SHARED)
    assert [observe(t, "acme", x) for x in (a, b, a, b, a, b)] == [["request_id"]] * 6


def test_report_counts_kinds_keeps_few_examples_and_sums_losses() -> None:
    t = HygieneTracker(examples=2)
    for i in range(5):
        observe(t, "acme", body(f"Current time: 2025-03-03T10:22:0{i}Z. " + SHARED))
    observe(t, "acme", body(SHARED))
    observe(t, "beta", body(SHARED))
    report = t.report()
    acme = report.tenants["acme"]
    assert (acme.requests, acme.requests_with_warnings) == (6, 5)
    assert acme.kinds["timestamp"].count == 5
    assert 1 <= len(acme.kinds["timestamp"].examples) <= 2
    assert acme.tokens_lost_estimate == 5 * ((len(SHARED) + len("2025-03-03T10:22:00Z. ")) // 4)
    assert report.tenants["beta"].kinds == {}
    assert report.total_tokens_lost == acme.tokens_lost_estimate
    assert set(t.report("beta").tenants) == {"beta"}


def test_report_carries_no_prompt_text_beyond_short_excerpts() -> None:
    t = HygieneTracker()
    secret_sentence = "The vault combination is kept in the blue binder on shelf nine."
    observe(t, "acme", body(secret_sentence + " Current time: 2025-03-03T10:22:01Z"))
    dumped = json.dumps(t.report().to_dict())
    assert "vault combination" not in dumped and "2025-03-03" not in dumped
    assert "timestamp" in dumped


def test_memory_is_bounded() -> None:
    t = HygieneTracker(max_tenants=3, tool_sets=2, prompts=2)
    for i in range(10):
        observe(t, f"tenant-{i}", body(SHARED))
    assert set(t.report().tenants) == {"tenant-7", "tenant-8", "tenant-9"}
    for i in range(5):
        observe(t, "tenant-9", body(f"You are helping user{'x' * i} now. " + SHARED, [tool(f"t{i}", {})]))
    state = t._tenants["tenant-9"]  # white-box: the caps hold
    assert len(state.tools) <= 2 and len(state.prompts) <= 2
    assert all(len(p) <= 4096 for _, p in state.prompts)
    t.reset("tenant-9")
    assert "tenant-9" not in t.report().tenants
    t.reset()
    assert t.report().tenants == {}
