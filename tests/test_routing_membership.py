"""Membership helpers: DNS discovery and the key movement rendezvous hashing promises."""

from __future__ import annotations

import random

import pytest

from routing.membership import diff, key_movement, replica_name, resolve


@pytest.mark.anyio
async def test_resolve_turns_a_name_into_sorted_replica_urls() -> None:
    urls = await resolve("localhost", 8000)
    assert urls and urls == sorted(set(urls))
    assert all(u.startswith("http://") and u.endswith(":8000") for u in urls)
    assert any("127.0.0.1" in u or "[::1]" in u for u in urls)
    assert replica_name("http://10.0.0.7:8000") == "10.0.0.7:8000"


@pytest.mark.anyio
async def test_resolve_an_unknown_name_gives_nothing_not_an_error() -> None:
    assert await resolve("no-such-host.invalid", 8000) == []


def test_diff_lists_additions_and_removals() -> None:
    d = diff(["a", "b", "c"], ["b", "c", "d"])
    assert d.added == ["d"] and d.removed == ["a"]


def test_removing_one_of_eight_replicas_moves_only_its_keys_and_adding_it_back_restores_them() -> None:
    rng = random.Random(5)
    keys = [rng.getrandbits(64) for _ in range(20_000)]
    names = [f"r{i}" for i in range(8)]
    for gone in names:
        moved = key_movement(keys, names, [n for n in names if n != gone])
        assert moved <= 1 / 8 + 0.05
    assert key_movement(keys, names, list(reversed(names))) == 0.0
    # Growing 8 -> 9 moves about 1/9 of the keys, all of them to the newcomer.
    assert key_movement(keys, names, names + ["r8"]) <= 1 / 9 + 0.05
