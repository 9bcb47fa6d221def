"""cache_salt isolation and the body fields a client may not set."""

from __future__ import annotations

import re

from policies.salt import STRIPPED_FIELDS, apply_salt, cache_salt, strip_client_fields


def test_salt_is_stable_short_and_urlsafe() -> None:
    s = cache_salt("acme", "secret")
    assert s == cache_salt("acme", "secret") == cache_salt("acme", b"secret")
    assert re.fullmatch(r"[A-Za-z0-9_-]{22}", s)


def test_salt_differs_by_namespace_and_by_secret() -> None:
    salts = {cache_salt(ns, "secret") for ns in ("acme", "beta", "Acme", "acme ", "")}
    assert len(salts) == 5
    assert cache_salt("acme", "secret") != cache_salt("acme", "other-secret")


def test_salt_is_not_the_namespace_in_disguise() -> None:
    # derived from the secret: a client knowing a namespace name cannot compute it
    assert "acme" not in cache_salt("acme", "secret")


def test_apply_salt_overwrites_the_client_value_without_mutating_input() -> None:
    body = {"model": "m", "messages": [], "cache_salt": "attacker-chosen"}
    out = apply_salt(body, "ours")
    assert out["cache_salt"] == "ours"
    assert body["cache_salt"] == "attacker-chosen"
    assert out["messages"] is body["messages"]  # shallow: no deep copy on the hot path


def test_strip_removes_dangerous_fields_and_reports_their_names() -> None:
    body = {"model": "m", "messages": [], "api_base": "http://evil", "base_url": "http://evil",
            "api_key": "sk-x", "cache_salt": "x", "kv_transfer_params": {"remote_block_ids": [1]},
            "priority": -100, "chat_template": "{{ evil }}", "top_k": 5, "user": "u1"}
    out, removed = strip_client_fields(body)
    assert removed == ("api_base", "api_key", "base_url", "cache_salt", "chat_template",
                       "kv_transfer_params", "priority")
    assert out == {"model": "m", "messages": [], "top_k": 5, "user": "u1"}
    assert "api_base" in body  # input untouched


def test_strip_keeps_legitimate_vllm_extensions() -> None:
    body = {"model": "m", "prompt": "x", "top_k": 1, "min_p": 0.1, "guided_json": {},
            "chat_template_kwargs": {}, "stream_options": {"include_usage": True}}
    out, removed = strip_client_fields(body)
    assert out == body and removed == ()


def test_every_stripped_field_says_why() -> None:
    assert all(reason.strip() for reason in STRIPPED_FIELDS.values())
