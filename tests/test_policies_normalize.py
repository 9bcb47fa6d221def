"""Tool normalisation: idempotent, insensitive to key order (and tool order when asked)."""

from __future__ import annotations

import copy
import json
import random
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from policies.normalize import canonical, normalize_tools, tool_fingerprints

json_scalars = st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.text(max_size=8) | st.floats(
    allow_nan=False, allow_infinity=False, width=32)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=5),
    max_leaves=20,
)
tool_lists = st.lists(
    st.builds(lambda params, desc: {"type": "function",
                                    "function": {"description": desc, "parameters": params}},
              st.dictionaries(st.text(max_size=6), json_values, max_size=5), st.text(max_size=10)),
    min_size=1, max_size=5,
).map(lambda tools: [dict(t, function=dict(t["function"], name=f"tool_{i}")) for i, t in enumerate(tools)])


def shuffled_keys(value: Any, rng: random.Random) -> Any:
    """The same JSON value with every object's keys in a random order (lists untouched)."""
    if isinstance(value, dict):
        items = list(value.items())
        rng.shuffle(items)
        return {k: shuffled_keys(v, rng) for k, v in items}
    if isinstance(value, list):
        return [shuffled_keys(v, rng) for v in value]
    return value


def render(body: dict[str, Any]) -> str:
    # how a chat template's tojson sees it: insertion order, no sort_keys
    return json.dumps(body["tools"], separators=(",", ":"))


@settings(max_examples=60, deadline=None)
@given(tool_lists, st.randoms(use_true_random=False))
def test_normalisation_is_idempotent(tools: list[Any], rng: random.Random) -> None:
    body = {"model": "m", "tools": shuffled_keys(tools, rng)}
    once = normalize_tools(body, sort_tools=True)
    assert render(normalize_tools(once, sort_tools=True)) == render(once)
    assert render(normalize_tools(normalize_tools(body), sort_tools=False)) == render(normalize_tools(body))


@settings(max_examples=60, deadline=None)
@given(tool_lists, st.randoms(use_true_random=False))
def test_key_order_never_changes_the_rendering(tools: list[Any], rng: random.Random) -> None:
    a = normalize_tools({"tools": shuffled_keys(tools, rng)})
    b = normalize_tools({"tools": shuffled_keys(tools, rng)})
    assert render(a) == render(b)


@settings(max_examples=60, deadline=None)
@given(tool_lists, st.randoms(use_true_random=False))
def test_tool_order_only_matters_without_sort_tools(tools: list[Any], rng: random.Random) -> None:
    permuted = list(tools)
    rng.shuffle(permuted)
    assert render(normalize_tools({"tools": tools}, sort_tools=True)) == render(
        normalize_tools({"tools": shuffled_keys(permuted, rng)}, sort_tools=True))
    kept = normalize_tools({"tools": permuted})
    assert [t["function"]["name"] for t in kept["tools"]] == [t["function"]["name"] for t in permuted]


@settings(max_examples=100, deadline=None)
@given(json_values)
def test_canonical_keeps_the_json_value(value: Any) -> None:
    assert json.loads(json.dumps(canonical(value))) == json.loads(json.dumps(value))


def test_lists_keep_their_order_and_integral_floats_become_ints() -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "required": ["b", "a"], "properties": {"b": {"enum": ["z", "y"], "minimum": 1.0},
                                                                 "a": {"type": "number", "maximum": 2.5}}}}}
    out = normalize_tools({"tools": [tool]})["tools"][0]["function"]["parameters"]
    assert out["required"] == ["b", "a"]
    assert list(out["properties"]) == ["a", "b"]
    assert out["properties"]["b"] == {"enum": ["z", "y"], "minimum": 1}
    assert isinstance(out["properties"]["b"]["minimum"], int)
    assert out["properties"]["a"]["maximum"] == 2.5


def test_input_is_not_modified_and_other_fields_pass_through() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"function": {"parameters": {"b": 1, "a": 2}, "name": "z"}, "type": "function"}],
            "functions": [{"parameters": {"y": 1, "x": 2}, "name": "legacy"}], "tool_choice": "auto"}
    before = copy.deepcopy(body)
    out = normalize_tools(body, sort_tools=True)
    assert body == before and json.dumps(body) == json.dumps(before)
    assert out["messages"] is body["messages"] and out["tool_choice"] == "auto"
    assert list(out["tools"][0]) == ["function", "type"]
    assert list(out["functions"][0]["parameters"]) == ["x", "y"]
    assert normalize_tools({"model": "m", "tools": "not a list"})["tools"] == "not a list"


def test_fingerprints_tell_key_order_from_tool_order() -> None:
    a = {"type": "function", "function": {"name": "a", "parameters": {"x": 1, "y": 2}}}
    a_keys = {"function": {"parameters": {"y": 2, "x": 1}, "name": "a"}, "type": "function"}
    b = {"type": "function", "function": {"name": "b", "parameters": {}}}
    base, keys, order = tool_fingerprints([a, b]), tool_fingerprints([a_keys, b]), tool_fingerprints([b, a])
    assert base.canonical == keys.canonical == order.canonical
    assert base.ordered == keys.ordered and base.raw != keys.raw
    assert base.ordered != order.ordered
