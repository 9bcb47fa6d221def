"""Tenants and keys in memory: authentication, open mode, runtime changes, no plaintext anywhere."""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
import json
from collections import Counter
from typing import Any

import pytest
from pydantic import SecretStr

import policies.tenants as tenants_mod
from policies.settings import TenantSettings
from policies.errors import (
    InvalidApiKey,
    InvalidTenantSpec,
    KeyNotFound,
    MissingApiKey,
    TenantExists,
    TenantManagedByConfig,
    TenantNotFound,
)
from policies.tenant_store import MemoryTenantStore
from policies.tenants import DEFAULT_TENANT, TenantRegistry, allows_model

SECRET = "test-server-secret"
KEY_A = "sk-config-key-for-acme-0001"
KEY_B = "sk-config-key-for-beta-0002"


def settings() -> list[TenantSettings]:
    return [
        TenantSettings(name="acme", api_keys=[SecretStr(KEY_A)], models=["llama"], requests_per_minute=10),
        TenantSettings(name="beta", api_keys=[SecretStr(KEY_B)], namespace="shared"),
        TenantSettings(name="gamma", namespace="shared"),
    ]


def contains_text(obj: Any, needle: str, seen: set[int] | None = None) -> bool:
    """Walk an object graph (attributes, slots, containers) looking for ``needle`` in any string or bytes."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return False
    seen.add(id(obj))
    if isinstance(obj, str):
        return needle in obj
    if isinstance(obj, bytes):
        return needle.encode() in obj
    if isinstance(obj, SecretStr):
        return needle in obj.get_secret_value()
    if isinstance(obj, dict) or (hasattr(obj, "items") and callable(obj.items)):
        return any(contains_text(k, needle, seen) or contains_text(v, needle, seen) for k, v in obj.items())
    if isinstance(obj, (list, tuple, set, frozenset)):
        return any(contains_text(v, needle, seen) for v in obj)
    if isinstance(obj, (int, float, bool, type(None))) or (callable(obj) and not hasattr(obj, "__dict__")):
        return False
    fields = dict(getattr(obj, "__dict__", {}))
    for slot in getattr(type(obj), "__slots__", ()):
        if hasattr(obj, slot):
            fields[slot] = getattr(obj, slot)
    return any(contains_text(v, needle, seen) for v in fields.values())


def registry(**kw: Any) -> TenantRegistry:
    return TenantRegistry(settings(), SECRET, **kw)


def test_config_keys_authenticate_to_their_tenant() -> None:
    reg = registry()
    t = reg.authenticate(KEY_A)
    assert (t.name, t.namespace, t.rpm) == ("acme", "acme", 10)
    assert reg.authenticate(KEY_B).name == "beta"
    assert not reg.open_mode


def test_missing_malformed_and_unknown_keys_raise_typed_errors() -> None:
    reg = registry()
    with pytest.raises(MissingApiKey) as missing:
        reg.authenticate(None)
    assert (missing.value.status, missing.value.code) == (401, "missing_api_key")
    with pytest.raises(InvalidApiKey) as malformed:
        reg.authenticate("has a space")
    assert (malformed.value.code, malformed.value.reason) == ("invalid_api_key", "malformed")
    with pytest.raises(InvalidApiKey) as unknown:
        reg.authenticate("sk-kvg-not-a-real-key")
    assert (unknown.value.code, unknown.value.reason) == ("invalid_api_key", "unknown")
    # the client sees the same words for malformed and unknown, and never the key
    assert malformed.value.message == unknown.value.message
    assert "sk-kvg-not-a-real-key" not in str(unknown.value)


def test_every_path_hashes_once_and_compares_digests_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Missing, malformed, unknown and valid keys take the same steps (no early return)."""
    calls: Counter[str] = Counter()
    real_hash, real_compare = tenants_mod.hash_key, hmac.compare_digest

    def counting_hash(secret: bytes, key: str) -> bytes:
        calls["hash"] += 1
        return real_hash(secret, key)

    def counting_compare(a: bytes, b: bytes) -> bool:
        calls["compare"] += 1
        assert isinstance(a, bytes) and isinstance(b, bytes) and len(a) == len(b) == 32
        return real_compare(a, b)

    reg = registry()
    monkeypatch.setattr(tenants_mod, "hash_key", counting_hash)
    monkeypatch.setattr(tenants_mod.hmac, "compare_digest", counting_compare)
    for key in (None, "", "bad key", "x" * 1000, "sk-unknown", KEY_A):
        calls.clear()
        with contextlib.suppress(MissingApiKey, InvalidApiKey):
            reg.authenticate(key)
        assert calls == {"hash": 1, "compare": 1}, key


def test_open_mode_maps_everyone_to_the_default_tenant_until_a_tenant_exists() -> None:
    reg = TenantRegistry([], SECRET)
    assert reg.open_mode
    for key in (None, "", "sk-anything"):
        t = reg.authenticate(key)
        assert (t.name, t.namespace) == (DEFAULT_TENANT, "default")
    assert t.rpm is None and t.models is None


@pytest.mark.anyio
async def test_first_runtime_tenant_turns_authentication_on() -> None:
    reg = TenantRegistry([], SECRET)
    await reg.create_tenant({"name": "solo"})
    issued = await reg.add_key("solo")
    assert not reg.open_mode
    with pytest.raises(MissingApiKey):
        reg.authenticate(None)
    assert reg.authenticate(issued.api_key).name == "solo"


def test_namespaces_share_salts_only_when_configured_to() -> None:
    reg = registry()
    acme, beta, gamma = (reg.tenant(n) for n in ("acme", "beta", "gamma"))
    assert acme and beta and gamma
    assert beta.cache_salt == gamma.cache_salt
    assert acme.cache_salt != beta.cache_salt
    other = TenantRegistry(settings(), "other-secret").tenant("acme")
    assert other is not None and other.cache_salt != acme.cache_salt


def test_allows_model() -> None:
    reg = registry()
    acme, beta = reg.tenant("acme"), reg.tenant("beta")
    assert acme and beta
    assert allows_model(acme, "llama") and not allows_model(acme, "mistral")
    assert allows_model(beta, "anything")


@pytest.mark.anyio
async def test_no_plaintext_key_is_kept_anywhere() -> None:
    store = MemoryTenantStore()
    reg = registry(store=store)
    await reg.create_tenant({"name": "delta"})
    issued = await reg.add_key("delta")
    rotated = await reg.rotate_key("acme")
    for key in (KEY_A, KEY_B, issued.api_key, rotated.api_key):
        assert not contains_text(reg.__dict__, key), "registry holds a plaintext key"
        assert not contains_text(store, key), "store holds a plaintext key"
    assert issued.api_key not in repr(issued)


@pytest.mark.anyio
async def test_rotate_issues_a_new_key_once_and_revokes_the_old() -> None:
    reg = registry()
    rotated = await reg.rotate_key("acme")
    assert rotated.api_key.startswith("sk-kvg-") and len(rotated.key_id) == 12
    assert reg.authenticate(rotated.api_key).name == "acme"
    with pytest.raises(InvalidApiKey):
        reg.authenticate(KEY_A)
    info = reg.get_tenant("acme")
    assert [k.key_id for k in info.keys] == [rotated.key_id]


@pytest.mark.anyio
async def test_add_then_revoke_rotates_without_downtime() -> None:
    reg = registry()
    new = await reg.add_key("beta")
    assert reg.authenticate(KEY_B).name == reg.authenticate(new.api_key).name == "beta"
    old_id = next(k.key_id for k in reg.get_tenant("beta").keys if k.source == "config")
    await reg.revoke_key("beta", old_id)
    with pytest.raises(InvalidApiKey):
        reg.authenticate(KEY_B)
    assert reg.authenticate(new.api_key).name == "beta"
    with pytest.raises(KeyNotFound):
        await reg.revoke_key("beta", old_id)


@pytest.mark.anyio
async def test_runtime_tenant_lifecycle() -> None:
    reg = registry()
    info = await reg.create_tenant({"name": "delta", "requests_per_minute": 5, "models": ["llama"]})
    assert (info.source, info.settings["requests_per_minute"], info.keys) == ("runtime", 5, ())
    with pytest.raises(TenantExists):
        await reg.create_tenant({"name": "delta"})
    key = await reg.add_key("delta")
    updated = await reg.update_tenant("delta", {"requests_per_minute": 50})
    assert updated.settings["requests_per_minute"] == 50
    assert reg.authenticate(key.api_key).rpm == 50
    await reg.delete_tenant("delta")
    with pytest.raises(InvalidApiKey):
        reg.authenticate(key.api_key)
    with pytest.raises(TenantNotFound):
        await reg.add_key("delta")


@pytest.mark.anyio
async def test_config_tenants_are_changed_in_the_config_file_only() -> None:
    reg = registry()
    with pytest.raises(TenantManagedByConfig):
        await reg.update_tenant("acme", {"requests_per_minute": 1})
    with pytest.raises(TenantManagedByConfig):
        await reg.delete_tenant("acme")
    with pytest.raises(TenantExists):
        await reg.create_tenant({"name": "acme"})


@pytest.mark.anyio
async def test_invalid_specs_name_the_field_but_never_echo_a_key() -> None:
    reg = registry()
    with pytest.raises(InvalidTenantSpec) as err:
        await reg.create_tenant({"name": "bad name!", "api_keys": ["sk-secret-value-123"]})
    assert "name" in err.value.message and "sk-secret-value-123" not in err.value.message
    with pytest.raises(InvalidTenantSpec):
        await reg.create_tenant({"name": "ok", "unknown_field": 1})
    await reg.create_tenant({"name": "ok"})
    with pytest.raises(InvalidTenantSpec):
        await reg.update_tenant("ok", {"name": "renamed"})
    with pytest.raises(InvalidTenantSpec):
        await reg.create_tenant({"name": "dup", "api_keys": [KEY_A]})  # already in use


@pytest.mark.anyio
async def test_listing_shows_key_ids_never_key_material() -> None:
    reg = registry()
    issued = await reg.add_key("gamma")
    listed = json.dumps([t.to_dict() for t in reg.list_tenants()])
    assert [t.settings["name"] for t in reg.list_tenants()] == ["acme", "beta", "gamma"]
    assert issued.key_id in listed
    assert issued.api_key not in listed and KEY_A not in listed
    digest = tenants_mod.hash_key(tenants_mod.derive_hash_key(SECRET), issued.api_key).hex()
    assert digest not in listed  # only the short handle
    gamma = reg.get_tenant("gamma").to_dict()
    assert gamma["keys"][0]["created_at"] is not None and gamma["source"] == "config"


@pytest.mark.anyio
async def test_imported_keys_are_hashed() -> None:
    reg = registry()
    await reg.create_tenant({"name": "imported", "api_keys": ["sk-imported-key-000"]})
    assert reg.authenticate("sk-imported-key-000").name == "imported"
    assert not contains_text(reg.__dict__, "sk-imported-key-000")


def test_a_malformed_config_key_fails_start_up() -> None:
    with pytest.raises(ValueError, match="printable ASCII"):
        TenantRegistry([TenantSettings(name="x", api_keys=[SecretStr("has space")])], SECRET)


def test_tenant_is_frozen_and_hides_its_salt_from_repr() -> None:
    t = registry().tenant("acme")
    assert t is not None
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.name = "other"  # type: ignore[misc]
    assert t.cache_salt not in repr(t)
