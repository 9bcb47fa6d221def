"""Where runtime tenant changes live: an in-memory store, or Redis shared by every instance.

The store holds only what the admin API changed at runtime; tenants from the
configuration file are rebuilt from it on every start (see ``tenants``):

    tenants   runtime tenant specs (JSON of ``TenantSettings`` without keys)
    keys      runtime API keys: HMAC digest (hex) -> {tenant, created_at}; never plaintext
    revoked   digests of configuration-file keys revoked at runtime
    version   bumped by every change, so other instances know to reload

A change is one ``Change`` value applied atomically (one Lua script in Redis,
``apply_change`` in memory; the two implement the same rules, and the registry
also uses ``apply_change`` to see its own change at once). The Redis store
publishes the new version on a channel; the registry's watcher wakes on it and
also polls the version, so a lost message delays a reload by one poll, never
forever.

Redis contents are trusted: anyone who can write them can add keys. Reads are
validated so corrupt entries are skipped, never crash a reload.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import anyio
from redis.asyncio import Redis, RedisCluster
from redis.asyncio.client import PubSub
from redis.exceptions import RedisClusterException, RedisError

from .errors import StoreUnavailable
from .keys import key_id

_FAULTS = (RedisError, RedisClusterException, OSError, TimeoutError)
_DIGEST = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True, slots=True)
class KeyRecord:
    digest: str  # hex HMAC-SHA256 of the key
    tenant: str
    created_at: float | None
    source: Literal["config", "runtime"] = "runtime"

    @property
    def key_id(self) -> str:
        return key_id(self.digest)


@dataclass(frozen=True)
class Snapshot:
    version: int = 0
    tenants: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    keys: Mapping[str, KeyRecord] = field(default_factory=dict)
    revoked: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Change:
    """One atomic change. Preconditions first; if one fails nothing is applied."""

    put_tenants: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    create: bool = False  # every name in put_tenants must be absent
    require: tuple[str, ...] = ()  # runtime tenants that must exist
    del_tenants: tuple[str, ...] = ()  # also deletes their keys
    put_keys: tuple[KeyRecord, ...] = ()
    del_keys: tuple[str, ...] = ()  # digests of runtime keys
    revoke: tuple[str, ...] = ()  # digests of config keys

    def to_json(self) -> str:
        return json.dumps({
            "put_tenants": [[n, json.dumps(dict(s), sort_keys=True)] for n, s in self.put_tenants.items()],
            "create": self.create,
            "require": list(self.require),
            "del_tenants": list(self.del_tenants),
            "put_keys": [[k.digest, _key_json(k)] for k in self.put_keys],
            "del_keys": list(self.del_keys),
            "revoke": list(self.revoke),
        })


def _key_json(k: KeyRecord) -> str:
    return json.dumps({"tenant": k.tenant, "created_at": k.created_at})


def apply_change(snap: Snapshot, change: Change) -> Snapshot | None:
    """The snapshot after ``change``, or None when a precondition fails. Pure."""
    if any(n not in snap.tenants for n in change.require):
        return None
    if change.create and any(n in snap.tenants for n in change.put_tenants):
        return None
    tenants = {**snap.tenants, **{n: dict(s) for n, s in change.put_tenants.items()}}
    keys = dict(snap.keys)
    for name in change.del_tenants:
        tenants.pop(name, None)
        keys = {d: k for d, k in keys.items() if k.tenant != name}
    keys.update({k.digest: k for k in change.put_keys})
    for digest in change.del_keys:
        keys.pop(digest, None)
    return Snapshot(snap.version + 1, tenants, keys, snap.revoked | frozenset(change.revoke))


class TenantStore(Protocol):
    async def load(self) -> Snapshot: ...

    async def commit(self, change: Change) -> bool:
        """Apply atomically; False when a precondition failed. Raises StoreUnavailable."""
        ...

    async def version(self) -> int: ...

    async def wait_change(self, timeout_s: float) -> None:
        """Return when another writer may have changed the store, or after ``timeout_s``."""
        ...


class MemoryTenantStore:
    """One process's store; registries sharing an instance see each other's changes."""

    def __init__(self) -> None:
        self._snap = Snapshot()

    async def load(self) -> Snapshot:
        return self._snap

    async def commit(self, change: Change) -> bool:
        new = apply_change(self._snap, change)
        if new is None:
            return False
        self._snap = new
        return True

    async def version(self) -> int:
        return self._snap.version

    async def wait_change(self, timeout_s: float) -> None:
        await anyio.sleep(timeout_s)


_COMMIT_LUA = """
local c = cjson.decode(ARGV[1])
for _, n in ipairs(c.require) do
  if redis.call('HEXISTS', KEYS[1], n) == 0 then return 0 end
end
if c.create then
  for _, t in ipairs(c.put_tenants) do
    if redis.call('HEXISTS', KEYS[1], t[1]) == 1 then return 0 end
  end
end
for _, t in ipairs(c.put_tenants) do redis.call('HSET', KEYS[1], t[1], t[2]) end
for _, n in ipairs(c.del_tenants) do
  redis.call('HDEL', KEYS[1], n)
  local all = redis.call('HGETALL', KEYS[2])
  for i = 1, #all, 2 do
    local ok, rec = pcall(cjson.decode, all[i + 1])
    if (not ok) or rec.tenant == n then redis.call('HDEL', KEYS[2], all[i]) end
  end
end
for _, k in ipairs(c.put_keys) do redis.call('HSET', KEYS[2], k[1], k[2]) end
for _, d in ipairs(c.del_keys) do redis.call('HDEL', KEYS[2], d) end
for _, d in ipairs(c.revoke) do redis.call('SADD', KEYS[3], d) end
local v = redis.call('INCR', KEYS[4])
redis.call('PUBLISH', ARGV[2], v)
return 1
"""


def cluster_prefix(prefix: str) -> str:
    """``prefix`` as a hash tag, so every key under it lands in one cluster slot
    (``kvgate:tenants:`` -> ``{kvgate:tenants:}``); a prefix with a tag is kept."""
    return prefix if "{" in prefix else "{" + prefix + "}"


_LOAD_LUA = """
return {redis.call('GET', KEYS[4]) or false, redis.call('HGETALL', KEYS[1]), redis.call('HGETALL', KEYS[2]),
        redis.call('SMEMBERS', KEYS[3])}
"""


class RedisTenantStore:
    """Runtime tenants in Redis, under ``prefix``; every call bounded by a deadline.

    ``redis`` is the shared client from the gateway's lifespan (give it a short
    socket timeout); this class adds its own deadline on top, because a paused
    Redis must cost at most ``timeout_s`` whatever the client's retry settings.

    On a Redis Cluster (``redis`` is a ``RedisCluster``) the four keys share one
    hash slot (``{kvgate:tenants:}tenants`` …), as the commit script and the load
    transaction need; the change channel is cluster-wide (PUBLISH reaches every
    node), so the subscription may sit on any node.
    """

    def __init__(self, redis: Redis | RedisCluster, *, prefix: str = "kvgate:tenants:", timeout_s: float = 0.25,
                 load_timeout_s: float = 2.0) -> None:
        self._redis = redis
        self._timeout_s = timeout_s
        self._load_timeout_s = load_timeout_s
        keys = cluster_prefix(prefix) if isinstance(redis, RedisCluster) else prefix
        self._names = [keys + s for s in ("tenants", "keys", "revoked", "version")]
        self._channel = prefix + "changed"
        self._commit = redis.register_script(_COMMIT_LUA)
        self._load = redis.register_script(_LOAD_LUA)
        self._pubsub: PubSub | None = None

    async def load(self) -> Snapshot:
        try:
            with anyio.fail_after(self._load_timeout_s):
                # One read-only script, atomic like the MULTI it replaces (redis-py's cluster
                # MULTI breaks on reply callbacks, and a script works the same on both).
                version, tenants, keys, revoked = await self._load(keys=self._names)
        except _FAULTS:
            raise StoreUnavailable() from None
        tenants, keys = _pairs(tenants), _pairs(keys)
        return Snapshot(int(version or 0), _parse_tenants(tenants), _parse_keys(keys),
                        frozenset(_text(d) for d in revoked))

    async def commit(self, change: Change) -> bool:
        try:
            with anyio.fail_after(self._timeout_s * 4):
                result = await self._commit(keys=self._names, args=[change.to_json(), self._channel])
        except _FAULTS:
            raise StoreUnavailable() from None
        return bool(result)

    async def version(self) -> int:
        try:
            with anyio.fail_after(self._timeout_s):
                return int(await self._redis.get(self._names[3]) or 0)
        except _FAULTS:
            raise StoreUnavailable() from None

    async def wait_change(self, timeout_s: float) -> None:
        try:
            if self._pubsub is None:
                pubsub = self._redis.pubsub()
                self._pubsub = pubsub
                with anyio.fail_after(self._timeout_s):
                    await pubsub.subscribe(self._channel)
            with anyio.fail_after(timeout_s + self._timeout_s):
                await self._pubsub.get_message(ignore_subscribe_messages=True, timeout=timeout_s)
        except _FAULTS:
            await self.close()
            raise StoreUnavailable() from None

    async def close(self) -> None:
        pubsub, self._pubsub = self._pubsub, None
        if pubsub is not None:
            # The connection may already be gone; there is nothing else to release.
            with anyio.move_on_after(self._timeout_s), contextlib.suppress(*_FAULTS):
                await pubsub.aclose()


def _pairs(flat: list[Any]) -> dict[Any, Any]:
    return dict(zip(flat[::2], flat[1::2]))


def _text(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


def _parse_tenants(raw: Mapping[Any, Any]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name, blob in raw.items():
        try:
            spec = json.loads(blob)
        except ValueError:
            continue
        if isinstance(spec, dict):
            out[_text(name)] = spec
    return out


def _parse_keys(raw: Mapping[Any, Any]) -> dict[str, KeyRecord]:
    out: dict[str, KeyRecord] = {}
    for raw_digest, blob in raw.items():
        digest = _text(raw_digest)
        if _DIGEST.fullmatch(digest) is None:
            continue
        try:
            rec = json.loads(blob)
            created = rec.get("created_at")
            created_at = float(created) if created is not None else None
            out[digest] = KeyRecord(digest, str(rec["tenant"]), created_at)
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
    return out
