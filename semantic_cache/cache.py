"""The cache facade the gateway calls: lookup, store, purge, stats.

Lookup order, cheapest first:

1. bypass (decided purely by ``cache_request``);
2. exact tier: one store read by the exact key, no embedding;
3. semantic tier, only if this partition has vectors or one on its way (a new
   conversation only starts the embedding its store will need): embed the
   normalised query (micro-batched, in a worker thread), search this
   partition's index, and offer the best candidates above ``threshold`` to the
   verifier; the first it accepts is re-read from the store and served.

Store order, so an answer is servable as soon as possible:

1. ``store_exact`` writes the entry, awaited by the response path before the
   client's final bytes: an identical request sent the moment they arrive is an
   exact hit. It never waits for an embedding: the vector goes in this first
   write only if it is ready already (the lookup's, reused);
2. ``store_vector`` (in the background) waits for the embedding the lookup
   computed or started, never a second one of the same text, adds the vector to
   the stored entry and indexes it: the semantic tier serves it from then on.
   A lookup in a partition seen for the first time has nothing to search, so it
   starts the embedding without waiting for it; it runs while the replica
   generates and is usually ready before the answer is. A paraphrase that
   arrives while that vector is still on its way waits for it (``inflight``).

Contract: ``lookup`` and ``store`` never raise (task cancellation aside). A
store fault, a hung Redis, an embedder error or a bug in here becomes a miss
(or ``False``), counted in ``stats()``; the caller's request goes on upstream.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Callable

import httpx
import numpy as np

from .embedder import Embedder, EmbedderError, HashEmbedder, LocalEmbedder, RemoteEmbedder
from .index import VectorIndex
from .inflight import Inflight
from .models import CachedAnswer, CacheRequest, Entry, Lookup
from .normalize import embedding_text
from .redis_store import RedisStore
from .settings import SemanticCacheSettings, embedder_threads
from .store import MemoryStore, PurgeFilter, Store, StoreUnavailable
from .sync import IndexSync
from .verifier import Verifier

log = logging.getLogger("kvgate.semantic_cache")


@dataclass(frozen=True)
class PendingVector:
    """An entry stored for the exact tier whose embedding is still being computed."""

    entry: Entry
    embedding: "asyncio.Future[Any]"


def make_embedder(settings: SemanticCacheSettings, http_client: httpx.AsyncClient | None,
                  loader: Callable[[], Any] | None = None, workers: int = 1) -> Embedder:
    """``loader`` replaces the packaged model's loader (the seam for a slow or failing load);
    ``workers``: the kvgate processes on this machine, each with its own model."""
    if settings.embedder == "hash":
        return HashEmbedder()
    if settings.embedder == "remote":
        if not settings.embedding_url or http_client is None:
            raise ValueError("semantic_cache.embedder=remote needs embedding_url and an HTTP client")
        return RemoteEmbedder(http_client, settings.embedding_url, settings.embedding_model,
                              batch_max=settings.batch_max, timeout_s=settings.embed_timeout_s)
    extra = {"loader": loader} if loader is not None else {}
    torch_threads, ort_threads = embedder_threads(settings.embed_threads, workers)
    return LocalEmbedder(batch_max=settings.batch_max, name=settings.embedding_model, threads=torch_threads,
                         ort_threads=ort_threads, fast=settings.embed_fast, **extra)


class SemanticCache:
    """Two-tier response cache; build it with ``await SemanticCache.open(...)``."""

    def __init__(self, settings: SemanticCacheSettings, store: Store, embedder: Embedder, *,
                 owns_embedder: bool = True, owned_client: httpx.AsyncClient | None = None) -> None:
        self.settings = settings
        self._store = store
        self._embedder = embedder
        self._owns_embedder = owns_embedder
        self._owned_client = owned_client
        self._index = VectorIndex(m=settings.hnsw_m, ef_construction=settings.hnsw_ef_construction,
                                  ef_search=settings.hnsw_ef_search, brute_force_max=settings.brute_force_max)
        self._verifier = Verifier() if settings.verifier else None
        self._known: dict[str, str] = {}  # entry id -> namespace (exact-only entries too)
        self._ns_counts: Counter[str] = Counter()
        self._sync: IndexSync | None = None
        self._embedder_task: asyncio.Task[None] | None = None
        self._embedder_error: str | None = None
        self._opened_at = time.time()
        self._ready_at: float | None = None  # when the semantic tier could first serve
        self._ready_task: asyncio.Task[None] | None = None
        self._embeddings: set[asyncio.Task[Any]] = set()  # started by lookups, awaited by stores
        self._inflight = Inflight()
        self.counters: dict[str, Counter[str]] = {
            k: Counter() for k in ("lookups", "miss", "bypass", "rejected", "stores", "refused")}

    @classmethod
    async def open(cls, settings: SemanticCacheSettings, redis_url: str | None, redis_timeout_s: float = 0.25,
                   *, embedder: Embedder | None = None,
                   http_client: httpx.AsyncClient | None = None,
                   connect: Callable[[float, float], Any] | None = None,
                   loader: Callable[[], Any] | None = None, workers: int = 1) -> "SemanticCache":
        """Start the cache. Never fails because Redis is down: it starts degraded and
        reconnects by itself. The embedding model loads in the background; until it
        is ready the semantic tier is skipped (``wait_ready`` waits for it).
        ``connect`` builds the Redis clients (``RedisStore``), e.g. for a cluster; ``loader``
        loads the local model instead of the packaged loader; ``workers`` (kvgate processes
        on this machine) shares the cores among their models."""
        owned = None
        owns_embedder = embedder is None  # an injected embedder stays its owner's to close
        if embedder is None and settings.embedder == "remote" and http_client is None:
            http_client = owned = httpx.AsyncClient()
        embedder = embedder or make_embedder(settings, http_client, loader, workers)
        store: Store
        instance_id = secrets.token_hex(8)
        if redis_url:
            store = RedisStore(redis_url, timeout_s=redis_timeout_s, prefix=settings.key_prefix,
                               ttl_s=settings.ttl_s, embedder=embedder.name,
                               stream_maxlen=settings.stream_maxlen, sync_block_ms=settings.sync_block_ms,
                               probe_interval_s=settings.probe_interval_s, instance_id=instance_id,
                               max_connections=settings.redis_max_connections,
                               breaker_failures=settings.breaker_failures, connect=connect)
        else:
            store = MemoryStore()
        cache = cls(settings, store, embedder, owns_embedder=owns_embedder, owned_client=owned)
        cache._embedder_task = asyncio.get_running_loop().create_task(cache._start_embedder())
        if isinstance(store, RedisStore):
            if not await store.start():
                log.warning("semantic cache: Redis unavailable at start-up; running degraded")
            cache._sync = IndexSync(store, cache, instance_id=instance_id,
                                    resync_interval_s=settings.resync_interval_s,
                                    interval_s=settings.sync_interval_ms / 1000,
                                    retry_s=settings.probe_interval_s)
            cache._sync.start()
        cache._ready_task = asyncio.get_running_loop().create_task(cache._note_ready())
        return cache

    async def _note_ready(self) -> None:
        while not await self.wait_ready(3600):
            if self._embedder_error is not None:
                return
        self._ready_at = time.time()

    async def _start_embedder(self) -> None:
        try:
            await self._embedder.start()
        except EmbedderError as exc:
            self._embedder_error = str(exc)
            log.error("semantic cache: embedder unavailable, exact tier only: %s", exc)

    async def wait_ready(self, timeout_s: float = 60.0) -> bool:
        """Wait for the embedder and the first index sync (tests, benchmarks, readiness)."""
        try:
            async with asyncio.timeout(timeout_s):
                if self._embedder_task is not None:
                    await asyncio.shield(self._embedder_task)
                if self._sync is not None:
                    await self._sync.synced.wait()
        except TimeoutError:
            return False
        return self._embedder.ready

    @property
    def healthy(self) -> bool:
        return self._store.healthy

    def readiness(self) -> list[str]:
        """Why the semantic tier cannot serve yet (empty: it can, or it is switched off)."""
        if not self.settings.semantic_enabled:
            return []
        if self._embedder_error is not None:
            return [f"semantic cache: embedding model failed to load, exact tier only: {self._embedder_error}"]
        if not self._embedder.ready:
            return ["semantic cache: embedding model loading"]
        if self._sync is not None and not self._sync.synced.is_set() and self._store.healthy:
            return ["semantic cache: index loading from Redis"]
        return []

    async def settled(self) -> None:
        """Wait until every stored answer's vector is written and indexed (tests, benchmarks)."""
        await self._inflight.idle()

    # ---- catalog: what this instance knows is in the store (IndexSink) ----

    def known_ids(self) -> dict[str, str]:
        return dict(self._known)

    def remember(self, entry: Entry) -> None:
        if entry.id not in self._known:
            self._ns_counts[entry.namespace] += 1
        self._known[entry.id] = entry.namespace
        if entry.vector is not None and entry.endpoint and entry.query:
            try:
                self._index.add(entry.partition, entry.id, entry.vector, entry.query)
            except ValueError:  # a vector of another dimension (embedder changed): exact tier only
                self._index.remove(entry.id)
        else:
            self._index.remove(entry.id)

    async def remember_many(self, entries: list[Entry]) -> None:
        """Catalog and index many entries (a rebuild); big new partitions are built as one
        graph in a worker thread instead of entry by entry on the event loop."""
        by_partition: dict[str, list[Entry]] = {}
        for entry in entries:
            by_partition.setdefault(entry.partition, []).append(entry)
        for partition, group in by_partition.items():
            bulk = [e for e in group if e.vector is not None and e.id not in self._known]
            if len(bulk) <= self.settings.brute_force_max or self._index.has_partition(partition):
                for entry in group:
                    self.remember(entry)
                continue
            for entry in group:
                if entry.id not in self._known:
                    self._ns_counts[entry.namespace] += 1
                self._known[entry.id] = entry.namespace
            try:
                vectors = np.stack([e.vector for e in bulk if e.vector is not None])
                await asyncio.to_thread(self._index.add_many, partition, [e.id for e in bulk], vectors,
                                        [e.query for e in bulk])
            except ValueError:  # mixed dimensions (embedder changed): one by one
                for entry in bulk:
                    self.remember(entry)

    def forget(self, entry_id: str) -> None:
        ns = self._known.pop(entry_id, None)
        if ns is not None:
            self._ns_counts[ns] -= 1
            if self._ns_counts[ns] <= 0:
                del self._ns_counts[ns]
        self._index.remove(entry_id)

    # ---- lookup ----

    async def lookup(self, req: CacheRequest) -> Lookup:
        """Exact tier, then semantic tier. Never raises: any fault is a miss."""
        try:
            result = await self._lookup(req)
        except StoreUnavailable:
            result = Lookup("miss", reason="store_unavailable")
        except Exception:  # the contract: a cache bug must not fail the request
            log.exception("semantic cache lookup failed")
            result = Lookup("miss", reason="error")
        key = result.status if result.status != "hit" else f"hit_{result.tier}"
        self.counters["lookups"][key] += 1
        if result.status in ("miss", "bypass") and result.reason:
            self.counters[result.status][result.reason] += 1
        return result

    async def _lookup(self, req: CacheRequest) -> Lookup:
        if req.bypass_reason is not None:
            return Lookup("bypass", reason=req.bypass_reason)
        if not self._store.healthy:
            return Lookup("miss", reason="store_degraded")
        entry = await self._store.get(req.exact_key, req.namespace)
        if entry is not None and self._same_partition(entry, req):
            return Lookup("hit", answer=entry.answer, similarity=1.0, tier="exact")
        if not req.semantic:
            return Lookup("miss", reason="no_exact_match")
        partition_known = self._index.has_partition(req.partition)
        if not partition_known and not (self._inflight.pending(req.partition) and self._embedder.ready):
            # Nothing to search, but the answer will be stored: start its embedding now,
            # while the replica generates, and hand it to the store (never embed it twice).
            return Lookup("miss", reason="empty_partition", embedding=self._embed_soon(req.query))
        embedding = self._embed_soon(req.query)
        if embedding is None:
            return Lookup("miss", reason="embedder_not_ready")
        # Bounded for the first token's sake; a busy model keeps embedding past the bound
        # for the store, which would otherwise embed the same text a second time.
        await asyncio.wait({embedding}, timeout=self.settings.embed_timeout_s)
        if not embedding.done():
            return Lookup("miss", reason="embedder_timeout", embedding=embedding)
        vector = embedding.result()
        if vector is None:
            return Lookup("miss", reason="embedder_error")
        if not partition_known:
            # A first answer of this context waits for its vector, queued before ours:
            # wait for it too, and a paraphrase asked right after that answer is served.
            await self._inflight.wait(req.partition, self.settings.embed_timeout_s)
        result = await self._semantic(req, vector)
        return replace(result, embedding=vector) if result.status == "miss" else result

    async def _semantic(self, req: CacheRequest, vector: Any) -> Lookup:
        s = self.settings
        hits = self._index.search(req.partition, vector, s.candidates, s.threshold)
        if not hits:
            return Lookup("miss", reason="below_threshold")
        first_reason = None
        for hit in hits:
            if self._verifier is not None:
                verdict = self._verifier.check(req.query, hit.query, hit.similarity)
                if not verdict.ok:
                    self.counters["rejected"][verdict.reason or "?"] += 1
                    first_reason = first_reason or f"verifier:{verdict.reason}"
                    continue
            entry = await self._store.get(hit.id, req.namespace)
            if entry is None:
                self.forget(hit.id)  # expired or deleted since the last sync
                continue
            if self._same_partition(entry, req):
                return Lookup("hit", answer=entry.answer, similarity=hit.similarity, tier="semantic")
        return Lookup("miss", reason=first_reason or "candidate_gone", similarity=hits[0].similarity)

    @staticmethod
    def _same_partition(entry: Entry, req: CacheRequest) -> bool:
        # The keys already separate these; re-checking the stored fields means a bug or a
        # hash collision elsewhere still cannot serve another tenant's or model's answer.
        return (entry.partition == req.partition and entry.namespace == req.namespace
                and entry.model == req.model and entry.endpoint == req.endpoint)

    async def _embed(self, query: str, timeout_s: float | None = None) -> Any:
        try:
            async with asyncio.timeout(timeout_s or self.settings.embed_timeout_s):
                return (await self._embedder.embed([embedding_text(query)]))[0]
        except (EmbedderError, TimeoutError):
            return None

    async def _embed_quietly(self, query: str) -> Any:
        try:
            # No first token waits on this one (only the vector write does): a busy
            # embedder gets ten times the lookup's bound before the entry stays exact-only.
            return await self._embed(query, 10 * self.settings.embed_timeout_s)
        except Exception:  # nobody may ever await this task: a fault must not go unretrieved
            log.exception("semantic cache embedding failed")
            return None

    def _embed_soon(self, query: str) -> "asyncio.Task[Any] | None":
        """The query's embedding, started now and awaited later (None: no embedder)."""
        if not self._embedder.ready:
            return None
        task = asyncio.get_running_loop().create_task(self._embed_quietly(query))
        self._embeddings.add(task)
        task.add_done_callback(self._embeddings.discard)
        return task

    # ---- store ----

    def refusal(self, req: CacheRequest, answer: CachedAnswer) -> str | None:
        """Why this answer must not be stored, or None. Pure."""
        if not req.store_ok:
            return f"bypass:{req.bypass_reason}"
        if answer.tool_calls:
            if not self.settings.cache_tool_calls:
                return "tool_calls"
            if answer.finish_reason not in ("tool_calls", "stop"):
                return f"finish_reason:{answer.finish_reason}"
            return None
        # Only "stop": "length" is a cut-off answer (degenerate generations end there) and
        # "content_filter", errors or None are not answers one would want served again.
        if answer.finish_reason != "stop":
            return f"finish_reason:{answer.finish_reason}"
        if not answer.content.strip():
            return "empty"
        if len(answer.content) > self.settings.max_answer_chars:
            return "too_large"
        return None

    async def store(self, req: CacheRequest, answer: CachedAnswer, embedding: Any = None) -> bool:
        """``store_exact`` then ``store_vector``, both awaited. Never raises; False when
        refused or failed (a failed vector still leaves the exact-tier entry)."""
        stored = await self.store_exact(req, answer, embedding)
        if isinstance(stored, PendingVector):
            return await self.store_vector(stored)
        return stored

    async def store_exact(self, req: CacheRequest, answer: CachedAnswer,
                          embedding: Any = None) -> "PendingVector | bool":
        """Store a complete, successful answer for the exact tier at once; with its vector
        only if ``embedding`` (what ``Lookup.embedding`` carried) is ready already.

        Returns False (refused or failed), True (stored, nothing left to do) or what
        ``store_vector`` must finish for the semantic tier. Never raises, never waits
        for an embedding."""
        try:
            reason = self.refusal(req, answer)
            if reason is not None:
                self.counters["refused"][reason] += 1
                return False
            if not self._store.healthy:
                self.counters["stores"]["failed:store_degraded"] += 1
                return False
            vector, later = self._vector_now(req, embedding)
            now = time.time()
            entry = Entry(id=req.exact_key, namespace=req.namespace, model=req.model,
                          partition=req.partition, endpoint=req.endpoint, query=req.query, answer=answer,
                          created=now, expires_at=now + self.settings.ttl_s, vector=vector)
            evicted = await self._store.put(entry, self.settings.max_entries_per_namespace)
            for entry_id in evicted:
                self.forget(entry_id)
            self.counters["stores"]["evicted"] += len(evicted)
            self.remember(entry)
            self.counters["stores"]["ok"] += 1
            if later is None:
                return True
            self._inflight.add(entry.partition)
            return PendingVector(entry, later)
        except StoreUnavailable:
            self.counters["stores"]["failed:store_unavailable"] += 1
        except Exception:
            log.exception("semantic cache store failed")
            self.counters["stores"]["failed:error"] += 1
        return False

    def _vector_now(self, req: CacheRequest, embedding: Any) -> tuple[Any, "asyncio.Future[Any] | None"]:
        """(the vector if ready, else the embedding still to wait for)."""
        if not req.semantic:
            return None, None
        if isinstance(embedding, asyncio.Future):
            if not embedding.done():
                return None, embedding
            failed = embedding.cancelled() or embedding.exception() is not None
            embedding = None if failed else embedding.result()
            if embedding is not None:
                return embedding, None
        elif embedding is not None:
            return embedding, None
        return None, self._embed_soon(req.query)  # no usable embedding from the lookup

    async def store_vector(self, pending: PendingVector) -> bool:
        """Add the vector to an entry ``store_exact`` wrote, then index it. Never raises;
        False when there is no vector or the entry is gone (expired, evicted, purged)."""
        try:
            vector = await pending.embedding
            if vector is None:
                self.counters["stores"]["vector_failed:embedder"] += 1
                return False
            entry = replace(pending.entry, vector=vector)
            if not await self._store.set_vector(entry):
                # Replaced (the same request stored again: its own vector follows), expired,
                # evicted or purged meanwhile: nothing to add to, and nothing went wrong.
                self.counters["stores"]["vector_dropped"] += 1
                return False
            if entry.id in self._known:  # not forgotten (purged, evicted) meanwhile
                self.remember(entry)
            self.counters["stores"]["vector_ok"] += 1
            return True
        except StoreUnavailable:
            self.counters["stores"]["vector_failed:store_unavailable"] += 1
        except Exception:
            log.exception("semantic cache vector store failed")
            self.counters["stores"]["vector_failed:error"] += 1
        finally:
            self._inflight.done(pending.entry.partition)
        return False

    # ---- admin ----

    async def purge(self, *, namespace: str | None = None, model: str | None = None,
                    older_than_s: float | None = None) -> int:
        """Delete matching entries everywhere; returns how many. Unlike lookup/store this
        raises ``StoreUnavailable`` when Redis is down: an operator must know it failed."""
        ids = await self._store.purge(PurgeFilter(namespace, model, older_than_s))
        for entry_id in ids:
            self.forget(entry_id)
        return len(ids)

    def stats(self) -> dict[str, Any]:
        redis = isinstance(self._store, RedisStore)
        out: dict[str, Any] = {
            "backend": "redis" if redis else "memory",
            "redis": ("ok" if self._store.healthy else "degraded") if redis else "none",
            "healthy": self.healthy,
            "embedder": self._embedder.name,
            "embedder_ready": self._embedder.ready,
            "embedder_error": self._embedder_error,
            # When the semantic tier could first serve (unix time; None while loading).
            "ready_at": self._ready_at,
            "ready_after_s": round(self._ready_at - self._opened_at, 3) if self._ready_at else None,
            "vectors_pending": len(self._inflight),
            "threshold": self.settings.threshold,
            "verifier": self._verifier is not None,
            "entries": dict(self._ns_counts),
            "indexed_vectors": len(self._index),
            "partitions": self._index.partitions,
            "index_bytes": self._index.memory_bytes(),
            **{k: dict(v) for k, v in self.counters.items()},
        }
        if isinstance(self._store, RedisStore):
            out["breaker_trips"] = self._store.breaker.trips
            out["redis_last_error"] = self._store.breaker.last_error or None
            # Writes per pipelined round trip (batching.Batcher): 1.0 when idle, more under load.
            out["redis_write_batches"], out["redis_writes"] = self._store.writes.batches, self._store.writes.items
        if self._sync is not None:
            out["sync"] = {"resyncs": self._sync.resyncs, "events": self._sync.events_applied,
                           "log_reads": self._sync.reads, "redis_data_lost": self._sync.lost,
                           "last_sync": self._sync.last_sync}
        batcher = getattr(self._embedder, "batcher", None)
        if batcher is not None:
            out["embed_batches"], out["embedded_texts"] = batcher.batches, batcher.texts
        return out

    async def aclose(self) -> None:
        if self._sync is not None:
            await self._sync.aclose()
        for task in (self._embedder_task, self._ready_task, *self._embeddings):
            if task is not None and not task.done():
                task.cancel()
        if self._owns_embedder:
            await self._embedder.aclose()
        await self._store.aclose()
        if self._owned_client is not None:
            await self._owned_client.aclose()
