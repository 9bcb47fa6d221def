"""API keys: format, hashing, where a client may put one, and keys in URLs."""

from __future__ import annotations

import re

from policies.keys import (
    derive_hash_key,
    extract_api_key,
    generate_key,
    hash_key,
    is_well_formed,
    key_id,
    query_has_api_key,
    redact_query,
)


def test_generated_keys_have_the_documented_shape_and_are_unique() -> None:
    keys = {generate_key() for _ in range(200)}
    assert len(keys) == 200
    assert all(re.fullmatch(r"sk-kvg-[A-Za-z0-9_-]{43}", k) for k in keys)


def test_hash_is_an_hmac_under_the_server_secret() -> None:
    a, b = derive_hash_key("secret-a"), derive_hash_key("secret-b")
    assert hash_key(a, "sk-1") == hash_key(a, "sk-1")
    assert hash_key(a, "sk-1") != hash_key(b, "sk-1")
    assert hash_key(a, "sk-1") != hash_key(a, "sk-2")
    assert len(hash_key(a, "sk-1")) == 32
    assert key_id(hash_key(a, "sk-1")) == hash_key(a, "sk-1").hex()[:12]


def test_bearer_header_in_any_case() -> None:
    assert extract_api_key({"authorization": "Bearer sk-abc"}) == "sk-abc"
    assert extract_api_key({"Authorization": "bearer   sk-abc  "}) == "sk-abc"
    assert extract_api_key([("AUTHORIZATION", "BEARER sk-abc")]) == "sk-abc"


def test_azure_and_x_api_key_headers_are_accepted() -> None:
    assert extract_api_key({"api-key": "sk-abc"}) == "sk-abc"
    assert extract_api_key({"x-api-key": "sk-abc"}) == "sk-abc"
    # the same key twice is not ambiguous
    assert extract_api_key({"authorization": "Bearer sk-abc", "x-api-key": "sk-abc"}) == "sk-abc"
    assert extract_api_key({"authorization": "Bearer sk-abc", "api-key": ""}) == "sk-abc"


def test_no_credential_header_is_missing_not_malformed() -> None:
    assert extract_api_key({}) is None
    assert extract_api_key({"content-type": "application/json"}) is None


def test_unusable_credentials_are_malformed() -> None:
    assert extract_api_key({"authorization": "Basic dXNlcjpwYXNz"}) == ""
    assert extract_api_key({"authorization": "Bearer"}) == ""
    assert extract_api_key({"authorization": "Bearer a b"}) == ""
    # two different keys: ambiguous, refuse rather than guess
    assert extract_api_key({"authorization": "Bearer sk-a", "x-api-key": "sk-b"}) == ""
    assert extract_api_key([("authorization", "Bearer sk-a"), ("authorization", "Bearer sk-b")]) == ""


def test_well_formed_keys() -> None:
    assert is_well_formed("sk-kvg-abc")
    assert not is_well_formed("")
    assert not is_well_formed("has space")
    assert not is_well_formed("naïve")
    assert not is_well_formed("x" * 257)


def test_keys_in_the_query_string_are_detected() -> None:
    assert query_has_api_key("api_key=sk-abc")
    assert query_has_api_key(b"model=x&KEY=sk-abc")
    assert query_has_api_key("api%5Fkey=sk-abc")  # percent-encoded name
    assert query_has_api_key("access_token=abc&x=1")
    assert not query_has_api_key("")
    assert not query_has_api_key(None)
    assert not query_has_api_key("model=gpt&stream=true&keyboard=1")


def test_redact_query_hides_only_credential_values() -> None:
    assert redact_query("a=1&api_key=sk-secret&b=2") == "a=1&api_key=REDACTED&b=2"
    assert "sk-secret" not in redact_query(b"api%5Fkey=sk-secret")
