"""Tenants in Redis: shared between instances, no plaintext stored, faults never break authentication."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio
import pytest
from pydantic import SecretStr
from redis.asyncio import Redis

from policies.settings import TenantSettings
from policies.errors import InvalidApiKey, StoreUnavailable, TenantsUnavailable
from policies.tenant_store import RedisTenantStore
from policies.tenants import TenantRegistry
from tests.support.redis_fixtures import client, pfx, redis_service  # noqa: F401 (fixtures)
from tests.support.redis_server import PrivateRedis

SECRET = "redis-test-secret"
KEY_A = "sk-config-acme-redis-0001"
pytestmark = pytest.mark.anyio


def config() -> list[TenantSettings]:
    return [TenantSettings(name="acme", api_keys=[SecretStr(KEY_A)])]






async def eventually(check: Callable[[], bool], within_s: float) -> float:
    """Seconds until ``check()`` held; fails after ``within_s``."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > within_s:
            raise AssertionError(f"condition not met within {within_s} s")
        await anyio.sleep(0.02)
    return time.monotonic() - start


def authenticates(reg: TenantRegistry, key: str, tenant: str | None) -> Callable[[], bool]:
    def check() -> bool:
        try:
            return reg.authenticate(key).name == tenant
        except InvalidApiKey:
            return tenant is None
    return check


async def dump(r: Redis, pfx: str) -> bytes:
    """Every byte stored under the prefix."""
    out = b""
    async for name in r.scan_iter(match="*" + pfx + "*"):  # "{pfx}…" on a cluster
        kind = await r.type(name)
        if kind == b"hash":
            out += b"".join(k + v for k, v in (await r.hgetall(name)).items())
        elif kind == b"set":
            out += b"".join(await r.smembers(name))
        elif kind == b"string":
            out += await r.get(name) or b""
    return out


async def test_redis_holds_digests_never_plaintext(redis_service: str, pfx: str) -> None:
    async with client(redis_service) as r:
        reg = TenantRegistry(config(), SECRET, RedisTenantStore(r, prefix=pfx))
        await reg.load()
        await reg.create_tenant({"name": "delta", "api_keys": ["sk-imported-0001"]})
        issued = await reg.add_key("delta")
        rotated = await reg.rotate_key("acme")
        stored = await dump(r, pfx)
        assert b"delta" in stored and len(stored) > 100
        for key in (KEY_A, "sk-imported-0001", issued.api_key, rotated.api_key):
            assert key.encode() not in stored
        assert reg.authenticate(rotated.api_key).name == "acme"


@asynccontextmanager
async def two_registries(url: str, pfx: str) -> AsyncIterator[tuple[TenantRegistry, TenantRegistry]]:
    """Two kvgate instances' registries on one Redis, each with its own connection, loaded."""
    async with client(url) as ra, client(url) as rb:
        a = TenantRegistry(config(), SECRET, RedisTenantStore(ra, prefix=pfx))
        b = TenantRegistry(config(), SECRET, RedisTenantStore(rb, prefix=pfx))
        await a.load()
        await b.load()
        yield a, b


async def test_two_instances_see_each_others_changes_within_a_second(redis_service: str, pfx: str) -> None:
    async with two_registries(redis_service, pfx) as (a, b):
        async with anyio.create_task_group() as tg:
            tg.start_soon(a.watch)
            tg.start_soon(b.watch)
            await a.create_tenant({"name": "delta", "requests_per_minute": 5})
            issued = await a.add_key("delta")
            assert await eventually(authenticates(b, issued.api_key, "delta"), 1.0) < 1.0
            await a.update_tenant("delta", {"requests_per_minute": 7})
            await eventually(lambda: getattr(b.tenant("delta"), "rpm", None) == 7, 1.0)
            rotated = await b.rotate_key("acme")  # a config tenant's key, changed on the other instance
            await eventually(authenticates(a, rotated.api_key, "acme"), 1.0)
            await eventually(authenticates(a, KEY_A, None), 1.0)
            await b.delete_tenant("delta")
            await eventually(authenticates(a, issued.api_key, None), 1.0)
            tg.cancel_scope.cancel()


async def test_changes_are_published_not_only_polled(redis_service: str, pfx: str) -> None:
    async with two_registries(redis_service, pfx) as (a, b):
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: b.watch(poll_s=10.0))  # a poll would take 10 s
            await anyio.sleep(0.2)  # subscribed
            issued = await a.add_key("acme")
            assert await eventually(authenticates(b, issued.api_key, "acme"), 0.5) < 0.5
            tg.cancel_scope.cancel()


async def test_a_revoked_config_key_stays_revoked_after_a_restart(redis_service: str, pfx: str) -> None:
    async with client(redis_service) as r:
        first = TenantRegistry(config(), SECRET, RedisTenantStore(r, prefix=pfx))
        await first.load()
        await first.revoke_key("acme", first.get_tenant("acme").keys[0].key_id)
        restarted = TenantRegistry(config(), SECRET, RedisTenantStore(r, prefix=pfx))
        await restarted.load()
        with pytest.raises(InvalidApiKey):
            restarted.authenticate(KEY_A)


async def test_redis_dying_never_breaks_authentication_of_loaded_tenants(private_redis: PrivateRedis) -> None:
    async with client(private_redis.url) as r:
        reg = TenantRegistry(config(), SECRET, RedisTenantStore(r, prefix="t:"))
        await reg.load()
        await reg.create_tenant({"name": "delta"})
        issued = await reg.add_key("delta")
        async with anyio.create_task_group() as tg:
            tg.start_soon(reg.watch)
            private_redis.stop()
            await eventually(lambda: reg.degraded, 3.0)
            assert reg.authenticate(issued.api_key).name == "delta"
            assert reg.authenticate(KEY_A).name == "acme"
            started = time.monotonic()
            with pytest.raises(StoreUnavailable):
                await reg.add_key("delta")
            assert time.monotonic() - started < 1.5
            tg.cancel_scope.cancel()


async def test_a_paused_redis_costs_changes_a_bounded_wait(private_redis: PrivateRedis) -> None:
    async with client(private_redis.url) as r:
        reg = TenantRegistry(config(), SECRET, RedisTenantStore(r, prefix="t:", timeout_s=0.2))
        await reg.load()
        await reg.create_tenant({"name": "delta"})
        issued = await reg.add_key("delta")
        with private_redis.paused():
            started = time.monotonic()
            with pytest.raises(StoreUnavailable):
                await reg.add_key("delta")
            assert time.monotonic() - started < 1.5
            assert reg.authenticate(issued.api_key).name == "delta"
        await reg.load()
        assert reg.authenticate(issued.api_key).name == "delta"


async def test_without_a_loaded_store_open_mode_fails_closed(private_redis: PrivateRedis) -> None:
    url = private_redis.url
    private_redis.stop()
    async with client(url) as r:
        unknown = TenantRegistry([], SECRET, RedisTenantStore(r, prefix="t:"))
        with pytest.raises(TenantsUnavailable) as err:
            unknown.authenticate(None)
        assert err.value.status == 503
        # tenants from the config file need no store to authenticate
        configured = TenantRegistry(config(), SECRET, RedisTenantStore(r, prefix="t:"))
        assert configured.authenticate(KEY_A).name == "acme"
        assert configured.degraded


async def test_watch_loads_once_redis_comes_back(private_redis: PrivateRedis) -> None:
    pfx = f"kvgate-test:{uuid.uuid4().hex[:8]}:"  # on the private Redis: removed with it
    async with client(private_redis.url) as seed:
        await TenantRegistry([], SECRET, RedisTenantStore(seed, prefix=pfx)).create_tenant({"name": "delta"})
    private_redis.pause()
    async with client(private_redis.url) as r:
        reg = TenantRegistry([], SECRET, RedisTenantStore(r, prefix=pfx, timeout_s=0.1, load_timeout_s=0.2))
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: reg.watch(backoff_s=0.1))
            await anyio.sleep(0.5)
            with pytest.raises(TenantsUnavailable):
                reg.authenticate(None)
            private_redis.resume()
            await eventually(lambda: reg.loaded, 3.0)
            assert reg.tenant("delta") is not None and not reg.open_mode
            tg.cancel_scope.cancel()

