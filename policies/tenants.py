"""Tenants and their API keys: who is calling, in constant time, from memory.

Two sources make up the tenant set:
  * the configuration file (``Settings.tenants``): rebuilt on every start; the
    file is the truth for these tenants, so the runtime API refuses to update
    or delete them (``TenantManagedByConfig``). It may still add, rotate and
    revoke their keys: a leaked key must be revocable without a deploy, and
    revoking a config key records its digest, so it stays revoked across
    restarts until removed from the file.
  * the runtime store (``tenant_store``): tenants and keys created through the
    admin API, shared by every instance through Redis.

``authenticate`` never touches the store: it reads an immutable index that is
swapped whole on every change, so a Redis fault can delay changes but never
fail the authentication of tenants already loaded.

Open mode: with no tenant anywhere, every request is the ``default`` tenant,
key or no key (SDKs insist on sending some key). The first tenant created
turns authentication on for everyone. If a store is configured but has never
loaded and the file defines no tenants, we cannot know whether tenants exist,
so we fail closed (``TenantsUnavailable``) rather than open.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio
from pydantic import ValidationError

from .errors import (
    InvalidApiKey,
    InvalidTenantSpec,
    KeyNotFound,
    MissingApiKey,
    StoreUnavailable,
    TenantExists,
    TenantManagedByConfig,
    TenantNotFound,
    TenantsUnavailable,
)
from .keys import derive_hash_key, generate_key, hash_key, is_well_formed, key_id
from .salt import cache_salt
from .settings import TenantSettings
from .tenant_store import Change, KeyRecord, MemoryTenantStore, Snapshot, TenantStore, apply_change

DEFAULT_TENANT = "default"
Source = Literal["config", "runtime"]
_TIMING_DUMMY = "kvgate-timing-dummy-key"


@dataclass(frozen=True, slots=True)
class Tenant:
    """What the hot path needs to know about a caller. Holds no key material."""

    name: str
    namespace: str
    cache_salt: str = field(repr=False)
    models: frozenset[str] | None = None  # allowed models; None = all
    semantic_cache: bool = True
    rpm: int | None = None
    tpm: int | None = None
    normalize_tools: bool = False
    sort_tools: bool = False
    prompt_hygiene: bool = True
    priority: str = "standard"  # policies.priority's class
    weight: float = 1.0
    queue_timeout_s: float = 30.0


def tenant_from_settings(s: TenantSettings, secret: str | bytes) -> Tenant:
    namespace = s.cache_namespace
    return Tenant(
        name=s.name, namespace=namespace, cache_salt=cache_salt(namespace, secret),
        models=frozenset(s.models) if s.models is not None else None,
        semantic_cache=s.semantic_cache, rpm=s.requests_per_minute, tpm=s.tokens_per_minute,
        normalize_tools=s.normalize_tools, sort_tools=s.sort_tools, prompt_hygiene=s.prompt_hygiene,
        priority=s.priority, weight=s.weight, queue_timeout_s=s.queue_timeout_s,
    )


def allows_model(tenant: Tenant, model: str) -> bool:
    return tenant.models is None or model in tenant.models


@dataclass(frozen=True, slots=True)
class KeyInfo:
    key_id: str
    created_at: float | None
    source: Source


@dataclass(frozen=True)
class TenantInfo:
    """The admin view of a tenant: settings and key handles, never key material."""

    settings: Mapping[str, Any]
    source: Source
    keys: tuple[KeyInfo, ...]

    def to_dict(self) -> dict[str, Any]:
        keys = [{"key_id": k.key_id, "created_at": k.created_at, "source": k.source} for k in self.keys]
        return {**self.settings, "source": self.source, "keys": keys}


@dataclass(frozen=True, slots=True)
class IssuedKey:
    """A key just created. ``api_key`` is shown to the caller once and is kept nowhere."""

    tenant: str
    key_id: str
    created_at: float
    api_key: str = field(repr=False)


@dataclass(frozen=True)
class _Index:
    tenants: Mapping[str, Tenant]
    sources: Mapping[str, Source]
    specs: Mapping[str, Mapping[str, Any]]
    keys: Mapping[bytes, KeyRecord]  # digest -> record
    by_tenant: Mapping[str, tuple[KeyRecord, ...]]

    @property
    def open_mode(self) -> bool:
        return not self.tenants


def _spec(s: TenantSettings) -> dict[str, Any]:
    return s.model_dump(mode="json", exclude={"api_keys"})


def _validate(spec: Mapping[str, Any]) -> TenantSettings:
    try:
        return TenantSettings.model_validate(dict(spec))
    except ValidationError as e:
        # Field names and pydantic's messages only: never input values (they may hold keys).
        msg = "; ".join(f"{'.'.join(str(p) for p in err['loc']) or 'tenant'}: {err['msg']}"
                        for err in e.errors())
        raise InvalidTenantSpec(msg) from None


class TenantRegistry:
    def __init__(self, tenants: Sequence[TenantSettings], secret: str | bytes,
                 store: TenantStore | None = None, *, clock: Callable[[], float] = time.time) -> None:
        self._secret = secret
        self._hash_secret = derive_hash_key(secret)
        self._dummy_digest = hash_key(self._hash_secret, _TIMING_DUMMY)
        self._clock = clock
        self._store: TenantStore = store if store is not None else MemoryTenantStore()
        self._config_keys = self._hash_config_keys(tenants)
        # Kept without their keys: the registry holds digests only.
        self._config_settings = tuple(t.model_copy(update={"api_keys": []}) for t in tenants)
        self._default = Tenant(DEFAULT_TENANT, DEFAULT_TENANT, cache_salt(DEFAULT_TENANT, secret))
        # An in-memory store has nothing to load; a shared one must load before we may run open.
        self._loaded = store is None or isinstance(store, MemoryTenantStore)
        self._store_ok = True
        self._seen_version = -1
        self._snapshot = Snapshot()
        self._index = self._build(self._snapshot)

    def _hash_config_keys(self, tenants: Sequence[TenantSettings]) -> tuple[KeyRecord, ...]:
        records = []
        for t in tenants:
            for secret_key in t.api_keys:
                plain = secret_key.get_secret_value()
                if not is_well_formed(plain):
                    raise ValueError(f"tenants.{t.name}.api_keys: a key must be 1-256 printable ASCII "
                                     "characters without spaces")
                digest = hash_key(self._hash_secret, plain).hex()
                records.append(KeyRecord(digest, t.name, None, "config"))
        return tuple(records)

    # -- the hot path ---------------------------------------------------------
    @property
    def open_mode(self) -> bool:
        return self._index.open_mode

    @property
    def loaded(self) -> bool:
        """True once the store has been read at least once (always, without a shared store)."""
        return self._loaded

    @property
    def degraded(self) -> bool:
        """True while the store is unreachable: changes from other instances are not arriving."""
        return not (self._loaded and self._store_ok)

    def authenticate(self, key: str | None) -> Tenant:
        """The tenant owning ``key`` (from ``keys.extract_api_key``), or a typed AuthError.

        Missing, malformed and unknown keys all hash a key and compare digests,
        so their timing does not reveal which keys exist. The dict lookup is
        keyed by an HMAC under our secret, so its timing carries no usable
        information about stored keys either.
        """
        idx = self._index
        if idx.open_mode:
            if not self._loaded:
                raise TenantsUnavailable()
            return self._default
        well_formed = key is not None and is_well_formed(key)
        presented = key if well_formed and key is not None else _TIMING_DUMMY
        digest = hash_key(self._hash_secret, presented)
        record = idx.keys.get(digest)
        expected = bytes.fromhex(record.digest) if record is not None else self._dummy_digest
        matched = hmac.compare_digest(digest, expected)
        if key is None:
            raise MissingApiKey()
        if not well_formed:
            raise InvalidApiKey("malformed")
        if record is None or not matched:
            raise InvalidApiKey("unknown")
        return idx.tenants[record.tenant]

    def tenant(self, name: str) -> Tenant | None:
        return self._index.tenants.get(name)

    def default_tenant(self) -> Tenant | None:
        """The tenant of a request without a key: there is one only while no tenant is configured."""
        return self._default if self._index.open_mode else None

    # -- building the index ---------------------------------------------------
    def _build(self, snap: Snapshot) -> _Index:
        tenants: dict[str, Tenant] = {}
        sources: dict[str, Source] = {}
        specs: dict[str, Mapping[str, Any]] = {}
        known = TenantSettings.model_fields
        for name, raw in snap.tenants.items():
            try:
                # Unknown fields dropped: a newer instance may write fields we do not know yet.
                s = _validate({k: v for k, v in raw.items() if k in known})
            except InvalidTenantSpec:
                continue  # a corrupt store entry must not take the others down
            if s.name == name:
                tenants[name] = tenant_from_settings(s, self._secret)
                sources[name], specs[name] = "runtime", _spec(s)
        for s in self._config_settings:  # the file wins over a runtime tenant of the same name
            tenants[s.name], sources[s.name], specs[s.name] = (
                tenant_from_settings(s, self._secret), "config", _spec(s))
        keys: dict[bytes, KeyRecord] = {}
        for rec in self._config_keys:
            if rec.digest not in snap.revoked:
                keys[bytes.fromhex(rec.digest)] = rec
        for rec in snap.keys.values():
            if rec.tenant in tenants:
                keys[bytes.fromhex(rec.digest)] = rec
        by_tenant: dict[str, list[KeyRecord]] = {}
        for rec in keys.values():
            by_tenant.setdefault(rec.tenant, []).append(rec)
        return _Index(tenants, sources, specs, keys, {t: tuple(r) for t, r in by_tenant.items()})

    def _set_snapshot(self, snap: Snapshot) -> None:
        self._snapshot = snap
        self._index = self._build(snap)  # one reference swap: readers see old or new, never half

    # -- keeping up with the store --------------------------------------------
    async def load(self) -> None:
        """Read the whole store now. Raises StoreUnavailable (the current index stays)."""
        try:
            snap = await self._store.load()
        except StoreUnavailable:
            self._store_ok = False
            raise
        self._set_snapshot(snap)
        self._seen_version = snap.version
        self._loaded = self._store_ok = True

    async def watch(self, *, poll_s: float = 0.25, backoff_s: float = 1.0) -> None:
        """Run forever (in the lifespan task group): reload whenever the store changes.

        Wakes on the store's change notification and polls its version every
        ``poll_s``, so other instances' changes arrive within about ``poll_s``.
        Store faults are absorbed: the loop backs off and retries.
        """
        while True:
            try:
                if not self._loaded or await self._store.version() != self._seen_version:
                    await self.load()
                self._store_ok = True
                await self._store.wait_change(poll_s)
            except StoreUnavailable:
                self._store_ok = False
                await anyio.sleep(backoff_s)

    async def _commit(self, change: Change) -> bool:
        if not self._loaded:
            await self.load()  # never base a change on a view we know is incomplete
        try:
            ok = await self._store.commit(change)
        except StoreUnavailable:
            self._store_ok = False
            raise
        if ok:
            new = apply_change(self._snapshot, change)
            if new is not None:  # else our view is stale; the watcher reloads it
                self._set_snapshot(new)
        return ok

    # -- the admin API ----------------------------------------------------------
    def list_tenants(self) -> list[TenantInfo]:
        return [self._info(name) for name in sorted(self._index.tenants)]

    def get_tenant(self, name: str) -> TenantInfo:
        if name not in self._index.tenants:
            raise TenantNotFound(name)
        return self._info(name)

    def _info(self, name: str) -> TenantInfo:
        idx = self._index
        keys = sorted((KeyInfo(r.key_id, r.created_at, r.source) for r in idx.by_tenant.get(name, ())),
                      key=lambda k: (k.created_at or 0.0, k.key_id))
        return TenantInfo(dict(idx.specs[name]), idx.sources[name], tuple(keys))

    def _runtime_tenant(self, name: str) -> None:
        source = self._index.sources.get(name)
        if source is None:
            raise TenantNotFound(name)
        if source == "config":
            raise TenantManagedByConfig(name)

    async def create_tenant(self, spec: TenantSettings | Mapping[str, Any]) -> TenantInfo:
        """Create a runtime tenant. Keys given in ``api_keys`` are imported (hashed)."""
        s = _validate(spec) if isinstance(spec, Mapping) else spec
        if s.name in self._index.tenants:
            raise TenantExists(s.name)
        if any(not is_well_formed(k.get_secret_value()) for k in s.api_keys):
            raise InvalidTenantSpec("api_keys: a key must be 1-256 printable ASCII characters without spaces")
        now = self._clock()
        imported = tuple(KeyRecord(hash_key(self._hash_secret, k.get_secret_value()).hex(), s.name, now)
                         for k in s.api_keys)
        if any(bytes.fromhex(r.digest) in self._index.keys for r in imported):
            raise InvalidTenantSpec("api_keys: a key is already in use")
        if not await self._commit(Change(put_tenants={s.name: _spec(s)}, create=True, put_keys=imported)):
            raise TenantExists(s.name)
        return self.get_tenant(s.name)

    async def update_tenant(self, name: str, changes: Mapping[str, Any]) -> TenantInfo:
        """Change a runtime tenant's settings (not its name; keys have their own calls)."""
        self._runtime_tenant(name)
        if "name" in changes and changes["name"] != name:
            raise InvalidTenantSpec("name: a tenant cannot be renamed; create a new one")
        if "api_keys" in changes:
            raise InvalidTenantSpec("api_keys: use add_key / rotate_key / revoke_key")
        s = _validate({**self._index.specs[name], **changes})
        if not await self._commit(Change(put_tenants={name: _spec(s)}, require=(name,))):
            raise TenantNotFound(name)
        return self.get_tenant(name)

    async def delete_tenant(self, name: str) -> None:
        self._runtime_tenant(name)
        if not await self._commit(Change(del_tenants=(name,), require=(name,))):
            raise TenantNotFound(name)

    def _keys_of(self, name: str, kid: str | None) -> list[KeyRecord]:
        if name not in self._index.tenants:
            raise TenantNotFound(name)
        found = [r for r in self._index.by_tenant.get(name, ()) if kid is None or r.key_id == kid]
        if kid is not None and not found:
            raise KeyNotFound(kid)
        return found

    def _new_key(self, name: str) -> tuple[IssuedKey, KeyRecord]:
        taken = {r.key_id for r in self._index.by_tenant.get(name, ())}
        while True:  # a 48-bit handle collides with a tenant's few keys about never; check anyway
            plain = generate_key()
            digest = hash_key(self._hash_secret, plain).hex()
            if key_id(digest) not in taken:
                now = self._clock()
                return IssuedKey(name, key_id(digest), now, plain), KeyRecord(digest, name, now)

    async def _replace_keys(self, name: str, old: Sequence[KeyRecord], new: KeyRecord | None) -> None:
        require = (name,) if self._index.sources.get(name) == "runtime" else ()
        change = Change(require=require, put_keys=(new,) if new else (),
                        del_keys=tuple(r.digest for r in old if r.source == "runtime"),
                        revoke=tuple(r.digest for r in old if r.source == "config"))
        if not await self._commit(change):
            raise TenantNotFound(name)

    async def add_key(self, name: str) -> IssuedKey:
        """Issue a new key; the plaintext is in the result and nowhere else."""
        self._keys_of(name, None)
        issued, record = self._new_key(name)
        await self._replace_keys(name, (), record)
        return issued

    async def rotate_key(self, name: str, kid: str | None = None) -> IssuedKey:
        """Issue a new key and revoke ``kid`` (or every key of the tenant) in one atomic change.

        For a rotation without downtime, ``add_key`` first and ``revoke_key`` once clients moved.
        """
        old = self._keys_of(name, kid)
        issued, record = self._new_key(name)
        await self._replace_keys(name, old, record)
        return issued

    async def revoke_key(self, name: str, kid: str) -> None:
        await self._replace_keys(name, self._keys_of(name, kid), None)


__all__ = ["DEFAULT_TENANT", "IssuedKey", "KeyInfo", "StoreUnavailable", "Tenant", "TenantInfo",
           "TenantRegistry", "allows_model", "tenant_from_settings"]
