"""Rate limits: the sliding-window arithmetic, shared limits in Redis, and the local fallback."""

from __future__ import annotations

import time
import uuid

import anyio
import pytest

from policies.settings import TenantSettings
from policies.ratelimit import UNLIMITED, RateLimiter
from policies.tenants import Tenant, tenant_from_settings
from policies.window import Counter, admit, estimate, retry_after, roll, wait_s
from tests.support.redis_fixtures import SHARED_TIMEOUT_S, client, pfx, redis_service  # noqa: F401 (fixtures)
from tests.support.redis_server import PrivateRedis


def tenant(rpm: int | None = None, tpm: int | None = None, name: str | None = None) -> Tenant:
    name = name or f"t{uuid.uuid4().hex[:8]}"
    settings = TenantSettings(name=name, requests_per_minute=rpm, tokens_per_minute=tpm)
    return tenant_from_settings(settings, "s")


class FakeClock:
    def __init__(self, now: float = 1_000_040.0) -> None:  # 20 s into a 60 s window (60 * 16667 = 1_000_020)
        self.now = now

    def __call__(self) -> float:
        return self.now




# -- the arithmetic ------------------------------------------------------------------
def test_roll_moves_current_to_previous_and_forgets_older_windows() -> None:
    c = Counter(10, 1, 5, 10, 50)
    assert roll(c, 10) == c and roll(c, 9) == c
    assert roll(c, 11) == Counter(11, 5, 0, 50, 0)
    assert roll(c, 12) == Counter(12)


def test_admit_checks_requests_then_tokens() -> None:
    c = Counter(0, 10, 2, 0, 0)
    assert estimate(10, 2, 0.5) == 7.0
    assert admit(c, 0.5, rpm=8, tpm=None, cost_req=1, cost_tok=0) == (True, None)
    assert admit(c, 0.5, rpm=7, tpm=None, cost_req=1, cost_tok=0) == (False, "requests")
    used = Counter(0, 0, 0, 0, 100)
    assert admit(used, 0.0, rpm=None, tpm=100, cost_req=1, cost_tok=0) == (False, "tokens")
    assert admit(used, 0.0, rpm=None, tpm=150, cost_req=1, cost_tok=60) == (False, "tokens")
    assert admit(used, 0.0, rpm=None, tpm=150, cost_req=1, cost_tok=50) == (True, None)


@pytest.mark.parametrize("prev, cur, elapsed, limit, cost", [
    (0, 5, 10.0, 5, 1),      # full current window: wait into the next one
    (10, 0, 5.0, 5, 1),      # previous window sliding out
    (10, 4, 30.0, 5, 1),
    (3, 2, 59.0, 5, 1),
    (100, 100, 1.0, 150, 1),
    (0, 0, 0.0, 5, 1),       # already fits
])
def test_wait_is_the_earliest_time_the_request_fits(prev: int, cur: int, elapsed: float, limit: int,
                                                    cost: int) -> None:
    w = 60.0
    t = wait_s(prev, cur, elapsed, w, limit, cost)

    def fits(after: float) -> bool:
        e = elapsed + after
        p, c = (prev, cur) if e < w else ((cur, 0) if e < 2 * w else (0, 0))
        return estimate(p, c, (e % w) / w) + cost <= limit + 1e-9

    assert fits(t)
    if t > 0.01:
        assert not fits(t - 0.01)


def test_retry_after_is_whole_seconds_at_least_one() -> None:
    assert [retry_after(s) for s in (0.0, 0.2, 1.0, 1.01, 59.5)] == [1, 1, 1, 2, 60]


# -- local counters (no Redis) -----------------------------------------------------------
@pytest.mark.anyio
async def test_local_limit_refuses_with_retry_after_and_recovers() -> None:
    clock = FakeClock()
    limiter = RateLimiter(None, clock=clock)
    t = tenant(rpm=3)
    decisions = [await limiter.check(t) for _ in range(4)]
    assert [d.allowed for d in decisions] == [True, True, True, False]
    assert [d.remaining for d in decisions[:3]] == [2, 1, 0]
    refused = decisions[3]
    assert (refused.reason, refused.limit, refused.remaining, refused.source) == ("requests", 3, 0, "local")
    assert refused.retry_after_s == 40 + 20  # to the boundary, then a third of the next window
    clock.now += refused.retry_after_s
    assert (await limiter.check(t)).allowed
    assert not limiter.degraded


@pytest.mark.anyio
async def test_unlimited_tenants_cost_nothing() -> None:
    limiter = RateLimiter(None)
    assert await limiter.check(tenant()) is UNLIMITED
    assert UNLIMITED.headers() == []


@pytest.mark.anyio
async def test_tokens_per_minute_refuses_once_used_up() -> None:
    clock = FakeClock()
    limiter = RateLimiter(None, clock=clock)
    t = tenant(tpm=1000)
    assert (await limiter.check(t)).tokens_remaining == 1000
    await limiter.record_tokens(t, 1000)
    refused = await limiter.check(t)
    assert (refused.allowed, refused.reason, refused.limit, refused.remaining) == (False, "tokens", 1000, 0)
    assert refused.retry_after_s >= 1
    assert ("x-ratelimit-remaining-tokens", "0") in refused.headers()


# -- shared through Redis ----------------------------------------------------------------
@pytest.mark.anyio
async def test_limits_hold_across_two_instances_sharing_redis(redis_service: str, pfx: str) -> None:
    t = tenant(rpm=5)
    async with client(redis_service) as ra, client(redis_service) as rb:
        a, b = (RateLimiter(r, prefix=pfx, timeout_s=SHARED_TIMEOUT_S) for r in (ra, rb))
        decisions = [await (a if i % 2 else b).check(t) for i in range(8)]
        assert sum(d.allowed for d in decisions) == 5
        assert [d.allowed for d in decisions[:5]] == [True] * 5
        refused = decisions[5]
        assert (refused.reason, refused.limit, refused.remaining) == ("requests", 5, 0)
        assert refused.source == "redis"
        assert 1 <= refused.retry_after_s <= 120
        assert ("x-ratelimit-limit-requests", "5") in refused.headers()
        assert not a.degraded and not b.degraded


@pytest.mark.anyio
async def test_tokens_recorded_on_one_instance_limit_the_other(redis_service: str, pfx: str) -> None:
    t = tenant(rpm=100, tpm=500)
    async with client(redis_service) as ra, client(redis_service) as rb:
        a, b = (RateLimiter(r, prefix=pfx, timeout_s=SHARED_TIMEOUT_S) for r in (ra, rb))
        first = await a.check(t, cost_tokens=100)  # a reservation counts at once
        assert first.allowed and first.tokens_remaining == 400
        await a.record_tokens(t, 450)
        refused = await b.check(t)
        assert (refused.allowed, refused.reason, refused.source) == (False, "tokens", "redis")
        assert refused.retry_after_s >= 1 and refused.requests_remaining is not None
        await a.record_tokens(t, -200)  # return an over-reservation
        assert (await b.check(t)).allowed


@pytest.mark.anyio
async def test_redis_killed_falls_back_to_local_counters_quickly(private_redis: PrivateRedis) -> None:
    t = tenant(rpm=1000)
    async with client(private_redis.url) as r:
        limiter = RateLimiter(r, timeout_s=0.25, breaker_open_s=30)
        assert (await limiter.check(t)).source == "redis"
        private_redis.stop()
        started = time.monotonic()
        first = await limiter.check(t)
        assert time.monotonic() - started < 1.0
        assert first.allowed and first.source == "local" and limiter.degraded
        started = time.monotonic()
        for _ in range(50):  # breaker open: Redis is not even tried
            assert (await limiter.check(t)).source == "local"
        assert time.monotonic() - started < 0.2
        await limiter.record_tokens(tenant(tpm=10), 5)  # never raises either


@pytest.mark.anyio
async def test_local_fallback_still_limits(private_redis: PrivateRedis) -> None:
    t = tenant(rpm=10)
    url = private_redis.url
    private_redis.stop()
    async with client(url) as r:
        limiter = RateLimiter(r, breaker_open_s=30, local_fraction=0.5)
        decisions = [await limiter.check(t) for _ in range(7)]
        assert [d.allowed for d in decisions] == [True] * 5 + [False] * 2
        assert decisions[-1].limit == 5 and limiter.degraded


@pytest.mark.anyio
async def test_paused_redis_costs_one_timeout_then_recovers(private_redis: PrivateRedis) -> None:
    t = tenant(rpm=1000)
    async with client(private_redis.url) as r:
        limiter = RateLimiter(r, timeout_s=0.2, breaker_open_s=0.3)
        assert (await limiter.check(t)).source == "redis"
        with private_redis.paused():
            started = time.monotonic()
            d = await limiter.check(t)
            assert time.monotonic() - started < 0.6
            assert d.allowed and d.source == "local" and limiter.degraded
        await anyio.sleep(0.35)  # breaker pause over: the next call probes Redis
        deadline = time.monotonic() + 3
        while limiter.degraded and time.monotonic() < deadline:
            d = await limiter.check(t)
        assert not limiter.degraded and d.source == "redis"


@pytest.mark.anyio
async def test_the_lua_script_and_the_local_arithmetic_agree(redis_service: str, pfx: str) -> None:
    async with client(redis_service) as r:
        seconds, micros = await r.time()
        now = seconds + micros / 1e6
        hour = 3600.0  # a long window: the sequence almost never straddles a boundary
        if now % hour > hour - 5:
            await anyio.sleep(hour - now % hour + 0.1)
            seconds, micros = await r.time()
            now = seconds + micros / 1e6
        shared = RateLimiter(r, prefix=pfx, window_s=hour, timeout_s=SHARED_TIMEOUT_S)
        local = RateLimiter(None, clock=FakeClock(now), window_s=hour)
        t = tenant(rpm=4, tpm=300)
        steps = [("check", 0), ("check", 100), ("record", 150), ("check", 0), ("check", 60), ("check", 0),
                 ("record", -100), ("check", 0), ("check", 0)]
        for op, n in steps:
            if op == "record":
                await shared.record_tokens(t, n)
                await local.record_tokens(t, n)
                continue
            a, b = await shared.check(t, cost_tokens=n), await local.check(t, cost_tokens=n)
            assert (a.allowed, a.reason, a.requests_remaining, a.tokens_remaining) == (
                b.allowed, b.reason, b.requests_remaining, b.tokens_remaining), (op, n)
            assert abs(a.retry_after_s - b.retry_after_s) <= 1


@pytest.mark.anyio
async def test_an_idle_limiter_notices_redis_is_back_by_probing(private_redis: PrivateRedis) -> None:
    t = tenant(rpm=1000)
    async with client(private_redis.url) as r:
        limiter = RateLimiter(r, timeout_s=0.2, breaker_open_s=0.3)
        with private_redis.paused():
            assert (await limiter.check(t)).source == "local" and limiter.degraded
            assert not await limiter.probe()  # still paused (or the breaker still closed to probes)
        deadline = time.monotonic() + 3
        while not await limiter.probe() and time.monotonic() < deadline:  # no request in between
            await anyio.sleep(0.1)
        assert not limiter.degraded
