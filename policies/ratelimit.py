"""Per-tenant requests and tokens per minute, shared by every kvgate instance through Redis.

Each tenant has one Redis hash holding a sliding-window counter (``window``);
one Lua script rolls the window, decides and counts atomically, reading the
Redis server's clock (``TIME``) so instances with skewed clocks still agree.
The script touches that one key only, so on a Redis Cluster tenants spread over
every shard (``redis`` may be a ``RedisCluster``).

When Redis refuses, hangs or errors, a call costs at most ``timeout_s``; then a
breaker opens for ``breaker_open_s`` and this instance decides alone with the
same arithmetic in process memory (``degraded`` is True, for /readyz). During
an outage each instance enforces ``local_fraction`` of the limit: set it to
1/instances to keep the fleet-wide total, or leave 1.0 to favour availability.
The next call after the breaker's pause probes Redis and closes it on success.

Tokens: ``check`` may reserve an estimate (``cost_tokens``, e.g. the prompt
tokens); ``record_tokens`` adds what was used beyond it once the response is
known (negative values return an over-reservation). The token limit refuses
new requests once the window is used up, so one large request can overshoot
it: limits on tokens counted after the fact always allow that.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

import anyio
from redis.asyncio import Redis, RedisCluster
from redis.exceptions import RedisClusterException, RedisError

from .breaker import Breaker
from .tenants import Tenant
from .window import Counter, admit, estimate, retry_after, roll, wait_s

_FAULTS = (RedisError, RedisClusterException, OSError, TimeoutError)
Source = Literal["redis", "local", "none"]

_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local W = tonumber(ARGV[1])
local win = math.floor(now / W)
local h = redis.call('HMGET', KEYS[1], 'w', 'rp', 'rc', 'tp', 'tc')
local w = tonumber(h[1]) or win
local rp, rc = tonumber(h[2]) or 0, tonumber(h[3]) or 0
local tp, tc = tonumber(h[4]) or 0, tonumber(h[5]) or 0
if win == w + 1 then rp, rc, tp, tc = rc, 0, tc, 0
elseif win > w + 1 then rp, rc, tp, tc = 0, 0, 0, 0
elseif win < w then win = w end
local elapsed = math.max(0, math.min(W - 1, now - win * W))
local frac = elapsed / W
local rpm, tpm = tonumber(ARGV[2]), tonumber(ARGV[3])
local creq, ctok = tonumber(ARGV[4]), tonumber(ARGV[5])
local ok, why = 1, ''
if ARGV[6] == 'check' then
  local used = tp * (1 - frac) + tc
  if rpm > 0 and rp * (1 - frac) + rc + creq > rpm then ok, why = 0, 'requests'
  elseif tpm > 0 and (used >= tpm or used + ctok > tpm) then ok, why = 0, 'tokens' end
  if ok == 1 then rc = rc + creq; tc = tc + ctok end
else
  tc = math.max(0, tc + ctok)
end
redis.call('HSET', KEYS[1], 'w', win, 'rp', rp, 'rc', rc, 'tp', tp, 'tc', tc)
redis.call('PEXPIRE', KEYS[1], 2 * W + 1000)
return {ok, elapsed, rp, rc, tp, tc, why}
"""


@dataclass(frozen=True, slots=True)
class RateDecision:
    allowed: bool
    retry_after_s: int  # 0 when allowed; else whole seconds >= 1 until the request would fit
    limit: int | None  # of the binding dimension: the refusing one, else requests (then tokens)
    remaining: int | None
    reason: Literal["requests", "tokens"] | None = None
    requests_limit: int | None = None
    requests_remaining: int | None = None
    tokens_limit: int | None = None
    tokens_remaining: int | None = None
    source: Source = "none"

    def headers(self) -> list[tuple[str, str]]:
        """OpenAI-style ``x-ratelimit-*`` headers (``retry-after`` is the error's job)."""
        out = []
        if self.requests_limit is not None:
            out += [("x-ratelimit-limit-requests", str(self.requests_limit)),
                    ("x-ratelimit-remaining-requests", str(self.requests_remaining))]
        if self.tokens_limit is not None:
            out += [("x-ratelimit-limit-tokens", str(self.tokens_limit)),
                    ("x-ratelimit-remaining-tokens", str(self.tokens_remaining))]
        return out


UNLIMITED = RateDecision(True, 0, None, None)


@dataclass(frozen=True, slots=True)
class _Outcome:
    ok: bool
    reason: str | None
    elapsed_s: float
    counter: Counter
    source: Source


def _remaining(limit: int | None, prev: int, cur: int, frac: float) -> int | None:
    return None if limit is None else max(0, math.floor(limit - estimate(prev, cur, frac) + 1e-9))


def decide(o: _Outcome, rpm: int | None, tpm: int | None, window_s: float, cost_req: int,
           cost_tok: int) -> RateDecision:
    """The decision and headers for one outcome of the counter script. Pure."""
    c, frac = o.counter, o.elapsed_s / window_s
    req_left = _remaining(rpm, c.req_prev, c.req_cur, frac)
    tok_left = _remaining(tpm, c.tok_prev, c.tok_cur, frac)
    wait = 0.0
    if not o.ok:
        # Wait for every dimension that does not fit, not only the one that refused first.
        if rpm is not None:
            wait = wait_s(c.req_prev, c.req_cur, o.elapsed_s, window_s, rpm, cost_req)
        if tpm is not None:
            wait = max(wait, wait_s(c.tok_prev, c.tok_cur, o.elapsed_s, window_s, tpm, max(cost_tok, 1)))
    binding = o.reason or ("requests" if rpm is not None else "tokens")
    limit, left = (rpm, req_left) if binding == "requests" else (tpm, tok_left)
    return RateDecision(o.ok, 0 if o.ok else retry_after(wait), limit, left,
                        o.reason if not o.ok else None,  # type: ignore[arg-type]
                        rpm, req_left, tpm, tok_left, o.source)


class _LocalCounters:
    """The in-process fallback: the same counters, one instance's view, LRU-bounded."""

    def __init__(self, clock: Callable[[], float], max_tenants: int = 10_000) -> None:
        self._clock = clock
        self._max = max_tenants
        self._counters: OrderedDict[str, Counter] = OrderedDict()

    def run(self, name: str, window_s: float, rpm: int | None, tpm: int | None, cost_req: int, cost_tok: int,
            mode: str) -> _Outcome:
        now = self._clock()
        win = math.floor(now / window_s)
        c = roll(self._counters.get(name, Counter(win)), win)
        elapsed = min(max(0.0, now - c.window * window_s), window_s * 0.999)
        ok, why = True, None
        if mode == "check":
            ok, why = admit(c, elapsed / window_s, rpm, tpm, cost_req, cost_tok)
            if ok:
                c = replace(c, req_cur=c.req_cur + cost_req, tok_cur=c.tok_cur + cost_tok)
        else:
            c = replace(c, tok_cur=max(0, c.tok_cur + cost_tok))
        self._counters[name] = c
        self._counters.move_to_end(name)
        if len(self._counters) > self._max:
            self._counters.popitem(last=False)
        return _Outcome(ok, why, elapsed, c, "local")


class RateLimiter:
    def __init__(self, redis: Redis | RedisCluster | None, *, prefix: str = "kvgate:rl:", window_s: float = 60.0,
                 timeout_s: float = 0.25, breaker_open_s: float = 5.0, local_fraction: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._redis = redis
        self._script = redis.register_script(_LUA) if redis is not None else None
        self._prefix = prefix
        self._window_s = window_s
        self._timeout_s = timeout_s
        self._local_fraction = local_fraction
        self._breaker = Breaker(breaker_open_s, clock=clock)
        self._local = _LocalCounters(clock)

    @property
    def degraded(self) -> bool:
        """True while a configured Redis is failing and limits are per instance."""
        return self._redis is not None and self._breaker.degraded

    async def check(self, tenant: Tenant, cost_requests: int = 1, cost_tokens: int = 0) -> RateDecision:
        """Admit and count one request, or refuse it with ``retry_after_s``."""
        if tenant.rpm is None and tenant.tpm is None:
            return UNLIMITED
        cost_tok = min(max(cost_tokens, 0), tenant.tpm) if tenant.tpm is not None else 0
        outcome = await self._run(tenant, "check", cost_requests, cost_tok)
        rpm, tpm = self._limits(tenant, outcome.source)
        return decide(outcome, rpm, tpm, self._window_s, cost_requests, cost_tok)

    async def probe(self) -> bool:
        """Ping Redis when the breaker allows a probe; True once limits are shared again.

        Requests probe as they come; this lets an idle gateway notice the recovery
        too, so /readyz stops reporting the local fallback without waiting for traffic.
        """
        if self._redis is None or not self._breaker.degraded:
            return True
        if not self._breaker.allow():
            return False
        try:
            with anyio.fail_after(self._timeout_s):
                await self._redis.ping()
        except _FAULTS:
            self._breaker.failure()
            return False
        self._breaker.success()
        return True

    async def record_tokens(self, tenant: Tenant, tokens: int) -> None:
        """Count tokens used (beyond any reservation made in ``check``)."""
        if tenant.tpm is None or tokens == 0:
            return
        await self._run(tenant, "add", 0, tokens)

    def _limits(self, tenant: Tenant, source: Source) -> tuple[int | None, int | None]:
        if source != "local" or self._redis is None or self._local_fraction >= 1.0:
            return tenant.rpm, tenant.tpm
        scale = self._local_fraction
        return (max(1, math.floor(tenant.rpm * scale)) if tenant.rpm is not None else None,
                max(1, math.floor(tenant.tpm * scale)) if tenant.tpm is not None else None)

    async def _run(self, tenant: Tenant, mode: str, cost_req: int, cost_tok: int) -> _Outcome:
        if self._script is not None and self._breaker.allow():
            try:
                with anyio.fail_after(self._timeout_s):
                    args: list[int | str] = [int(self._window_s * 1000), tenant.rpm or 0, tenant.tpm or 0,
                                             cost_req, cost_tok, mode]
                    raw = await self._script(keys=[self._prefix + tenant.name], args=args)
                self._breaker.success()
                ok, elapsed_ms, rp, rc, tp, tc, why = raw
                why_s = why.decode() if isinstance(why, bytes) else str(why)
                return _Outcome(bool(ok), why_s or None, int(elapsed_ms) / 1000.0,
                                Counter(0, int(rp), int(rc), int(tp), int(tc)), "redis")
            except _FAULTS:
                self._breaker.failure()
        rpm, tpm = self._limits(tenant, "local")
        return self._local.run(tenant.name, self._window_s, rpm, tpm, cost_req, cost_tok, mode)
