"""KV-event consumer benchmark: how many events one kvgate instance keeps up with, and what the index costs.

    .venv/bin/python -m bench.kv_events            # ~1-2 minutes on 2 cores
    .venv/bin/python -m bench.kv_events --quick

Three tables:

* **throughput**: vLLM-shaped batches (one ``BlockStored`` of ``--blocks-per-event``
  blocks chained onto the previous one, and as many single-block
  ``BlockRemoved``: a pool at steady state) published by the simulator's
  publisher (``vllm_sim.kv_events``, vLLM's wire format) as fast as it can over
  loopback TCP, consumed by ``routing.kv_events.KVEvents`` on an asyncio loop
  (decode, sequence check, re-key by token ids, index); also the same batches
  decoded and applied in process without sockets (the consumer's own ceiling).
  A batch lost by the PUB socket under overload is a gap, filled by replay:
  the row counts them.
* **memory**: ``tracemalloc`` over the index while ``--memory-blocks`` blocks
  spread over 8 replicas are stored: bytes per million blocks.
* **lookup**: per request, the token-block keys and the longest-prefix lookup
  over 8 replicas (what precise mode adds to routing), p50/p99 at 1K, 4K and 16K tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
import tracemalloc

from bench.ports import free_port
from routing.kv_events import KVEvents
from routing.kv_index import KVEventIndex
from routing.kv_wire import decode_batch
from routing.token_keys import block_keys
from vllm_sim.kv import PoolEvent, Removed, Stored
from vllm_sim.kv_events import KVEventPublisher, encode_batch

BS = 16


def batches(n: int, per_event: int, seed: int = 1) -> list[list[PoolEvent]]:
    """``n`` batches: each stores ``per_event`` blocks chained on the last stored and removes as many old ones."""
    rng = random.Random(seed)
    out: list[list[PoolEvent]] = []
    parent: bytes | None = None
    live: list[bytes] = []
    counter = 0
    for _ in range(n):
        hashes = []
        for _ in range(per_event):
            counter += 1
            hashes.append(counter.to_bytes(16, "big"))
        tokens = tuple(rng.randrange(30_000) for _ in range(per_event * BS))
        events: list[PoolEvent] = [Stored(tuple(hashes), parent, tokens, None)]
        parent = hashes[-1] if rng.random() < 0.9 else None  # mostly one long chain, sometimes a new root
        live += hashes
        if len(live) > 50_000:
            events += [Removed((live.pop(0),)) for _ in range(per_event)]
        out.append(events)
    return out


def in_process(payloads: list[bytes]) -> float:
    """Events per second: decode and apply, no sockets."""
    idx = KVEventIndex(BS)
    events = 0
    started = time.perf_counter()
    for p in payloads:
        b = decode_batch(p)
        idx.apply("r", b)
        events += len(b.events)
    return events / (time.perf_counter() - started)


async def over_zmq(raw: list[list[PoolEvent]]) -> tuple[float, int, int]:
    """Events per second through a real PUB socket into ``KVEvents``; (rate, gaps, gaps replayed)."""
    pub, replay = free_port(), free_port()
    publisher = KVEventPublisher(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}", block_size=BS,
                                 buffer_steps=len(raw) + 1)
    kv = KVEvents(BS)
    try:
        kv.sync({"r": (f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")})
        while not kv.live("r"):
            await asyncio.sleep(0.01)
        stream = kv.streams["r"]
        total = sum(len(b) for b in raw)
        started = time.perf_counter()
        for b in raw:
            publisher.publish(b)
        while stream.events < total:
            await asyncio.sleep(0.005)
            if time.perf_counter() - started > 300:
                raise TimeoutError("consumer fell behind for good")
        rate = total / (time.perf_counter() - started)
        return rate, stream.gaps, stream.gaps_replayed
    finally:
        await kv.aclose()
        publisher.close()


def memory(blocks: int, replicas: int = 8) -> float:
    """Bytes the index holds per million blocks (each replica its own chains)."""
    rng = random.Random(3)
    per_event = 32
    tracemalloc.start()
    idx = KVEventIndex(BS, max_blocks=blocks)
    before = tracemalloc.get_traced_memory()[0]
    stored = 0
    counter = 0
    while stored < blocks:
        name = f"r{rng.randrange(replicas)}"
        hashes = tuple(rng.getrandbits(64) for _ in range(per_event))
        counter += 1
        tokens = tuple(rng.randrange(30_000) for _ in range(per_event * BS))
        idx.apply(name, decode_batch(encode_batch([Stored(tuple(h.to_bytes(8, "big") for h in hashes), None,
                                                          tokens, None)], BS)))
        stored += per_event
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert len(idx) == stored
    return used / stored * 1e6


def lookup(tokens: int, rounds: int) -> tuple[float, float]:
    """Per request: block keys + longest prefix over 8 replicas, each holding part of it (us p50, p99)."""
    rng = random.Random(tokens)
    ids = [rng.randrange(30_000) for _ in range(tokens)]
    kv = KVEvents(BS)
    for i in range(8):  # replica i holds the first i/8 of the prompt
        n = tokens * i // 8 // BS * BS
        if n:
            kv.index.apply(f"r{i}", decode_batch(encode_batch(
                [Stored(tuple(j.to_bytes(8, "big") for j in range(n // BS)), None, tuple(ids[:n]), None)], BS)))
    names = [f"r{i}" for i in range(8)]
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        keys = block_keys(ids, BS, "salt")
        kv.index.held(keys, names)
        times.append(time.perf_counter() - started)
    times.sort()
    return statistics.median(times) * 1e6, times[int(0.99 * (len(times) - 1))] * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.kv_events", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--batches", type=int, default=20_000)
    p.add_argument("--blocks-per-event", type=int, default=8)
    # tracemalloc slows every allocation: 200K blocks measure the per-block cost as well as 1M, in minutes less.
    p.add_argument("--memory-blocks", type=int, default=200_000)
    args = p.parse_args(argv)
    n = 2_000 if args.quick else args.batches
    raw = batches(n, args.blocks_per_event)
    payloads = [encode_batch(b, BS) for b in raw]
    events = sum(len(b) for b in raw)
    print(f"## throughput: {n:,} batches, {events:,} events ({args.blocks_per_event} blocks per BlockStored,"
          f" as many removals at steady state)")
    print(f"{'path':<44} {'events/s':>10} {'blocks/s':>10}  gaps (replayed)")
    per_event = (args.blocks_per_event * n + sum(len(b) - 1 for b in raw)) / events
    rate = in_process(payloads)
    print(f"{'decode + index, in process':<44} {rate:>10,.0f} {rate * per_event:>10,.0f}  -")
    rate, gaps, replayed = asyncio.run(over_zmq(raw))
    print(f"{'ZMQ PUB -> KVEvents (loopback, one loop)':<44} {rate:>10,.0f} {rate * per_event:>10,.0f}"
          f"  {gaps} ({replayed})")
    blocks = 100_000 if args.quick else args.memory_blocks
    per_million = memory(blocks)
    print(f"\n## memory: {blocks:,} blocks over 8 replicas: {per_million / 2**20:.0f} MiB per million blocks"
          f" ({per_million / 1e6:.0f} bytes per block)")
    print("\n## lookup per request (block keys + longest prefix on 8 replicas)")
    print(f"{'prompt tokens':>13} {'p50 us':>8} {'p99 us':>8}")
    for tokens in (1024, 4096, 16384):
        p50, p99 = lookup(tokens, 50 if args.quick else 400)
        print(f"{tokens:>13,} {p50:>8.0f} {p99:>8.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
