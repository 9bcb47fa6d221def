"""The chaos run's faults (``bench.chaos``): what each scenario does to the fleet while the load runs.

Each is a script over the scenario's context (``bench.chaos.Ctx``): kill or restart a replica,
flap one, take Redis away, hang it or restart it empty, or set a replica's ``/sim/faults``.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the context's type only: bench.chaos, which runs the scenarios, imports this
    from bench.chaos import Ctx, Script

# Streams that have had tokens and not ended, by the replica that serves them (``kill_busiest``).
STREAMING: Counter[str] = Counter()


async def kill_r2(ctx: Ctx) -> None:
    ctx.fleet.sim("r2").kill()


async def restart_r2_later(ctx: Ctx) -> None:
    await ctx.at(0.6 * ctx.duration)
    await asyncio.to_thread(ctx.fleet.sim("r2").start)


async def _busiest(ctx: Ctx, until: float, role: str | None = None) -> tuple[str, float]:
    """The replica (of ``role``, when given) with the most requests in flight through kvgate
    (polled until one has some)."""
    while True:
        metrics = await ctx.metrics()
        flights = {s.name: metrics.get(f'kvgate_replica_in_flight{{replica="{s.name}"}}', 0.0)
                   for s in ctx.fleet.sims if s.alive and role in (None, s.flags.get("role"))}
        name = max(flights, key=lambda n: flights[n])
        if flights[name] > 0 or time.monotonic() >= until:
            return name, flights[name]
        await asyncio.sleep(0.02)


async def _sent_most(ctx: Ctx, role: str, window_s: float = 0.3) -> str | None:
    """The replica (of ``role``) kvgate sent the most P/D legs over the last ``window_s`` (None: none)."""
    names = [s.name for s in ctx.fleet.sims if s.alive and s.flags.get("role") == role]

    def legs(metrics: dict[str, float]) -> dict[str, float]:
        return {n: sum(v for k, v in metrics.items()
                       if k.startswith("kvgate_pd_legs_total{") and f'replica="{n}"' in k) for n in names}

    before = legs(await ctx.metrics())
    await asyncio.sleep(window_s)
    after = legs(await ctx.metrics())
    name = max(names, key=lambda n: after[n] - before[n], default=None)
    return name if name is not None and after[name] > before[name] else None


async def kill_busiest(ctx: Ctx, role: str | None = None) -> None:
    """SIGKILL the replica (of ``role``) with the most client streams that have had tokens, so that a
    stream is cut mid-way, which is the fault; start it again at 60%. (Chosen by kvgate's in-flight
    count, or by requests running at the replica, it could hold unary requests or streams still in
    prefill only: killed then it cut no stream, and the scenario exercised nothing, in two full runs
    of the suite on 2 cores.) With no such stream by 55% of the scenario, the busiest is killed."""
    await ctx.at(min(1.0, 0.3 * ctx.duration))
    until = ctx.t0 + 0.55 * ctx.duration
    names = [s.name for s in ctx.fleet.sims if s.alive and role in (None, s.flags.get("role"))]
    # A prefill replica streams nothing to clients (its legs are cut instead): the one kvgate is
    # sending legs to. A leg is short, so one in flight is seldom seen, and with the prefill pick
    # sending a context's legs where it is warm, a replica idle at the kill may take none after it:
    # then the kill is never felt (one run of the suite).
    name = "" if role != "prefill" else (await _sent_most(ctx, role) or (await _busiest(ctx, until, role))[0])
    while not name:
        best = max(names, key=lambda n: STREAMING[n])
        if STREAMING[best] > 0:
            name = best
        elif time.monotonic() >= until:
            name = (await _busiest(ctx, until=until, role=role))[0]
            ctx.tally.notes.append(f"no stream had tokens by {0.55 * ctx.duration:.1f} s: {name} killed anyway")
        else:
            await asyncio.sleep(0.01)
    inflight = (await ctx.metrics()).get(f'kvgate_replica_in_flight{{replica="{name}"}}', 0.0)
    sim = ctx.fleet.sim(name)
    sim.kill()
    ctx.tally.facts.update(killed=name, in_flight_at_kill=inflight)
    ctx.tally.notes.append(f"{name} SIGKILLed with {inflight:.0f} requests in flight through kvgate, "
                           f"{STREAMING[name]} streams with tokens")
    await ctx.at(0.6 * ctx.duration)
    await asyncio.to_thread(sim.start)


async def flap_r3(ctx: Ctx) -> None:
    on = True
    while time.monotonic() < ctx.t0 + ctx.duration - 0.3:
        await ctx.faults("r3", error_rate=1.0 if on else 0.0)
        on = not on
        await asyncio.sleep(0.5)
    await ctx.faults("r3")


async def redis_down(ctx: Ctx) -> None:
    assert ctx.fleet.redis is not None
    ctx.fleet.redis.kill()


async def redis_back_later(ctx: Ctx) -> None:
    assert ctx.fleet.redis is not None
    await ctx.at(0.3 * ctx.duration)
    await ctx.note_readiness("while Redis refuses")
    await ctx.at(0.6 * ctx.duration)
    await asyncio.to_thread(ctx.fleet.redis.start)


async def redis_hang(ctx: Ctx) -> None:
    redis = ctx.fleet.redis
    assert redis is not None
    start = 0.2 * ctx.duration
    hold = min(3.0, 0.5 * ctx.duration)
    await ctx.at(start)
    redis.pause()
    await ctx.at(start + hold * 0.7)
    await ctx.note_readiness(f"with Redis SIGSTOPped for {hold * 0.7:.1f} s")
    await ctx.at(start + hold)
    redis.resume()


async def redis_restart(ctx: Ctx) -> None:
    assert ctx.fleet.redis is not None
    await ctx.at(0.3 * ctx.duration)
    await asyncio.to_thread(ctx.fleet.redis.restart)
    ctx.tally.notes.append("Redis killed and restarted on the same port (empty)")
    # Entries and counters written again prove that kvgate reconnected by itself.
    await ctx.at(ctx.duration)
    await ctx.note_redis_keys("at the end of the load")


def set_faults(**per_replica: dict[str, Any]) -> Script:
    async def setup(ctx: Ctx) -> None:
        for name, faults in per_replica.items():
            await ctx.faults(name, **faults)
    return setup
