"""Admission's own accounting: each replica's limit (configured, or learned from what the replica
reports, less others' load), and slots handed on when a waiter leaves in the same instant."""

from __future__ import annotations

import asyncio

import httpx
import orjson
import pytest

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from gateway.proxy.admission import Admission, Ticket
from gateway.proxy.pool import Lease, PoolEvents, ReplicaPool, apply_vllm_metrics
from gateway.settings import PoolSettings
from policies.tenants import Tenant
from routing.base import others_reported
from tests.support.servers import ServerThread


def _scrape(running: float, waiting: float) -> str:
    return (f'vllm:num_requests_running{{model_name="m"}} {running}\n'
            f'vllm:num_requests_waiting{{model_name="m"}} {waiting}\n')


def _admission() -> tuple[ReplicaPool, Admission]:
    pool = ReplicaPool(PoolSettings(), httpx.AsyncClient())
    return pool, Admission(pool, active=lambda: True)


def test_no_limit_until_the_replica_has_queued_then_its_seats_plus_the_probe() -> None:
    pool, adm = _admission()
    r = pool.add("r1", "http://127.0.0.1:1")
    apply_vllm_metrics(r, _scrape(running=12, waiting=0))
    assert adm.limit(r) is None and adm.has_slot(r)  # not full by any evidence
    r.in_flight = 20  # our own requests, at the scrape that shows the queue
    apply_vllm_metrics(r, _scrape(running=16, waiting=4))
    assert r.capacity == 16 and adm.limit(r) == 17  # 16 seats, and one to learn of more
    assert not adm.has_slot(r)
    apply_vllm_metrics(r, _scrape(running=20, waiting=0))  # the probe ran: it holds more
    assert r.capacity == 20 and adm.limit(r) == 21 and adm.has_slot(r)
    apply_vllm_metrics(r, _scrape(running=8, waiting=0))  # a lull forgets nothing
    assert r.capacity == 20


def test_a_queue_beside_a_prompt_being_chunked_is_no_seat_count() -> None:
    """vLLM spends each step's token budget on the running requests first (a long prompt's next
    chunk), so a request can wait with seats free. Seats are learned only from a queue beside a
    batch that none of this instance's requests runs mid-prefill (their first token not back)."""
    pool, adm = _admission()
    r = pool.add("r1", "http://127.0.0.1:1")
    long_prompt, kept = pool.acquire(r, stream=True), pool.acquire(r, stream=True)  # neither has its first token
    apply_vllm_metrics(r, _scrape(running=1, waiting=1))  # the long prompt chunked, one kept waiting
    assert r.capacity is None and adm.limit(r) is None
    long_prompt.started()  # decoding now: a queue beside it is one for seats (or KV blocks)
    apply_vllm_metrics(r, _scrape(running=1, waiting=1))
    assert r.capacity == 1 and r.capacity_confirmed
    # What runs is a floor on the seats whatever waits beside it: a larger batch raises them.
    third = pool.acquire(r, stream=True)
    apply_vllm_metrics(r, _scrape(running=3, waiting=0))
    assert r.capacity == 3 and not r.capacity_confirmed
    for lease in (long_prompt, kept, third):
        lease.release()
        lease.release()  # twice: counted once
    assert r.in_flight == r.unstarted == 0


@pytest.mark.anyio
async def test_a_request_that_ends_while_the_replica_is_scraped_is_not_read_as_another_clients() -> None:
    """The replica counts our request in its figures, and the request ends before they reach us:
    ours are the more of our count when the scrape was sent and when it came back."""
    ending: list[Lease] = []

    async def metrics(request: Request) -> PlainTextResponse:
        text = _scrape(running=1, waiting=0)  # the figures, taken while our request runs
        ending.pop().release()  # ... which ends before they reach kvgate
        return PlainTextResponse(text)

    replica_server = ServerThread(Starlette(routes=[Route("/metrics", metrics)])).start()
    pool = ReplicaPool(PoolSettings(), httpx.AsyncClient())
    try:
        r = pool.add("r1", replica_server.url)
        ending.append(pool.acquire(r))
        await pool.scrape(r)
        assert not ending and r.in_flight == 0 and r.running == 1.0
        assert others_reported(r) == 0.0  # with the count at the end only, 1: a phantom for a second
        ending.append(pool.acquire(r))
        apply_vllm_metrics(r, _scrape(running=3, waiting=0))  # the count now, where none is given
        assert others_reported(r) == 2.0
    finally:
        await pool.client.aclose()
        replica_server.stop()


def test_a_configured_limit_is_shared_with_the_replicas_other_clients_never_below_one() -> None:
    pool, adm = _admission()
    r = pool.add("r1", "http://127.0.0.1:1", max_in_flight=10)
    assert adm.limit(r) == 10
    r.in_flight = 3
    apply_vllm_metrics(r, _scrape(running=7, waiting=2))  # 6 of the 9 are another instance's
    assert adm.limit(r) == 4 and adm.has_slot(r)
    r.in_flight = 4
    assert not adm.has_slot(r)
    r.in_flight = 0
    apply_vllm_metrics(r, _scrape(running=10, waiting=30))
    assert adm.limit(r) == 1  # a stale or crowded view never stalls this instance


def test_routing_reads_seats_only_from_the_operator_never_from_a_queue() -> None:
    # A queue beside 12 running is what a full KV pool shows too; only max_in_flight (vLLM's
    # --max-num-seqs) tells routing (ttft's seat wait) the replica's seats.
    pool, _ = _admission()
    learned, told = pool.add("r1", "http://127.0.0.1:1"), pool.add("r2", "http://127.0.0.1:2", max_in_flight=64)
    for r in (learned, told):
        apply_vllm_metrics(r, _scrape(running=12, waiting=3))
    assert learned.capacity == 12 and learned.seats is None
    assert told.seats == 64.0


@pytest.mark.anyio
async def test_a_waiter_cancelled_before_it_ran_leaves_its_slot_to_the_next() -> None:
    adm: Admission
    pool = ReplicaPool(PoolSettings(), httpx.AsyncClient(), events=PoolEvents(on_release=lambda r: adm.released(r)))
    adm = Admission(pool, active=lambda: True)
    r = pool.add("r1", "http://127.0.0.1:1", models=["m"], max_in_flight=1)
    lease = pool.acquire(r)
    tenant = Tenant("a", "a", "salt", queue_timeout_s=60)
    first = asyncio.ensure_future(adm.ticket(tenant, "standard", 10).wait("m"))
    second = asyncio.ensure_future(adm.ticket(tenant, "standard", 10).wait("m"))
    await asyncio.sleep(0)
    assert adm.queue_len == 2
    first.cancel()  # its client went away; its clean-up has not run yet
    lease.release()  # and in the same instant the slot frees
    assert await asyncio.wait_for(second, 5) == [r]
    with pytest.raises(asyncio.CancelledError):
        await first
    assert adm.queue_len == 0 and adm.reserved == {} and adm.stats()["tenants"]["a"]["disconnect"] == 1
    await pool.client.aclose()


def test_a_slot_a_tenant_below_its_share_let_go_waits_for_it_not_for_the_others_excess() -> None:
    clock = [0.0]
    pool = ReplicaPool(PoolSettings(), httpx.AsyncClient())
    adm = Admission(pool, active=lambda: True, clock=lambda: clock[0])
    r = pool.add("r1", "http://127.0.0.1:1", max_in_flight=4)
    quiet, noisy = Tenant("quiet", "q", "salt"), Tenant("noisy", "n", "salt")

    def take(tenant: Tenant) -> object:
        ticket = adm.ticket(tenant, "standard", 10)
        assert ticket.free([r]) == [r]
        ticket.hold()
        pool.acquire(r)
        return ticket

    q1, q2 = take(quiet), take(quiet)
    take(noisy), take(noisy)
    assert adm.ticket(noisy, "standard", 10).free([r]) == []  # full
    clock[0] = 1.0
    q1.done()  # quiet's request held its slot for a second; the slot frees
    r.in_flight -= 1
    # The others' excess waits: quiet has shown it uses 2 (its share of 4 is 2), holds 1.
    assert adm.ticket(noisy, "standard", 10).free([r]) == []
    assert adm.ticket(quiet, "standard", 10).free([r]) == [r]
    clock[0] = 2.5  # quiet paused longer than one of its requests takes: the promise lapses
    assert adm.ticket(noisy, "standard", 10).free([r]) == [r]
    assert q2 is not None


@pytest.mark.anyio
async def test_slots_freed_in_one_turn_go_to_the_excess_only_past_what_is_held_back() -> None:
    """Answers end in the same decode step, so their slots free in one turn of the loop. Each woken
    waiter holds its slot at once: counted only once its task ran, the excess looked below its share
    at every slot freed in that turn, and took the slot held back for the quiet tenant too."""
    clock = [0.0]
    pool = ReplicaPool(PoolSettings(), httpx.AsyncClient())
    adm = Admission(pool, active=lambda: True, clock=lambda: clock[0])
    r = pool.add("r1", "http://127.0.0.1:1", models=["m"], max_in_flight=4)
    quiet, noisy = Tenant("quiet", "q", "salt", queue_timeout_s=60), Tenant("noisy", "n", "salt", queue_timeout_s=60)

    def take(tenant: Tenant) -> Ticket:
        ticket = adm.ticket(tenant, "standard", 10)
        ticket.hold()
        pool.acquire(r)
        ticket.replica = r
        return ticket

    q1, q2 = take(quiet), take(quiet)
    n1, n2 = take(noisy), take(noisy)
    clock[0] = 1.0
    q1.done()  # a quiet user's answer ended after a second; it is pausing
    r.in_flight -= 1
    waiters = [asyncio.ensure_future(adm.ticket(noisy, "standard", 10).wait("m")) for _ in range(3)]
    await asyncio.sleep(0)
    assert adm.queue_len == 3  # the free slot is held back for quiet
    n1.last_step()  # both of noisy's answers reach their last step in one decode step
    n2.last_step()
    await asyncio.sleep(0)
    assert [w.done() for w in waiters] == [True, True, False]  # its own two slots, not quiet's
    assert adm.ticket(quiet, "standard", 10).free([r]) == [r]
    waiters[2].cancel()
    assert q2 is not None
    await pool.client.aclose()


@pytest.mark.anyio
@pytest.mark.timeout(10)  # the fault was a livelock: the loop never yields to a timer
async def test_a_waiter_handed_the_probe_seat_keeps_it_when_the_seat_is_withdrawn() -> None:
    """The probe seat is there while nothing is promised; a tenant whose queue empties (it is handed
    the seat) has demand and nothing waiting, so it is promised, and the seat goes in the same
    instant. The slot handed is the waiter's: sent back to the queue, the next pump handed it the
    same seat again, for ever."""
    pool = ReplicaPool(PoolSettings(), httpx.AsyncClient())
    adm = Admission(pool, active=lambda: True)
    r = pool.add("r1", "http://127.0.0.1:1", models=["m"])
    noisy = Tenant("noisy", "n", "salt", queue_timeout_s=60)
    tickets = [adm.ticket(noisy, "standard", 10) for _ in range(4)]
    leases = [pool.acquire(r, stream=True) for _ in range(5)]
    for lease in leases[:4]:
        lease.started()  # the 4 running are decoding: their first token is back
    for t in tickets:
        t.hold()
    apply_vllm_metrics(r, _scrape(running=4, waiting=1))
    leases.pop().release()  # the probe's request ended: 4 in flight, all noisy's
    assert r.capacity_confirmed and adm.limit(r) == 5  # nothing promised yet: noisy's slots are all held
    tickets[0].done()
    leases.pop().release()
    tickets[0] = adm.ticket(noisy, "standard", 10)
    tickets[0].hold()
    leases.append(pool.acquire(r, stream=True))
    adm.pump()
    assert adm.limit(r) == 4  # noisy shows demand with nothing waiting: promised, no probe seat
    waiter = asyncio.ensure_future(adm.ticket(noisy, "standard", 10).wait("m"))
    assert await asyncio.wait_for(waiter, 5) == [r]  # queued: no probe; handed it: promised again
    await pool.client.aclose()


def test_no_probe_seat_once_the_replica_refused_one_while_slots_are_promised() -> None:
    clock = [0.0]
    pool = ReplicaPool(PoolSettings(), httpx.AsyncClient())
    adm = Admission(pool, active=lambda: True, clock=lambda: clock[0])
    r = pool.add("r1", "http://127.0.0.1:1")
    leases = [pool.acquire(r, stream=True) for _ in range(6)]  # all of them ours
    for lease in leases[:4]:
        lease.started()  # the 4 running are decoding: their first token is back
    apply_vllm_metrics(r, _scrape(running=4, waiting=2))
    quiet = Tenant("quiet", "q", "salt")
    ticket = adm.ticket(quiet, "standard", 10)
    ticket.hold()
    # Promised, but 6 were there: one may have ended in the step, its seat not yet taken again.
    assert r.capacity == 4 and not r.capacity_confirmed and adm.limit(r) == 5
    leases.pop().release()  # 5 in flight since here: the seats and the probe
    apply_vllm_metrics(r, _scrape(running=4, waiting=2))  # the gauges of a step before it
    assert not r.capacity_confirmed  # 6 were in flight since the last scrape
    apply_vllm_metrics(r, _scrape(running=4, waiting=1))
    ticket.done()
    ticket = adm.ticket(quiet, "standard", 10)
    ticket.hold()  # quiet still shows demand
    assert r.capacity_confirmed and adm.limit(r) == 4  # the probe was refused; it would take quiet's seat
    clock[0] = 10.0
    ticket.done()
    assert adm.limit(r) == 4  # its demand lasts one of its requests' times after it let go
    clock[0] = 30.0
    adm.pump()  # as after every scrape
    assert adm.limit(r) == 5  # nothing promised: probe again


def test_a_seat_short_in_steps_where_a_request_ended_is_not_confirmed_so_the_probe_finds_it() -> None:
    """vLLM counts a request that finished in a step out of running at the step's end, before the
    next step admits a waiting one into its seat: a scrape then shows a full replica a seat short,
    beside a queue. Two such scrapes while a flood drained once learned 3 seats of 4 as confirmed
    (bench.fairness); with slots promised there was then no probe seat, kvgate sent 3, the replica
    never ran 4 again, and nothing could correct it."""
    pool, adm = _admission()
    r = pool.add("r1", "http://127.0.0.1:1")
    adm.ticket(Tenant("quiet", "q", "salt"), "standard", 10).hold()  # slots are promised throughout
    seats = 4
    leases = [pool.acquire(r, stream=True) for _ in range(10)]  # a flood reached the replica before any limit

    def scrape(running: int) -> None:
        """The replica's gauges, all of its requests ours, those running decoding; the pump, as
        after every scrape."""
        for lease in leases[:running]:
            lease.started()
        apply_vllm_metrics(r, _scrape(running=running, waiting=len(leases) - running))
        adm.pump()

    for _ in range(2):
        leases.pop().release()  # a request finished in the step: out of running, and its stream ends
        scrape(running=seats - 1)
    assert r.capacity == 3 and adm.limit(r) == 4  # a seat short, and the probe seat stays
    for _ in range(3):
        # The flood drains to this instance's limit and kvgate fills it; a step in which none ended.
        while leases and not adm.has_slot(r):
            leases.pop().release()
        while adm.has_slot(r):
            leases.append(pool.acquire(r, stream=True))
        scrape(running=min(len(leases), seats))
    # It ran 4 (the probe seat), then refused a fifth: confirmed, and no probe while promised.
    assert r.capacity == seats and r.capacity_confirmed and adm.limit(r) == seats


def test_the_last_step_is_found_from_the_chunks_that_carry_tokens_never_early() -> None:
    from gateway.proxy.sse import StreamObserver

    calls: list[int] = []
    obs = StreamObserver("chat", strip_usage_chunk=True, tokens_left=3, on_last_step=lambda: calls.append(1))

    def chunk(delta: dict[str, object]) -> bytes:
        return b"data: " + orjson.dumps({"choices": [{"index": 0, "delta": delta, "finish_reason": None}]}) + b"\n\n"

    obs.feed(chunk({"role": "assistant", "content": ""}))  # the role's chunk carries no token
    obs.feed(chunk({"content": "a"}))
    obs.feed(chunk({"content": ""}))  # a token still being detokenized shows nothing: not counted
    assert calls == [] and obs.tokens_left == 2
    obs.feed(chunk({"content": "b"}))
    assert calls == [1] and obs.tokens_left == 1
    obs.feed(chunk({"content": "c"}))
    assert calls == [1]  # once
