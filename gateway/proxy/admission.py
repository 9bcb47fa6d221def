"""Admission: a slot per replica up to its limit, and a fair queue in kvgate past that.

On only with tenants configured (and ``pool.fair_queue``): without tenants there
is no one to be fair between, and every request goes straight to routing as before.

**The fast path** is a counter check: a replica has a free slot while this
instance's requests in flight to it (its leases), plus slots handed to woken
waiters, are under its limit; routing then chooses among the replicas with a
free slot. A request waits only when no replica that serves its model has one,
or when others are already waiting (no one overtakes the queue).

**The limit** of a replica, for this instance: its capacity, less what other
clients of the replica hold by its last scrape (running and waiting, minus ours
at that scrape), never below one so a stale view cannot stall an instance. The
capacity is ``max_in_flight`` when configured (an operator's number, taken as
it is); else the seats the replica has shown it holds (``Replica.capacity``: its
running count beside a queue, where none of this instance's requests runs
mid-prefill: ``pool._learn_seats``) plus one. A replica that has never queued has no
limit learned: it is not full by any evidence, and nothing waits for it.

Why the learned limit is the seats plus one and no more: requests queued inside
vLLM are served first-come, outside the tenants' order, and buy nothing, since
beside a full batch vLLM takes a waiting request only when a seat frees, the moment our lease ends
and the slot goes to the next in our queue (the cost is one hop of idle seat).
The one extra is the probe: if the replica has more seats than it has shown,
it runs that request at once, its running count rises at the next scrape and
the capacity with it; if not, it is the next to run anyway. Without it a
capacity learned while long prompts filled the KV cache would never grow back.
Retries on another replica (``upstream``) are not held back: a retry happens
only after a refusal, which freed the first slot.

**Shares of a full fleet** (``policies.fair_share``): a request that keeps its tenant
within its share (the instance's slots by weight among the active tenants) may take
a free slot even while others wait, and goes first when one frees; the slots a
tenant with nothing waiting has shown it uses, up to its share, are promised to it,
so a slot it lets go waits for its next request rather than go to another's excess.
While anything is promised, a replica whose seats are confirmed (it refused a probe: kept a
request waiting while it held no more than its seats and one; ``pool._learn_seats``) gets no
probe seat.
A ticket's ``hold`` and ``done`` tell the shares who holds what (``done`` runs just
before the lease ends, so the hand-on sees the slot as its tenant's). A woken waiter holds its
slot the moment ``pump`` hands it over, not when its task next runs: answers that end in one
decode step free their slots in one turn of the loop, and counted late, the excess found itself
below its share at each of them and took the slots held back for others too.

**The last step** (``pool.hand_on_at_last_step``, on by default). A streamed answer bounded
by ``max_tokens`` hands its slot on when one token is left (``Ticket.last_step``, counted by
``sse.StreamObserver``): the next request then waits inside vLLM for that one step and joins as
the seat frees, instead of a hop after the stream ends. Its lease stays until the stream ends;
``ending`` keeps the count straight.

**The queue** is ``policies.fair_queue``: strict bands by class, weighted fair
queueing over prompt tokens within a band. A freed slot goes to the first
waiting request its replica can serve. A waiter leaves with a 429 and
``Retry-After`` at its tenant's ``queue_timeout_s``; at once when its client
disconnects (the proxy cancels it; the queue forgets it and refunds its work);
and with a 503 at shutdown (``close``), so none is dropped silently.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from policies.fair_queue import Entry, FairQueue
from policies.fair_share import Shares
from policies.priority import band
from routing.base import others_reported

from gateway.errors import NoReplica, RateLimited
from .pool import Replica, ReplicaPool

if TYPE_CHECKING:
    from policies import Tenant

__all__ = ["Admission", "Ticket"]

_OUTCOMES = ("served", "timeout", "disconnect", "shutdown")


@dataclass(slots=True, eq=False)
class _Waiter:
    model: str
    ticket: "Ticket"
    future: asyncio.Future[Replica]
    # A P/D leg waits for a replica of its role (gateway.proxy.disagg); None: any.
    roles: frozenset[str] | None = None

    @property
    def tenant(self) -> str:
        return self.ticket.tenant.name

    def takes(self, r: Replica) -> bool:
        return r.serves(self.model) and (self.roles is None or r.role in self.roles)


@dataclass(slots=True)
class _TenantTally:
    """What the status page shows of one tenant's time in the queue."""

    outcomes: Counter[str] = field(default_factory=Counter)
    wait_s_total: float = 0.0
    wait_s_max: float = 0.0


class Ticket:
    """One request's claim on a slot: who it is, its class, the work it carries."""

    __slots__ = ("admission", "tenant", "cls", "cost", "deadline", "held_at", "replica", "ending")

    def __init__(self, admission: "Admission", tenant: "Tenant", cls: str, cost: float) -> None:
        self.admission = admission
        self.tenant = tenant
        self.cls = cls
        self.cost = max(1.0, cost)
        self.deadline: float | None = None  # the event loop's time the tenant's queue deadline ends
        self.held_at: float | None = None  # when it took its slot (``hold``)
        self.replica: Replica | None = None  # where its slot is, once leased (``upstream``)
        self.ending = False  # its slot was handed on at its answer's last step (``last_step``)

    def free(self, candidates: list[Replica]) -> list[Replica]:
        """The candidates with a free slot this request may take now: none while others wait,
        unless its tenant is within its share (then only the excess waits); none where the free
        slots are held back for tenants below their share (``policies.fair_share``)."""
        adm = self.admission
        if not adm.may_take(self.tenant.name):
            return []
        return [r for r in candidates if adm.has_slot(r)]

    def hold(self) -> None:
        """It took a slot (the caller leases a replica next)."""
        if self.held_at is None:
            self.held_at = self.admission.clock()
            self.admission.hold(self.tenant.name)

    def done(self) -> None:
        """Its slot is given back; call before the lease ends, so the slot's hand-on sees it."""
        if self.ending and self.replica is not None:
            self.ending = False
            self.replica.ending -= 1
        self._let_go()

    def _let_go(self) -> None:
        """Its tenant no longer holds the slot (``policies.fair_share``)."""
        if self.held_at is not None:
            self.admission.release(self.tenant.name, self.admission.clock() - self.held_at)
            self.held_at = None

    def unhold(self) -> None:
        """It was handed a slot it will not use (``Admission.pump`` holds for it): no request's time
        in a slot, so nothing is learned from it."""
        if self.held_at is not None:
            self.held_at = None
            self.admission.unhold(self.tenant.name)

    def last_step(self) -> None:
        """Its answer is one decode step from its end (it streamed all its ``max_tokens`` but
        one): the slot is handed on now. vLLM admits requests between steps, so the next request,
        sent during this last step, joins the step after it, the first without this one: the seat
        idles no longer than under vLLM's own queue, instead of the hop it takes to send a request
        after the stream ends. The lease stays until the stream ends (``done``)."""
        if self.held_at is None or self.replica is None or self.ending:
            return
        self.ending = True
        self.replica.ending += 1
        self._let_go()
        self.admission.pump()

    async def wait(self, model: str, roles: frozenset[str] | None = None) -> list[Replica]:
        """Queue until a slot frees on a replica serving ``model`` (of one of ``roles``, a P/D leg's);
        the replicas with a free slot then (the caller routes among them before it next awaits).
        Raises 429 at the deadline, 503 at shutdown; cancellation (a disconnect) leaves the queue at once."""
        adm = self.admission
        while True:
            handed = await adm.wait(self, model, roles)
            eligible = adm.pool.eligible(model, roles)
            if not eligible:  # its replicas went (ejected, drained, removed) while it waited
                self.unhold()
                raise NoReplica(f"no healthy replica serves model '{model}'")
            # The slot it was handed is its own, whatever the limits say now: a probe seat withdrawn
            # in the meantime (``Admission.limit``) must not send it back to the queue, where the
            # next pump would hand it the same slot again.
            free = [r for r in eligible if r is handed or adm.has_slot(r)]
            if free:
                return free
            self.unhold()  # the slot it was handed went with its replica: it waits again


class Admission:
    def __init__(self, pool: ReplicaPool, *, active: Callable[[], bool], metrics: Any = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pool = pool
        self._active = active
        self.metrics = metrics
        self.clock = clock
        self.queue: FairQueue[_Waiter] = FairQueue()
        self.queue_len = 0  # len(queue), kept as a plain int for the fast path
        self.reserved: dict[Replica, int] = {}  # slots handed to woken waiters, not yet leased
        self.closed = False
        self.tallies: dict[str, _TenantTally] = {}
        # Who holds the slots, and what is held back for tenants below their share.
        self.shares = Shares()
        self.weights: dict[str, float] = {}
        self._protecting = False  # slots are promised to a tenant (fair_share): no probe seat (``limit``)
        self._wake: asyncio.TimerHandle | None = None

    # -- the fast path ------------------------------------------------------------------
    @property
    def active(self) -> bool:
        """Whether requests take tickets: tenants are configured and ``pool.fair_queue`` is on."""
        return self._active()

    def ticket(self, tenant: "Tenant", cls: str, cost: float) -> Ticket:
        """One request's claim (only while ``active``)."""
        self.weights[tenant.name] = tenant.weight
        return Ticket(self, tenant, cls, cost)

    def limit(self, r: Replica) -> float | None:
        """This instance's slots on ``r``; None: no limit known."""
        if r.max_in_flight is not None:
            capacity: float = r.max_in_flight
        elif r.capacity is not None:
            # The probe seat (module docstring), but not while slots are promised to a tenant
            # (policies.fair_share) once the replica has refused one (``Replica.capacity_confirmed``):
            # the probe's request would wait inside the replica and take the seat that
            # tenant's next request was promised. Until then it stays, promises or not: it is
            # what lets a count learned a seat short rise (``pool._learn_seats``).
            capacity = r.capacity + (0 if self._protecting and r.capacity_confirmed else 1)
        else:
            return None
        return max(1.0, capacity - others_reported(r))

    def has_slot(self, r: Replica) -> bool:
        limit = self.limit(r)
        return limit is None or self._taken(r) < limit

    def _taken(self, r: Replica) -> int:
        """The slots on ``r`` in use: leases not in their last step, and slots handed to waiters."""
        return r.held + self.reserved.get(r, 0)

    # -- shares of a full fleet (policies.fair_share) ---------------------------------------
    def _limits(self) -> list[tuple[Replica, float | None]]:
        """The replicas that can take requests, with their limits."""
        now = self.pool.clock()
        return [(r, self.limit(r)) for r in self.pool.replicas.values() if r.available(now)]

    def _slots(self) -> float | None:
        """The instance's slots over the replicas that can take requests; None if any has no limit
        (not full by any evidence: nothing needs holding back)."""
        total = 0.0
        for _, limit in self._limits():
            if limit is None:
                return None
            total += limit
        return total

    def _free_slots(self) -> float:
        return sum(max(0.0, limit - self._taken(r)) for r, limit in self._limits() if limit is not None)

    def may_take(self, tenant: str) -> bool:
        """Whether a request of ``tenant`` may take a free slot now rather than queue."""
        slots = self._slots()
        if slots is None:
            return not self.queue_len
        now = self.clock()
        waiting = self.queue.depths()
        if self.shares.within_share(tenant, slots, self.weights, waiting, now):
            return True  # only the excess waits
        if self.queue_len:
            return False  # no one overtakes the queue
        return self._room(tenant, slots, waiting, now, self._free_slots())

    def _room(self, tenant: str, slots: float, waiting: dict[str, int], now: float, free: float) -> bool:
        back, lapse = self.shares.held_back(tenant, slots, self.weights, waiting, now)
        if free - back >= 1:
            return True
        if lapse is not None:
            self._wake_at(lapse)
        return False

    def hold(self, tenant: str) -> None:
        self.shares.hold(tenant, self.clock())
        self._update_protecting()

    def unhold(self, tenant: str) -> None:
        self.shares.unhold(tenant)
        self._update_protecting()

    def release(self, tenant: str, held_s: float) -> None:
        now = self.clock()
        self.shares.release(tenant, now, held_s)
        self.shares.forget_idle(now)
        self._update_protecting()

    def _update_protecting(self) -> None:
        self._protecting = self._slots() is not None and self.shares.promised(self.queue.depths(), self.clock())

    def _wake_at(self, when: float) -> None:
        """Pump again when a hold lapses (nothing else may free a slot for the queue then)."""
        delay = max(0.0, when - self.clock())
        if self._wake is not None and not self._wake.cancelled():
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return

        def wake() -> None:
            self._wake = None
            self._update_protecting()
            self.pump()

        self._wake = loop.call_later(delay + 0.001, wake)

    # -- waiting ----------------------------------------------------------------------------
    async def wait(self, ticket: Ticket, model: str, roles: frozenset[str] | None = None) -> Replica:
        """Queue ``ticket`` until a slot is handed to it; the replica whose slot it is."""
        if self.closed:
            raise _shutting_down()
        tenant = ticket.tenant
        loop = asyncio.get_running_loop()
        if ticket.deadline is None:  # one deadline however often the request is woken and requeued
            ticket.deadline = loop.time() + tenant.queue_timeout_s
        waiter = _Waiter(model, ticket, loop.create_future(), roles)
        entry = self.queue.push(waiter, tenant=tenant.name, band=band(ticket.cls), cost=ticket.cost,
                                weight=tenant.weight)
        self.queue_len += 1
        started = self.clock()
        outcome = "disconnect"
        try:
            self.pump()  # a slot may be free for this model while others wait for another
            async with asyncio.timeout_at(ticket.deadline):
                replica = await waiter.future
            outcome = "served"
        except TimeoutError:
            outcome = "timeout"
            raise RateLimited(f"every replica is busy and the request waited {tenant.queue_timeout_s:g} s "
                              "in the queue; retry later", retry_after_s=tenant.queue_timeout_s,
                              code="queue_timeout") from None
        except NoReplica:
            outcome = "shutdown"
            raise
        finally:
            self._left(entry, outcome)
            self._record(tenant.name, outcome, self.clock() - started)
        self._unreserve(replica)  # the caller routes at once, with no await in between
        return replica

    def _left(self, entry: Entry[_Waiter], outcome: str) -> None:
        if self.queue.remove(entry):
            self.queue_len -= 1
            return
        fut = entry.item.future
        if outcome != "served" and fut.done() and not fut.cancelled() and fut.exception() is None:
            # Handed a slot in the same instant it gave up: pass the slot on.
            entry.item.ticket.unhold()
            self._unreserve(fut.result())
            self.pump()

    def _unreserve(self, r: Replica) -> None:
        _drop_one(self.reserved, r)

    # -- handing slots on -----------------------------------------------------------------
    def released(self, replica: Replica) -> None:
        """A lease ended (``PoolEvents.on_release``): its slot goes to the next waiter."""
        if self.queue_len:
            self.pump()

    def pump(self) -> None:
        """Hand every free slot to the next waiter, in fair order, that its replica serves. Also run
        after every scrape: a promise that lapsed with nothing happening is let go here."""
        self._update_protecting()
        if not self.queue_len:
            return
        now = self.pool.clock()
        slots = self._slots()
        at = self.clock()
        for r in list(self.pool.replicas.values()):
            if not r.available(now):
                continue
            while self.queue_len and self.has_slot(r):
                entry = self._next_waiter(r, slots, at)
                if entry is None:
                    break
                self.queue_len -= 1
                if entry.item.future.done():
                    # Its task was cancelled (deadline, disconnect) and has not run its
                    # clean-up yet: it leaves without the slot, which stays free.
                    continue
                self.reserved[r] = self.reserved.get(r, 0) + 1
                entry.item.future.set_result(r)
                # Its tenant holds the slot from now, not from when its task next runs: several
                # slots freed in one turn of the loop (answers ending in the same decode step)
                # would otherwise each find the tenant below its share, and its excess would take
                # the slots held back for others.
                entry.item.ticket.hold()

    def _next_waiter(self, r: Replica, slots: float | None, at: float) -> Entry[_Waiter] | None:
        """The waiter a free slot on ``r`` goes to, taken out of the queue: with every limit known,
        waiters of tenants within their share first (only the excess waits), then the rest in fair
        order where the free slots are not held back for others; else simply in fair order."""
        def serves(w: _Waiter) -> bool:
            return w.takes(r)

        if slots is None:
            return self.queue.pop(accept=serves)
        waiting, free = self.queue.depths(), self._free_slots()

        def within(w: _Waiter) -> bool:
            return serves(w) and self.shares.within_share(w.tenant, slots, self.weights, waiting, at)

        def room(w: _Waiter) -> bool:
            return serves(w) and self._room(w.tenant, slots, waiting, at, free)

        return self.queue.pop(accept=within) or self.queue.pop(accept=room)

    def close(self) -> None:
        """Shutdown: every waiter answers 503 now, and nothing queues from here on."""
        self.closed = True
        while (entry := self.queue.pop()) is not None:
            self.queue_len -= 1
            if not entry.item.future.done():
                entry.item.future.set_exception(_shutting_down())

    # -- what operators see ---------------------------------------------------------------
    def _record(self, tenant: str, outcome: str, waited_s: float) -> None:
        tally = self.tallies.setdefault(tenant, _TenantTally())
        tally.outcomes[outcome] += 1
        tally.wait_s_total += waited_s
        tally.wait_s_max = max(tally.wait_s_max, waited_s)
        if self.metrics is not None:
            self.metrics.queue_wait.labels(tenant).observe(waited_s)
            self.metrics.queue_exits.labels(tenant, outcome).inc()

    def depths(self) -> dict[str, int]:
        return self.queue.depths()

    def stats(self) -> dict[str, Any]:
        """Per tenant: waiting now, and how past waits ended and how long they took."""
        depths = self.depths()
        tenants = {}
        for name in sorted(set(depths) | set(self.tallies)):
            tally = self.tallies.get(name, _TenantTally())
            waits = sum(tally.outcomes.values())
            tenants[name] = {"waiting": depths.get(name, 0), **{o: tally.outcomes.get(o, 0) for o in _OUTCOMES},
                             "mean_wait_s": round(tally.wait_s_total / waits, 4) if waits else None,
                             "max_wait_s": round(tally.wait_s_max, 4) if waits else None}
        limits = {r.name: self.limit(r) for r in self.pool.replicas.values()}
        return {"active": self.active, "closed": self.closed, "waiting": self.queue_len,
                "limits": limits, "tenants": tenants}


def _drop_one(counts: dict[Replica, int], r: Replica) -> None:
    """One fewer for ``r`` in a per-replica count that keeps no zeros."""
    n = counts.get(r, 0) - 1
    if n > 0:
        counts[r] = n
    else:
        counts.pop(r, None)


def _shutting_down() -> NoReplica:
    return NoReplica("kvgate is shutting down; retry the request (another instance will take it)",
                     code="shutting_down")
