"""P/D chaos: the chaos run (``bench.chaos``) over 2 prefill and 2 decode simulator processes.

The same load generator, judge and tallies as ``bench.chaos``; the fleet's sims run
``--role prefill`` (p1, p2) and ``--role decode`` (d1, d2), and kvgate gives each replica the
same ``role`` (docs/disaggregation.md). Each scenario hits one step of the three:

    pd_baseline        no fault: every request that reaches a replica decided remote or local, no fallback
    prefill_killed     the busiest prefill replica SIGKILLed under load, started again at 60%
    decode_killed      the busiest decode replica SIGKILLed with streams open, started again at 60%
    transfer_refused   p1 keeps prefilling, but every decode's pull of its blocks is refused

    python -m bench.chaos --pd                                  # all four, ~40 s on 2 cores
    python -m bench.chaos --pd --scenarios transfer_refused --duration 3

``transfer_refused``: the simulator has no fault that refuses a transfer in a running
replica (``/sim/faults`` acts on whole responses and streams; a short ``--kv-lease-s`` does not
refuse either: as vLLM 0.33, a decode reading expired blocks goes on with whatever they hold,
right while they stay cached and wrong once reused, and no router can tell). The lever is a restart: p1 comes back with
``--side-channel-port`` naming p2's port, so the params it returns name an engine that the
side channel at their address does not run. Each decode's pull is refused ("engine ID
mismatch"), the decode replica answers 500 before its first byte (vLLM's default
``kv_load_failure_policy: fail``), and kvgate must have it prefill the request itself
(``Disagg._recompute``). After the load p1 is started again as it was.

Routing runs with ``disaggregation: always``, as vLLM's own P/D router: every request that
reaches a replica crosses a prefill replica, so each fault meets the P/D path at once (at
``selective`` one 6 s pd_baseline decided 306 remote and 17 local).
"""

from __future__ import annotations

import asyncio
from typing import Any

from bench.chaos import GATEWAY, SIM_FLAGS, Ctx, Scenario, Tally, _need
from bench.chaos_faults import kill_busiest
from bench.chaos_fleet import Fleet, start_fleet

__all__ = ["BY_NAME", "ROLES", "SCENARIOS", "start_pd_fleet"]

ROLES = {"p1": "prefill", "p2": "prefill", "d1": "decode", "d2": "decode"}
# A KV pool of 128 blocks (2048 tokens; a chaos prompt takes 4 or 5): blocks freed once a decode
# has read them are reused within a second, as on a busy prefill instance, so a decode that
# reads them again (a retry with the same params) gets a wrong answer, as from vLLM.
PD_SIM_FLAGS = {**SIM_FLAGS, "kv_blocks": 128}
# No P/D scenario is about a slow replica (``bench.chaos`` has those), so the first byte and event
# get the time a busy machine needs: a decode leg whose pull is refused prefills locally (that is
# ``transfer_refused``'s path), and with the suite's other servers on both cores its first byte
# could miss chaos's 1 s, a 504 that no fault of the scenario caused (seen in two full runs).
PD_GATEWAY: dict[str, Any] = {**GATEWAY, "routing": {"share_index": True, "disaggregation": "always"},
                              "timeouts": {"connect_s": 1.0, "first_byte_s": 5.0, "stall_s": 5.0, "non_stream_s": 5.0}}


def start_pd_fleet() -> Fleet:
    return start_fleet(roles=ROLES, sim_flags=PD_SIM_FLAGS, gateway=PD_GATEWAY)


def _replica_served(t: Tally) -> int:
    """Requests that reached the replicas: all but the semantic cache's answers."""
    return sum(1 for r in t.results if r.cache != "hit")


def _baseline(t: Tally) -> str | None:
    decided = t.delta("kvgate_pd_decisions_total")
    return (_need(t.ok == t.sent, "requests failed with no fault")
            or _need(t.delta("kvgate_pd_decisions_total", decision="remote") > 0, "no remote prefill")
            or _need(decided == _replica_served(t),
                     f"{decided:.0f} P/D decisions for {_replica_served(t)} requests that reached a replica")
            or _need(t.delta("kvgate_pd_fallbacks_total") == 0, "a P/D fallback with no fault"))


def _felt(t: Tally) -> str | None:
    """Whether kvgate met the killed replica's death: a leg cut or a connection refused."""
    killed = t.facts.get("killed", "")
    return _need(t.delta("kvgate_upstream_errors_total", replica=killed) > 0,
                 f"kvgate saw no failure of {killed or 'any replica'}: the kill was never felt")


def _decode_killed(t: Tally) -> str | None:
    return _felt(t) or _need(t.detail_count("error event after tokens") > 0, "no decode stream cut mid-way")


def _transfer_refused(t: Tally) -> str | None:
    # Every error here is one a healthy decode replica could have avoided (issue 29): it can always
    # prefill the request itself.
    return (_need(t.facts.get("failed_transfers", 0) > 0, "no decode replica had a pull refused")
            or _need(t.delta("kvgate_pd_fallbacks_total", leg="decode", fallback="local") > 0,
                     "kvgate never prefilled a refused decode leg locally")
            or _need(t.ok == t.sent, f"{t.sent - t.ok} requests failed though the decode replicas were healthy"))


class SimCount:
    """A P/D counter of the simulators of one role (``/sim/stats``), counted across the load:
    ``before`` as a setup, ``after`` as an undo; the difference goes in the tally's facts."""

    def __init__(self, role: str, key: str, what: str) -> None:
        self.role, self.key, self.what = role, key, what

    async def _now(self, ctx: Ctx) -> int:
        total = 0
        for sim in ctx.fleet.sims:
            if sim.flags.get("role") == self.role:
                r = await ctx.control.get(sim.url + "/sim/stats")
                total += int(r.json()["kv_transfer"][self.key])
        return total

    async def before(self, ctx: Ctx) -> None:
        ctx.tally.facts[self.key + "_before"] = await self._now(ctx)

    async def after(self, ctx: Ctx) -> None:
        n = ctx.tally.facts[self.key] = await self._now(ctx) - ctx.tally.facts[self.key + "_before"]
        ctx.tally.notes.append(f"{n} {self.what}")


# vllm:nixl_num_failed_transfers on the decode side.
FAILED_PULLS = SimCount("decode", "failed_transfers", "pulls refused by the decode replicas")
# vllm:nixl_num_notifications_after_expiry on the prefill side: blocks read after they were freed,
# by a decode leg retried with params another decode replica had already pulled (right only
# while the freed blocks are not yet reused).
REREADS = SimCount("prefill", "notifications_after_expiry",
                   "reads of prefill blocks already freed (a decode leg retried with pulled params)")


async def _refuse_p1_transfers(ctx: Ctx) -> None:
    p1, p2 = ctx.fleet.sim("p1"), ctx.fleet.sim("p2")
    await FAILED_PULLS.before(ctx)
    p1.flags["side_channel_port"] = p2.port
    await asyncio.to_thread(p1.restart)
    ctx.tally.notes.append(f"p1 restarted with its side channel on p2's port {p2.port}: its params name "
                           "an engine that side channel does not run")


async def _restore_p1(ctx: Ctx) -> None:
    await FAILED_PULLS.after(ctx)
    p1 = ctx.fleet.sim("p1")
    del p1.flags["side_channel_port"]
    await asyncio.to_thread(p1.restart)


SCENARIOS: list[Scenario] = [
    Scenario("pd_baseline", "no fault", setup=FAILED_PULLS.before, undo=FAILED_PULLS.after, exercised=_baseline),
    Scenario("prefill_killed", "the busiest prefill replica SIGKILLed under load, restarted at 60%",
             act=lambda ctx: kill_busiest(ctx, role="prefill"), exercised=_felt),
    Scenario("decode_killed", "the busiest decode replica SIGKILLed with streams open, restarted at 60%",
             setup=REREADS.before, act=lambda ctx: kill_busiest(ctx, role="decode"), undo=REREADS.after,
             exercised=_decode_killed),
    Scenario("transfer_refused", "every pull of p1's blocks refused (engine ID mismatch); p1 restored after",
             setup=_refuse_p1_transfers, undo=_restore_p1, exercised=_transfer_refused),
]
BY_NAME = {s.name: s for s in SCENARIOS}
