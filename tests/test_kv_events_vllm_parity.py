"""Parity with vLLM 0.33's own code (its CPU venv; skipped, saying why, where it is missing).

* the simulator's event bytes decode with vLLM's ``msgspec`` ``KVEventBatch``
  structs, to the same events;
* the simulator's sha256_cbor block hashes equal what vLLM's scheduler computes
  for a real ``Request`` with the same tokens and ``cache_salt`` (``PYTHONHASHSEED``
  set, and unset: vLLM's fixed default seed);
* kvgate's consumer decodes batches published by vLLM's own ``ZmqEventPublisher``,
  those published before it subscribed included (replay).
"""

from __future__ import annotations

import random
from typing import Any

import anyio
import msgpack
import pytest

from routing.kv_events import KVEvents
from routing.token_keys import block_keys
from tests.support.servers import free_port
from vllm_sim.kv import KVPool
from vllm_sim.kv_events import encode_batch
from vllm_sim.vllm_hash import vllm_block_hashes

from tests.support.vllm_env import VllmWorker as Probe

BS = 16


@pytest.fixture
def probe(vllm_worker: Probe) -> Probe:
    """The session's vLLM interpreter, started with PYTHONHASHSEED=0 (the tests' seed)."""
    return vllm_worker


SQL = ("sql-lora", "/adapters/sql")


def _cases(loras: tuple[tuple[str, str] | None, ...] = (None,)) -> list[dict[str, Any]]:
    rng = random.Random(16)
    out = []
    for lora in loras:
        for salt in (None, "acme", "tenant-ü/2"):
            for n in (BS - 1, BS, 3 * BS + 5, 40 * BS):
                out.append({"ids": [rng.randrange(0, 150_000) for _ in range(n)], "salt": salt, "block_size": BS,
                            "lora": lora})
    return out


def test_sim_block_hashes_equal_vllms_for_the_same_tokens_salt_and_adapter(probe: Probe) -> None:
    cases = _cases((None, SQL))
    theirs = probe.ask(op="hash", cases=cases)
    ours = [[h.hex() for h in vllm_block_hashes(c["ids"], BS, c["salt"], "0", c["lora"])] for c in cases]
    assert ours == theirs
    assert any(len(h) == 40 for h in theirs) and any(len(h) == 0 for h in theirs)
    half = len(cases) // 2  # the same prompts under the adapter share no block with the base model's
    assert all(not set(a) & set(b) for a, b in zip(theirs[:half], theirs[half:]))


def test_sim_events_carry_vllms_extra_keys_for_salts_and_adapters(probe: Probe) -> None:
    cases = [c for c in _cases((None, SQL)) if len(c["ids"]) >= BS]
    theirs = probe.ask(op="event_keys", cases=cases)
    for case, keys in zip(cases, theirs):
        lora = case["lora"]
        pool = KVPool(64, BS, events=True, hasher=lambda t, bs, s, a: vllm_block_hashes(t, bs, s, "0", a))
        ids = case["ids"]
        pool.allocate(pool.hash_prompt(ids, case["salt"], lora), len(ids), ids, case["salt"],
                      lora[0] if lora else None)
        stored = msgpack.unpackb(encode_batch(pool.take_events(), BS))[1][0]
        assert stored["extra_keys"] == keys, case
        assert stored["lora_name"] == (lora[0] if lora else None)


def test_the_default_seed_is_vllms_when_pythonhashseed_is_unset(probe: Probe) -> None:
    cases = _cases()[:4]
    probe.ask(op="seed", seed=None)
    try:
        theirs = probe.ask(op="hash", cases=cases)
    finally:
        probe.ask(op="seed", seed="0")
    assert theirs == [[h.hex() for h in vllm_block_hashes(c["ids"], BS, c["salt"], "vllm-none-hash")]
                      for c in cases]
    assert theirs != probe.ask(op="hash", cases=cases)  # the seed matters


def test_sim_event_bytes_decode_with_vllms_structs(probe: Probe) -> None:
    pool = KVPool(6, BS, events=True, hasher=lambda t, bs, s, lora: vllm_block_hashes(t, bs, s, "0", lora))
    a = list(range(1, 3 * BS + 1))
    pool.release(pool.allocate(pool.hash_prompt(a, "acme"), len(a), a, "acme"))  # type: ignore[arg-type]
    b = list(range(100, 100 + 4 * BS))
    pool.allocate(pool.hash_prompt(b), len(b), b)  # evicts a's tail first
    events = pool.take_events()
    pool.clear()
    cleared = pool.take_events()
    payloads = [encode_batch(events, BS, ts=1.0), encode_batch(events, BS, ts=2.0, int_hashes=False),
                encode_batch(cleared, BS, ts=3.0)]
    decoded = probe.ask(op="decode", payloads=[p.hex() for p in payloads])
    first = decoded[0]
    assert first["ts"] == 1.0 and first["data_parallel_rank"] == 0
    kinds = [e["type"] for e in first["events"]]
    assert kinds[0] == "BlockStored" and "BlockRemoved" in kinds
    stored = first["events"][0]
    assert stored["token_ids"] == a and stored["block_size"] == BS and stored["medium"] == "GPU"
    assert stored["parent_block_hash"] is None and stored["extra_keys"] == [["acme"], None, None]
    digests = vllm_block_hashes(a, BS, "acme", "0")
    assert stored["block_hashes"] == [int.from_bytes(d, "big") & (2**64 - 1) for d in digests]
    assert decoded[1]["events"][0]["block_hashes"] == [{"bytes": d.hex()} for d in digests]
    assert [e["type"] for e in decoded[2]["events"]] in (["AllBlocksCleared"], ["BlockRemoved"])


@pytest.mark.anyio
async def test_kvgate_consumes_vllms_own_publisher_with_replay(probe: Probe) -> None:
    pub, replay = free_port(), free_port()
    a = list(range(1, 4 * BS + 1))
    first = [{"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": None, "token_ids": a[:2 * BS],
              "block_size": BS, "lora_id": None, "medium": "GPU", "lora_name": None,
              "extra_keys": [["acme"], None]}]
    second = [{"type": "BlockStored", "block_hashes": [13, 14], "parent_block_hash": 12,
               "token_ids": a[2 * BS:], "block_size": BS, "lora_id": None, "medium": "GPU", "lora_name": None}]
    # Published before kvgate subscribes: only the replay socket can bring these.
    await anyio.to_thread.run_sync(lambda: probe.ask(op="publish", endpoint=f"tcp://*:{pub}",
                                                     replay=f"tcp://*:{replay}", batches=[first, second]))
    kv = KVEvents(BS)
    try:
        kv.sync({"v": (f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")})
        keys = block_keys(a, BS, "acme")
        with anyio.fail_after(10):
            while kv.index.held(keys, ["v"])["v"] != 4:
                await anyio.sleep(0.02)
        assert kv.live("v") and kv.streams["v"].last_seq == 1
        removed = [{"type": "BlockRemoved", "block_hashes": [14], "medium": "GPU"}]
        await anyio.to_thread.run_sync(lambda: probe.ask(op="publish", batches=[removed]))
        with anyio.fail_after(10):
            while kv.index.held(keys, ["v"])["v"] != 3:
                await anyio.sleep(0.02)
        await anyio.to_thread.run_sync(lambda: probe.ask(op="publish", batches=[[{"type": "AllBlocksCleared"}]]))
        with anyio.fail_after(10):
            while kv.index.size("v"):
                await anyio.sleep(0.02)
        assert kv.streams["v"].gaps == 0 and kv.streams["v"].decode_errors == 0
    finally:
        await kv.aclose()
