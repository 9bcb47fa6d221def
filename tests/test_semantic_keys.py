"""Cache keys, normalisation and bypass rules (pure functions; hypothesis for invariants)."""

from __future__ import annotations

import copy

from hypothesis import given, settings as hsettings, strategies as st

from semantic_cache import SemanticCacheSettings, cache_request
from semantic_cache.normalize import embedding_text, exact_text, query_text

ON = SemanticCacheSettings(enabled=True)


def chat(*messages: dict, **params: object) -> dict:
    return {"model": "m1", "messages": list(messages), **params}


def sys_msg(text: str) -> dict:
    return {"role": "system", "content": text}


def user(text: object) -> dict:
    return {"role": "user", "content": text}


def req(body: dict, headers: dict | None = None, endpoint: str = "chat", ns: str = "t1", **kw: object):
    return cache_request(endpoint, ns, body, headers or {}, settings=kw.pop("settings", ON), **kw)  # type: ignore[arg-type]


# ---- normalisation rule ----

def test_normalisation_levels() -> None:
    nfd = "Cafe\u0301"  # e + combining acute
    assert exact_text(nfd) == "Café"
    assert exact_text("\ufeffhello\u200b world\u200d\u00ad ") == "hello world"
    assert exact_text("a\r\nb\rc") == "a\nb\nc"
    # Inner whitespace survives the exact level (code indentation) but not the query level.
    assert exact_text("def f():\n    return 1") == "def f():\n    return 1"
    assert query_text("  what  is\n\tthis?  ") == "what is this?"
    # NFKC and case folding only for the embedder: x² stays distinct from x2 in the keys.
    assert exact_text("x²") != exact_text("x2")
    assert embedding_text("ＨＥＬＬＯ Straße") == "hello strasse"


def test_lone_surrogates_and_nul_do_not_crash() -> None:
    r = req(chat(user("bad \ud800 text \x00 here")))
    assert r.bypass_reason is None and r.exact_key
    assert "\ufffd" in r.query


def test_nfc_nfd_and_invisible_chars_share_keys() -> None:
    a = req(chat(user("Qu'est-ce qu'un café ?")))
    b = req(chat(user("Qu'est-ce qu'un cafe\u0301 ?\u200b")))
    c = req(chat(user("\ufeff  Qu'est-ce qu'un café ?  ")))
    assert a.exact_key == b.exact_key == c.exact_key


def test_case_changes_exact_key_but_not_partition() -> None:
    a, b = req(chat(user("What is Python?"))), req(chat(user("what is python?")))
    assert a.partition == b.partition and a.exact_key != b.exact_key


def test_text_parts_equal_plain_string() -> None:
    a = req(chat(sys_msg("be brief"), user("hi there")))
    b = req(chat({"role": "system", "content": [{"type": "text", "text": "be brief"}]},
                 user([{"type": "text", "text": "hi there"}])))
    assert (a.partition, a.exact_key) == (b.partition, b.exact_key)


def test_completions_prompt_is_byte_exact() -> None:
    a = req({"model": "m1", "prompt": "Once upon a time"}, endpoint="completions")
    b = req({"model": "m1", "prompt": "Once upon a time "}, endpoint="completions")
    assert a.bypass_reason is None and a.partition == b.partition
    assert a.exact_key != b.exact_key  # a trailing space changes the continuation
    assert not a.semantic  # completions are exact-tier only by default


# ---- isolation through keys ----

def test_context_changes_partition() -> None:
    base = req(chat(sys_msg("You are terse."), user("hi")))
    assert req(chat(sys_msg("You are verbose."), user("hi"))).partition != base.partition
    assert req(chat(sys_msg("You are terse."), user("hi")), ns="t2").partition != base.partition
    assert req({**chat(sys_msg("You are terse."), user("hi")), "model": "m2"}).partition != base.partition
    history = chat(sys_msg("You are terse."), user("earlier"), {"role": "assistant", "content": "ok"}, user("hi"))
    assert req(history).partition != base.partition
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert req(chat(sys_msg("You are terse."), user("hi"), tools=tools)).partition != base.partition


def test_output_params_change_partition_transport_fields_do_not() -> None:
    body = chat(user("hi"))
    base = req(body).partition
    for field, value in [("temperature", 0.2), ("top_p", 0.5), ("max_tokens", 7), ("stop", ["x"]),
                         ("seed", 3), ("response_format", {"type": "json_object"}), ("min_p", 0.1),
                         ("presence_penalty", 1), ("logit_bias", {"1": 5}), ("tool_choice", "none")]:
        assert req({**body, field: value}).partition != base, field
    for field, value in [("stream", True), ("stream_options", {"include_usage": True}), ("user", "u1"),
                         ("metadata", {"a": "b"}), ("n", 1), ("logprobs", False)]:
        assert req({**body, field: value}).partition == base, field
    assert req({**body, "temperature": 1}).partition == req({**body, "temperature": 1.0}).partition


# ---- bypass rules ----

def test_bypass_reasons() -> None:
    body = chat(user("hi"))
    assert req(body, settings=SemanticCacheSettings(enabled=False)).bypass_reason == "disabled"
    assert req(body, enabled_for_tenant=False).bypass_reason == "tenant_opt_out"
    assert req({**body, "n": 2}).bypass_reason == "n>1"
    assert req({**body, "logprobs": True}).bypass_reason == "logprobs"
    assert req({**body, "top_logprobs": 3}).bypass_reason == "logprobs"
    assert req(body, {"Cache-Control": "no-store"}).bypass_reason == "no_store"
    assert req(chat(user("hi"), {"role": "assistant", "content": "x"})).bypass_reason == "no_final_user_message"
    assert req(chat()).bypass_reason == "invalid_messages"
    assert req(chat(user("  \u200b "))).bypass_reason == "empty_query"
    image = [{"type": "text", "text": "what is this"}, {"type": "image_url", "image_url": {"url": "x"}}]
    assert req(chat(user(image), stream=True)).bypass_reason == "non_text_content"
    assert req({"messages": [user("hi")]}).bypass_reason == "no_model"
    assert req(body, endpoint="embeddings").bypass_reason == "unsupported_endpoint"
    assert req({"model": "m", "prompt": [1, 2, 3]}, endpoint="completions").bypass_reason == "unsupported_prompt"
    assert req({"model": "m", "prompt": ["a", "b"]}, endpoint="completions").bypass_reason == "unsupported_prompt"
    assert req({"model": "m", "messages": "nope"}).bypass_reason == "invalid_messages"
    assert req({"model": "m", "messages": [user("hi")], "stop": {1, 2}}).bypass_reason == "unhashable_request"


def test_no_cache_skips_lookup_but_allows_refresh() -> None:
    r = req(chat(user("hi")), {"cache-control": "max-age=0, no-cache"})
    assert r.bypass_reason == "no_cache" and r.store_ok and r.exact_key
    assert not req(chat(user("hi")), {"cache-control": "no-store"}).store_ok


def test_tools_do_not_bypass_lookup() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    r = req(chat(user("hi"), tools=tools))
    assert r.bypass_reason is None and r.store_ok


def test_long_messages_are_exact_tier_only() -> None:
    assert req(chat(user("short question?"))).semantic
    assert not req(chat(user("word " * 200))).semantic


# ---- property tests ----

_text = st.text(min_size=1, max_size=40).filter(lambda s: query_text(s) != "")
_scalar = st.one_of(st.integers(-5, 5), st.floats(0, 2, allow_nan=False), st.text(max_size=8), st.booleans())


@hsettings(max_examples=150, deadline=None)
@given(system=_text, question=_text, other=_text, temp=st.floats(0, 2, allow_nan=False))
def test_key_is_pure_and_partition_ignores_final_message(system: str, question: str, other: str,
                                                          temp: float) -> None:
    body = chat(sys_msg(system), user(question), temperature=temp)
    snapshot = copy.deepcopy(body)
    a, b = req(body), req(copy.deepcopy(body))
    assert a == b and body == snapshot  # deterministic, and the body is not mutated
    c = req(chat(sys_msg(system), user(other), temperature=temp))
    assert c.partition == a.partition
    assert (c.exact_key == a.exact_key) == (exact_text(other) == exact_text(question))


@hsettings(max_examples=150, deadline=None)
@given(system=_text, question=_text, field=st.sampled_from(
    ["temperature", "top_p", "top_k", "max_tokens", "max_completion_tokens", "stop", "seed",
     "presence_penalty", "frequency_penalty", "response_format", "tool_choice", "logit_bias",
     "repetition_penalty", "some_future_param"]), value=_scalar)
def test_any_context_field_changes_partition(system: str, question: str, field: str, value: object) -> None:
    base = req(chat(sys_msg(system), user(question)))
    assert req(chat(sys_msg(system), user(question), **{field: value})).partition != base.partition
    assert req(chat(sys_msg(system + "!"), user(question))).partition != base.partition
    assert req(chat(sys_msg(system), user("earlier turn"), {"role": "assistant", "content": system},
                    user(question))).partition != base.partition
