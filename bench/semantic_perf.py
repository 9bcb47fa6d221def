"""How fast is the semantic cache? Latency, index scaling, embedding throughput, memory.

Sections (``--only`` picks some):

* ``exact``    exact-tier hit latency through ``SemanticCache.lookup`` (no embedding);
* ``semantic`` semantic-tier hit and miss latency through ``SemanticCache.lookup``,
               real all-MiniLM-L6-v2, embedding included;
* ``index``    ``VectorIndex.search`` p50/p99 at 10K and 100K entries (1M with
               ``--million``): random unit vectors, dim 384, one partition;
* ``embed``    embedding throughput: one text per call vs micro-batched concurrent calls;
* ``memory``   bytes per entry: index (RSS delta) and Redis (``MEMORY USAGE``);
* ``servable`` store-to-servable latency: from an answer's completion to the
               moment an identical request (exact tier) and a paraphrase
               (semantic tier) can be served, at 1, 8 and 32 concurrent clients,
               in contexts already cached and in contexts seen for the first time.

``--redis-url`` runs the cache sections on Redis (default: in-process store).
``--gateway-url`` measures end to end through a running kvgate instead (an
OpenAI-compatible ``/v1/chat/completions``; the first request is a miss, the
repeats are exact hits, the paraphrases semantic hits).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import time
from collections import Counter
from typing import Any, Awaitable, Callable

import numpy as np

from semantic_cache import (CachedAnswer, HashEmbedder, LocalEmbedder, SemanticCache, SemanticCacheSettings,
                            StoreUnavailable, cache_request)
from semantic_cache.index import VectorIndex
from semantic_cache.settings import embedder_threads

QUESTIONS = [
    "How do I reset my router password?", "What are some tips for learning French?",
    "How can I make my laptop battery last longer?", "What is the capital city of Australia?",
    "How do I remove a stripped screw?",
    "What causes the northern lights?",
    "How do I clean a cast iron pan?", "Why is the sky blue?",
    "How do I export a spreadsheet to PDF?", "What is a good stretching routine for runners?",
]
PARAPHRASES = [
    "how can I reset my router password", "What are tips to learn French?",
    "How do I make my laptop's battery last longer?", "what is the capital city of australia",
    "how can I remove a stripped screw", "what causes the northern lights",
    "How can I clean a cast iron pan?", "why is the sky blue", "How can I export a spreadsheet to PDF?",
    "What is a good stretching routine for runners", ]


def pct(samples: list[float], q: float) -> float:
    return float(np.percentile(np.array(samples), q))


def row(name: str, samples_s: list[float]) -> str:
    ms = [x * 1000 for x in samples_s]
    return (f"{name:<44} n={len(ms):>6}  p50 {pct(ms, 50):8.3f} ms  p99 {pct(ms, 99):8.3f} ms  "
            f"mean {statistics.fmean(ms):8.3f} ms")


def req(namespace: str, text: str, s: SemanticCacheSettings, system: str = "Be brief."):  # type: ignore[no-untyped-def]
    body = {"model": "perf", "messages": [{"role": "system", "content": system},
                                          {"role": "user", "content": text}]}
    return cache_request("chat", namespace, body, {}, settings=s)


async def timed_many(fn: Callable[[], Awaitable[Any]], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        await fn()
        out.append(time.perf_counter() - t0)
    return out


async def bench_exact(args: argparse.Namespace) -> None:
    s = SemanticCacheSettings(enabled=True, embedder="hash", key_prefix="kvgate:sc:perf:")
    cache = await SemanticCache.open(s, args.redis_url)
    await cache.wait_ready(30)
    r = req("perf", QUESTIONS[0], s)
    await cache.store(r, CachedAnswer("answer", "stop", "perf"))
    await timed_many(lambda: cache.lookup(r), 200)  # warm-up
    samples = await timed_many(lambda: cache.lookup(r), args.n)
    print(row(f"exact hit ({'redis' if args.redis_url else 'memory'})", samples))
    await cache.purge(namespace="perf")
    await cache.aclose()
    await drop_log(args)


async def bench_semantic(args: argparse.Namespace, embedder: LocalEmbedder) -> None:
    s = SemanticCacheSettings(enabled=True, key_prefix="kvgate:sc:perf:")
    cache = await SemanticCache.open(s, args.redis_url, embedder=embedder)
    await cache.wait_ready(60)
    for q in QUESTIONS:
        await cache.store(req("perf", q, s), CachedAnswer("answer", "stop", "perf"))
    hits, misses, kinds = [], [], set()
    for i in range(args.n_semantic):
        para = PARAPHRASES[i % len(PARAPHRASES)]
        t0 = time.perf_counter()
        result = await cache.lookup(req("perf", para, s))
        hits.append(time.perf_counter() - t0)
        kinds.add((result.status, result.tier))
        t0 = time.perf_counter()
        await cache.lookup(req("perf", f"Completely unrelated question number {i} about gardening?", s))
        misses.append(time.perf_counter() - t0)
    print(row(f"semantic hit, embedding included {sorted(kinds)}", hits))
    print(row("semantic miss, embedding included", misses))
    await cache.purge(namespace="perf")
    await cache.aclose()
    await drop_log(args)


async def drop_log(args: argparse.Namespace, prefix: str = "kvgate:sc:perf:") -> None:
    """The change log outlives a purge (other instances may still be reading it); a bench cleans it."""
    if args.redis_url:
        import redis.asyncio as aioredis

        client = aioredis.Redis.from_url(args.redis_url)
        await client.delete(f"{prefix}log")
        await client.aclose()


def control_tail(args: argparse.Namespace) -> None:
    """The machine's own tail: a fixed ~0.2 ms of CPU work, timed like a search."""
    a = np.random.default_rng(1).normal(size=(2000, 384)).astype(np.float32)
    v = a[0]
    samples = []
    for _ in range(args.n):
        t0 = time.perf_counter()
        _ = a @ v
        samples.append(time.perf_counter() - t0)
    print(row("control: fixed CPU work (2000x384 matvec)", samples) + f"  load avg {os.getloadavg()[0]:.2f}")


def bench_index(args: argparse.Namespace) -> None:
    control_tail(args)
    sizes = [10_000, 100_000] + ([1_000_000] if args.million else [])
    rng = np.random.default_rng(0)
    for n in sizes:
        vecs = rng.normal(size=(n, 384)).astype(np.float32)
        vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
        index = VectorIndex()
        rss0 = rss_bytes()
        t0 = time.perf_counter()
        index.add_many("p", [f"id{i}" for i in range(n)], vecs, [""] * n)
        build = time.perf_counter() - t0
        per_entry = (rss_bytes() - rss0) / n
        queries = rng.normal(size=(args.n, 384)).astype(np.float32)
        queries /= np.linalg.norm(queries, axis=1, keepdims=True)
        samples = []
        for q in queries:
            t0 = time.perf_counter()
            index.search("p", q, 3, 0.0)
            samples.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for i in range(200):
            index.add("p", f"extra{i}", queries[i % len(queries)], "")
        add_ms = (time.perf_counter() - t0) / 200 * 1000
        print(row(f"index search k=3 @ {n:,}", samples)
              + f"  build {build:6.1f}s  add {add_ms:.3f} ms  ~{per_entry:,.0f} B/entry (RSS)")
        del index, vecs


async def bench_embed(args: argparse.Namespace, embedder: LocalEmbedder) -> None:
    texts = [f"{QUESTIONS[i % len(QUESTIONS)]} (variant {i})" for i in range(args.n_embed)]
    t0 = time.perf_counter()
    for t in texts:
        await embedder.embed([t])
    single = time.perf_counter() - t0
    batches0 = embedder.batcher.batches
    t0 = time.perf_counter()
    await asyncio.gather(*[embedder.embed([t]) for t in texts])
    batched = time.perf_counter() - t0
    nb = embedder.batcher.batches - batches0
    print(f"{'embedding, one call at a time':<44} {len(texts) / single:8.0f} texts/s")
    print(f"{'embedding, concurrent calls micro-batched':<44} {len(texts) / batched:8.0f} texts/s "
          f"({nb} batches, mean {len(texts) / max(nb, 1):.1f} texts/batch)")


async def bench_memory(args: argparse.Namespace) -> None:
    if not args.redis_url:
        print("redis bytes/entry: skipped (no --redis-url)")
        return
    import redis.asyncio as aioredis

    s = SemanticCacheSettings(enabled=True, key_prefix="kvgate:sc:perfmem:")
    cache = await SemanticCache.open(s, args.redis_url, embedder=HashEmbedder(dim=384))  # MiniLM's size
    await cache.wait_ready(30)
    r = req("perfmem", QUESTIONS[0], s)
    answer = CachedAnswer("A typical answer of a few sentences. " * 8, "stop", "perf", 40, 80, 1)
    await cache.store(r, answer)
    client = aioredis.Redis.from_url(args.redis_url)
    usage = await client.memory_usage(f"kvgate:sc:perfmem:e:{r.exact_key}", samples=0)
    print(f"{'redis bytes per entry (384-d vector, ' + str(len(answer.content)) + '-char answer)':<44} "
          f"{usage:8,} B")
    await cache.purge(namespace="perfmem")
    await cache.aclose()
    await client.delete("kvgate:sc:perfmem:log")
    await client.aclose()


async def bench_gateway(args: argparse.Namespace) -> None:
    import httpx

    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    seen: dict[str, int] = {}
    async with httpx.AsyncClient(base_url=args.gateway_url, headers=headers, timeout=60) as client:
        async def ask(text: str) -> None:
            # No max_tokens: only answers that end with "stop" are stored (a cut-off one never is).
            body = {"model": args.model, "messages": [{"role": "user", "content": text}]}
            resp = await client.post("/v1/chat/completions", json=body)
            resp.raise_for_status()
            status = resp.headers.get("x-kvgate-cache", "-")
            seen[status] = seen.get(status, 0) + 1

        for q in QUESTIONS:
            await ask(q)  # misses: fill the cache
        await asyncio.sleep(1.0)  # stores happen after the response; let them land
        seen.clear()
        exact = await timed_many(lambda: ask(QUESTIONS[0]), args.n_semantic)
        exact_seen = dict(seen)
        seen.clear()
        para = [PARAPHRASES[i % len(PARAPHRASES)] for i in range(args.n_semantic)]
        it = iter(para)
        semantic = await timed_many(lambda: ask(next(it)), len(para))
    print(row(f"gateway end to end, exact {exact_seen}", exact))
    print(row(f"gateway end to end, paraphrases {seen}", semantic))
    for clients in (1, 8):
        await gateway_servable(args, clients)


async def gateway_servable(args: argparse.Namespace, clients: int, rounds: int = 6,
                           after_s: float = 0.05) -> None:
    """What a user sees: each question in a context seen for the first time, then at once
    the identical question, then its paraphrase ``after_s`` after the answer arrived."""
    import uuid

    import httpx

    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    served: Counter[str] = Counter()
    run = uuid.uuid4().hex[:8]
    async with httpx.AsyncClient(base_url=args.gateway_url, headers=headers, timeout=60) as client:
        async def ask(system: str, text: str, stream: bool) -> str:
            body = {"model": args.model, "stream": stream,
                    "messages": [{"role": "system", "content": system}, {"role": "user", "content": text}]}
            async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
                resp.raise_for_status()
                async for _ in resp.aiter_bytes():
                    pass  # to the last byte, as a client does
                return resp.headers.get("x-kvgate-cache", "-")

        async def user(c: int) -> None:
            for i in range(rounds):
                k, stream = (c * rounds + i) % len(QUESTIONS), bool(i % 2)
                system = f"You are assistant {run}-{c}-{i}."
                await ask(system, QUESTIONS[k], stream)
                done = time.perf_counter()
                # (Never ``served[k] += await ...``: the read before the await loses updates.)
                identical = await ask(system, QUESTIONS[k], stream) == "hit"
                await asyncio.sleep(max(0.0, after_s - (time.perf_counter() - done)))
                paraphrase = await ask(system, PARAPHRASES[k], stream) == "hit"
                served["identical"] += identical
                served["paraphrase"] += paraphrase

        await asyncio.gather(*[user(c) for c in range(clients)])
    n = clients * rounds
    print(f"{'gateway, new contexts, ' + str(clients) + ' clients':<44} identical repeat at once: hit "
          f"{served['identical']}/{n}; paraphrase {after_s * 1000:.0f} ms after the answer: hit "
          f"{served['paraphrase']}/{n}")


async def store_as_gateway(cache: SemanticCache, r: Any, answer: CachedAnswer, lookup: Any) -> tuple[float, float]:
    """Store an answer the way kvgate's response path does; seconds until the exact
    tier, then the semantic tier, can serve it."""
    t0 = time.perf_counter()
    store_exact = getattr(cache, "store_exact", None)
    if store_exact is None:
        # kvgate before store_exact (main at 1714303): one background task embedded the
        # query again, then wrote the entry; both tiers became servable at its end.
        await asyncio.ensure_future(cache.store(r, answer))
        done = time.perf_counter() - t0
        return done, done
    stored = await store_exact(r, answer, lookup.embedding)
    exact = time.perf_counter() - t0
    if not isinstance(stored, bool):  # the vector was not ready for the first write
        await cache.store_vector(stored)
    return exact, time.perf_counter() - t0


def batching(cache: SemanticCache) -> tuple[int, int, int, int, int]:
    """(model calls, texts embedded, Redis write round trips, writes, change-log reads) so
    far; zeros where the cache does not count them (kvgate before batched writes)."""
    st = cache.stats()
    return (st.get("embed_batches", 0), st.get("embedded_texts", 0), st.get("redis_write_batches", 0),
            st.get("redis_writes", 0), st.get("sync", {}).get("log_reads", 0))


def per_batch(before: tuple[int, ...], after: tuple[int, ...], calls: int, items: int) -> str:
    n_calls, n_items = after[calls] - before[calls], after[items] - before[items]
    return f"{n_items / n_calls:.1f}" if n_calls else "-"


async def servable_row(args: argparse.Namespace, embedder: LocalEmbedder, clients: int, fresh: bool) -> None:
    # A prefix of its own: the run purges everything it stored, and nothing else.
    s = SemanticCacheSettings(enabled=True, key_prefix=f"kvgate:sc:perf-{os.getpid()}:")
    cache = await SemanticCache.open(s, args.redis_url, embedder=embedder)
    await cache.wait_ready(60)
    rounds = max(1, args.n_servable // clients)
    answer = CachedAnswer("answer", "stop", "perf")

    def in_context(c: int, i: int, text: str):  # type: ignore[no-untyped-def]
        return req("perf", text, s, system=f"You are assistant {c}-{i} for {'new' if fresh else 'old'} users.")

    def asked(c: int, i: int, texts: list[str]) -> str:
        # Every stored question distinct (its own ticket number, in the paraphrase too): two
        # clients asking the same text at once would share one embedding and flatter the row.
        return f"{texts[(c * rounds + i) % len(texts)]} (ticket {c * rounds + i})"

    if not fresh:  # contexts already cached: each holds one other answer
        for c in range(clients):
            for i in range(rounds):
                await cache.store(in_context(c, i, f"Unrelated question number {i} about gardening?"), answer)
    exact_s: list[float] = []
    semantic_s: list[float] = []
    served: Counter[str] = Counter()
    counts0 = batching(cache)

    async def client(c: int) -> None:
        for i in range(rounds):
            r = in_context(c, i, asked(c, i, QUESTIONS))
            lookup = await cache.lookup(r)  # a miss: the request goes upstream
            if args.gen_ms:
                await asyncio.sleep(args.gen_ms / 1000)
            exact, semantic = await store_as_gateway(cache, r, answer, lookup)
            exact_s.append(exact)
            semantic_s.append(semantic)

    await asyncio.gather(*[client(c) for c in range(clients)])
    counts = batching(cache)
    # Then check every answer is served, by both tiers (after the timing: these lookups
    # embed too, and would load the embedder the timed stores wait for).
    for c in range(clients):
        for i in range(rounds):
            served["exact"] += (await cache.lookup(in_context(c, i, asked(c, i, QUESTIONS)))).tier == "exact"
            para = await cache.lookup(in_context(c, i, asked(c, i, PARAPHRASES)))
            served["semantic" if para.tier == "semantic" else f"miss:{para.reason}"] += 1
    n = len(exact_s)
    where = f"{'new' if fresh else 'cached'} contexts, {clients:>2} clients"
    # Change-log reads per write: each is a socket write on the loop the stores share.
    reads = (f"  log reads/write {(counts[4] - counts0[4]) / max(counts[3] - counts0[3], 1):.2f}"
             if args.redis_url else "")
    print(row(f"store-to-servable exact, {where}", exact_s) + f"  served {served['exact']}/{n}"
          f"  writes/round trip {per_batch(counts0, counts, 2, 3)}{reads}")
    misses = " ".join(f"{k} {v}" for k, v in sorted(served.items()) if k.startswith("miss:"))
    print(row(f"store-to-servable semantic, {where}", semantic_s) + f"  served {served['semantic']}/{n}"
          f"  texts/model call {per_batch(counts0, counts, 0, 1)} {misses}")
    await purge_when_healthy(cache)
    await cache.aclose()
    await drop_log(args, s.key_prefix)


async def purge_when_healthy(cache: SemanticCache, within_s: float = 10.0) -> None:
    """A row that overloaded Redis opens the breaker (its rows then say store_degraded); the
    next row still starts clean: purge once the probe has closed it again."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            await cache.purge(namespace="perf")
            return
        except StoreUnavailable:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def redis_control(args: argparse.Namespace) -> None:
    """The machine's Redis round trip (PING), timed like a write: an exact-tier store is one."""
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(args.redis_url)
    await client.ping()
    samples = await timed_many(client.ping, 1000)
    await client.aclose()
    print(row("control: Redis round trip (PING)", samples))


async def bench_servable(args: argparse.Namespace, embedder: LocalEmbedder) -> None:
    print(f"store-to-servable on {'Redis' if args.redis_url else 'the in-process store'}, "
          f"generation {args.gen_ms:g} ms, load avg {os.getloadavg()[0]:.2f}")
    if args.redis_url:
        await redis_control(args)
    # The embedding every semantic row waits for in new contexts, alone: scales the rows
    # to this machine's load (all-MiniLM-L6-v2, one text, nothing else queued).
    samples = await timed_many(lambda: embedder.embed(["How do I reset my router password?"]), 50)
    print(row("control: one embedding, nothing else queued", samples))
    for fresh in (False, True):
        for clients in (int(c) for c in args.clients.split(",")):
            await servable_row(args, embedder, clients, fresh)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def run(args: argparse.Namespace) -> None:
    only = set(args.only.split(",")) if args.only else {"exact", "semantic", "index", "embed", "memory",
                                                          "servable"}
    print(f"cores {os.cpu_count()}, peak RSS so far {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024} MB")
    if args.gateway_url:
        await bench_gateway(args)
        return
    if "exact" in only:
        await bench_exact(args)
    embedder = None
    if only & {"semantic", "embed", "servable"}:
        torch_threads, ort_threads = embedder_threads(args.threads)
        embedder = LocalEmbedder(batch_max=32, threads=torch_threads, ort_threads=ort_threads,
                                 fast=not args.no_fast)
        await embedder.start()
    if "semantic" in only and embedder is not None:
        await bench_semantic(args, embedder)
    if "embed" in only and embedder is not None:
        await bench_embed(args, embedder)
    if "servable" in only and embedder is not None:
        await bench_servable(args, embedder)
    if embedder is not None:
        await embedder.aclose()
    if "memory" in only:
        await bench_memory(args)
    if "index" in only:
        bench_index(args)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis-url", help="run the cache on this Redis (default: in-process store)")
    parser.add_argument("--only", help="comma-separated sections: exact,semantic,index,embed,memory,servable")
    parser.add_argument("--n", type=int, default=5000, help="samples for exact and index latency")
    parser.add_argument("--n-semantic", type=int, default=300, help="samples for semantic latency")
    parser.add_argument("--n-embed", type=int, default=512, help="texts for the throughput test")
    parser.add_argument("--n-servable", type=int, default=96, help="answers stored per servable row")
    parser.add_argument("--clients", default="1,8,32", help="concurrent clients for the servable rows")
    parser.add_argument("--gen-ms", type=float, default=0.0,
                        help="servable: upstream generation time between lookup and answer (0: the worst case)")
    parser.add_argument("--million", action="store_true", help="also build a 1M-entry index (minutes, ~2.5 GB)")
    parser.add_argument("--threads", type=int, default=SemanticCacheSettings().embed_threads,
                        help="threads for the model (default: the embed_threads setting's, one per core)")
    parser.add_argument("--no-fast", action="store_true",
                        help="run the model through SentenceTransformer.encode (embed_fast=false)")
    parser.add_argument("--gateway-url", help="measure end to end through a running kvgate instead")
    parser.add_argument("--api-key", help="tenant key for --gateway-url")
    parser.add_argument("--model", default="perf", help="model name for --gateway-url")
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
