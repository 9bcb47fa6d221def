"""Packed homes for the keys that carry much of the traffic (routing.placement)."""

from __future__ import annotations

import random
from collections import Counter

from bench.routing_sim import SimView as View
from routing.placement import Placement


def fleet(n: int = 8) -> list[View]:
    return [View(f"r{i}") for i in range(n)]


def feed(placement: Placement, shares: dict[int, float], n_requests: int, replicas: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    keys, weights = list(shares), list(shares.values())
    light = 1.0 - sum(weights)
    for _ in range(n_requests):
        if rng.random() < light:
            placement.record(rng.getrandbits(64), replicas)  # a conversation: seen once
        else:
            placement.record(rng.choices(keys, weights)[0], replicas)


HEAVY = {1000 + i: 0.045 for i in range(12)}  # twelve keys, 54% of the traffic


def test_heavy_keys_are_packed_within_the_bound_and_light_keys_are_not() -> None:
    replicas = fleet()
    placement = Placement(heavy=0.1, epsilon=0.25)
    feed(placement, HEAVY, 6000, 8)
    homes = {k: placement.home(k, replicas, {}) for k in HEAVY}
    assert all(homes.values()), homes
    per_replica = Counter(homes.values())
    # 0.46 light spread evenly leaves room for two heavy keys per replica under 1.25/8.
    assert max(per_replica.values()) <= 2
    assert placement.home(123456789, replicas, {}) is None


def test_two_instances_fed_alike_agree_and_a_refresh_moves_nothing() -> None:
    replicas = fleet()
    a, b = Placement(0.1, 0.25, refresh=64), Placement(0.1, 0.25, refresh=64)
    feed(a, HEAVY, 6000, 8, seed=1)
    feed(b, HEAVY, 6000, 8, seed=2)
    before = {k: a.home(k, replicas, {}) for k in HEAVY}
    assert before == {k: b.home(k, replicas, {}) for k in HEAVY}
    feed(a, HEAVY, 2000, 8, seed=3)
    assert before == {k: a.home(k, replicas, {}) for k in HEAVY}


def test_removing_a_replica_moves_only_the_keys_it_must() -> None:
    replicas = fleet()
    placement = Placement(0.1, 0.25)
    feed(placement, HEAVY, 6000, 8)
    before = {k: placement.home(k, replicas, {}) for k in HEAVY}
    remaining = [r for r in replicas if r.name != before[1000]]
    after = {k: placement.home(k, remaining, {}) for k in HEAVY}
    moved = [k for k in HEAVY if after[k] != before[k]]
    assert all(after[k] != before[1000] for k in HEAVY)
    assert len(moved) <= 4, (moved, before, after)
