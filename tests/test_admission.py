"""Admission's own accounting: each replica's limit (configured, or learned from what the replica
reports, less others' load), and slots handed on when a waiter leaves in the same instant."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from gateway.proxy.admission import Admission
from gateway.proxy.pool import PoolEvents, ReplicaPool, apply_vllm_metrics
from gateway.settings import PoolSettings
from policies.tenants import Tenant


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
