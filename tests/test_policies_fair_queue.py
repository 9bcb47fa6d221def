"""The fair queue's invariants, as properties: bands, FIFO per tenant, weighted shares, leaving early."""

from __future__ import annotations

from collections import defaultdict

import pytest
from hypothesis import given
from hypothesis import strategies as st

from policies.fair_queue import FairQueue

TENANTS = ("a", "b", "c", "d")
# One request: (tenant, band, cost in prompt tokens).
REQUESTS = st.lists(st.tuples(st.sampled_from(TENANTS), st.integers(0, 2), st.integers(1, 4000)),
                    min_size=1, max_size=60)
WEIGHTS = st.fixed_dictionaries({t: st.sampled_from([0.5, 1.0, 2.0, 3.0, 10.0]) for t in TENANTS})


def _fill(requests: list[tuple[str, int, int]], weights: dict[str, float]) -> FairQueue[int]:
    q: FairQueue[int] = FairQueue()
    for i, (tenant, band, cost) in enumerate(requests):
        q.push(i, tenant=tenant, band=band, cost=cost, weight=weights[tenant])
    return q


def _drain(q: FairQueue[int]) -> list[int]:
    out = []
    while (e := q.pop()) is not None:
        out.append(e.item)
    return out


@given(REQUESTS, WEIGHTS)
def test_every_entry_leaves_once_bands_strictly_first_and_fifo_per_tenant(
        requests: list[tuple[str, int, int]], weights: dict[str, float]) -> None:
    q = _fill(requests, weights)
    assert len(q) == len(requests)
    order = _drain(q)
    assert sorted(order) == list(range(len(requests))) and len(q) == 0 and q.depths() == {}
    bands = [requests[i][1] for i in order]
    assert bands == sorted(bands)
    for tenant in TENANTS:
        mine = [i for i in order if requests[i][0] == tenant]
        for b in range(3):
            in_band = [i for i in mine if requests[i][1] == b]
            assert in_band == sorted(in_band)  # arrival order


@given(st.lists(st.tuples(st.sampled_from(("a", "b")), st.integers(1, 4000)), min_size=2, max_size=80),
       st.sampled_from([0.5, 1.0, 2.0, 3.0, 10.0]), st.sampled_from([0.5, 1.0, 2.0, 3.0, 10.0]))
def test_backlogged_tenants_served_work_within_one_request_of_their_weight_shares(
        requests: list[tuple[str, int]], wa: float, wb: float) -> None:
    """SCFQ's bound: while both wait, |W_a/w_a - W_b/w_b| <= Lmax_a/w_a + Lmax_b/w_b."""
    weights = {"a": wa, "b": wb}
    q = _fill([(t, 1, c) for t, c in requests], {**weights, "c": 1.0, "d": 1.0})
    order = _drain(q)
    lmax = {t: max((c for u, c in requests if u == t), default=0) for t in weights}
    last = {t: max((k for k, i in enumerate(order) if requests[i][0] == t), default=-1) for t in weights}
    served: dict[str, float] = defaultdict(float)
    for k, i in enumerate(order):
        if k >= min(last.values()):
            break  # from here one of them no longer waits
        tenant, cost = requests[i]
        served[tenant] += cost
        gap = abs(served["a"] / wa - served["b"] / wb)
        assert gap <= lmax["a"] / wa + lmax["b"] / wb + 1e-9


@given(REQUESTS, WEIGHTS, st.data())
def test_leaving_early_orders_the_rest_as_if_it_never_arrived(
        requests: list[tuple[str, int, int]], weights: dict[str, float], data: st.DataObject) -> None:
    gone = data.draw(st.sets(st.integers(0, len(requests) - 1)))
    q: FairQueue[int] = FairQueue()
    entries = [q.push(i, tenant=t, band=b, cost=c, weight=weights[t]) for i, (t, b, c) in enumerate(requests)]
    for i in sorted(gone, key=lambda i: (i * 7919) % len(requests)):  # in no particular order
        assert q.remove(entries[i])
        assert not q.remove(entries[i])  # twice: already gone
    kept = [r for i, r in enumerate(requests) if i not in gone]
    expected = [[i for i in range(len(requests)) if i not in gone][j] for j in _drain(_fill(kept, weights))]
    assert _drain(q) == expected


def test_an_idle_tenant_earns_no_credit() -> None:
    q: FairQueue[str] = FairQueue()
    for i in range(4):
        q.push(f"a{i}", tenant="a", band=1, cost=100, weight=1)
    assert [q.pop().item for _ in range(2)] == ["a0", "a1"]  # type: ignore[union-attr]
    # b arrives now: it shares from here on, it is not owed the two a already had.
    q.push("b0", tenant="b", band=1, cost=100, weight=1)
    q.push("b1", tenant="b", band=1, cost=100, weight=1)
    assert [q.pop().item for _ in range(4)] == ["a2", "b0", "a3", "b1"]  # type: ignore[union-attr]


def test_accept_skips_what_the_freed_slot_cannot_serve_and_depth_counts_per_tenant() -> None:
    q: FairQueue[str] = FairQueue()
    q.push("x-1", tenant="a", band=1, cost=10, weight=1)
    q.push("y-1", tenant="a", band=1, cost=10, weight=1)
    q.push("x-2", tenant="b", band=2, cost=10, weight=1)
    assert q.depths() == {"a": 2, "b": 1}
    got = q.pop(accept=lambda item: item.startswith("y"))
    assert got is not None and got.item == "y-1" and q.depth("a") == 1
    assert q.pop(accept=lambda item: item.startswith("z")) is None and len(q) == 2


@pytest.mark.parametrize(("cost", "weight"), [(0, 1), (1, 0), (-1, 1)])
def test_work_and_weight_must_be_positive(cost: float, weight: float) -> None:
    with pytest.raises(ValueError):
        FairQueue[int]().push(1, tenant="a", band=0, cost=cost, weight=weight)
