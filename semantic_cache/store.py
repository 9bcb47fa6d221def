"""Entry storage: the protocol, the in-process store, and the entry codec.

A store keeps entries (answer, embedding, metadata) with a TTL, caps each
namespace (least recently used entry evicted first) and purges by namespace,
model or age. It knows nothing about vectors beyond carrying them: indexing is
``index.py``'s job, so a store fault never corrupts the index and vice versa.

Errors: a store that cannot answer raises ``StoreUnavailable`` (and only that);
the cache facade turns it into a miss.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .models import CachedAnswer, Entry


class StoreUnavailable(Exception):
    """The backing store timed out, refused, or its circuit breaker is open."""


@dataclass(frozen=True)
class PurgeFilter:
    namespace: str | None = None
    model: str | None = None
    # Entries created more than this many seconds ago.
    older_than_s: float | None = None

    def matches(self, namespace: str, model: str, created: float, now: float) -> bool:
        if self.namespace is not None and namespace != self.namespace:
            return False
        if self.model is not None and model != self.model:
            return False
        return self.older_than_s is None or created <= now - self.older_than_s


class Store(Protocol):
    @property
    def healthy(self) -> bool: ...

    async def get(self, entry_id: str, namespace: str) -> Entry | None:
        """The live entry of ``namespace`` (marked recently used), or None."""

    async def put(self, entry: Entry, cap: int) -> list[str]:
        """Store or replace; return ids evicted to keep the namespace within ``cap``."""

    async def set_vector(self, entry: Entry) -> bool:
        """Add ``entry.vector`` to the stored entry of the same id and version (``created``);
        False, and nothing written, when that entry is gone or was replaced."""

    async def purge(self, flt: PurgeFilter) -> list[str]:
        """Delete matching entries; return their ids."""

    async def ids(self) -> dict[str, str]:
        """Every entry id with its namespace (cheap: no payloads)."""

    async def aclose(self) -> None: ...


# ---- codec (flat string fields, so Redis can HMGET a few without the rest) ----

def encode_entry(entry: Entry, embedder: str) -> dict[str, bytes | str]:
    fields: dict[str, bytes | str] = {
        "ns": entry.namespace, "model": entry.model, "part": entry.partition, "ep": entry.endpoint,
        "q": entry.query, "ans": json.dumps(entry.answer.to_dict(), ensure_ascii=False),
        "created": repr(entry.created), "exp": repr(entry.expires_at), "emb": embedder,
    }
    if entry.vector is not None:
        fields["vec"] = np.ascontiguousarray(entry.vector, dtype=np.float32).tobytes()
    return fields


def decode_entry(entry_id: str, raw: dict[bytes, bytes], embedder: str | None) -> Entry | None:
    """Entry from a Redis hash, or None if malformed. Vectors of another embedder are dropped."""
    try:
        f = {k.decode(): v for k, v in raw.items()}
        vec = None
        if "vec" in f and (embedder is None or f.get("emb", b"").decode() == embedder):
            vec = np.frombuffer(f["vec"], dtype=np.float32)
        return Entry(
            id=entry_id, namespace=f["ns"].decode(), model=f["model"].decode(),
            partition=f["part"].decode(), endpoint=f["ep"].decode(), query=f["q"].decode(),
            answer=CachedAnswer.from_dict(json.loads(f["ans"])), created=float(f["created"]),
            expires_at=float(f["exp"]), vector=vec,
        )
    except (KeyError, ValueError, TypeError, UnicodeDecodeError):
        return None


class MemoryStore:
    """The store when kvgate runs without Redis: one process, nothing shared.

    Per namespace an ``OrderedDict`` in recency order gives O(1) LRU eviction.
    Expired entries are dropped when read and when their namespace is written.
    """

    def __init__(self) -> None:
        self._entries: dict[str, Entry] = {}
        self._lru: dict[str, OrderedDict[str, None]] = {}

    @property
    def healthy(self) -> bool:
        return True

    async def get(self, entry_id: str, namespace: str) -> Entry | None:
        entry = self._entries.get(entry_id)
        if entry is None or entry.namespace != namespace:
            return None
        if entry.expires_at <= time.time():
            self._drop(entry_id)
            return None
        self._lru[entry.namespace].move_to_end(entry_id)
        return entry

    async def put(self, entry: Entry, cap: int) -> list[str]:
        self._drop(entry.id)
        self._entries[entry.id] = entry
        lru = self._lru.setdefault(entry.namespace, OrderedDict())
        lru[entry.id] = None
        evicted = self._expire(entry.namespace)
        while len(lru) > cap:
            oldest = next(iter(lru))
            self._drop(oldest)
            evicted.append(oldest)
        return evicted

    async def set_vector(self, entry: Entry) -> bool:
        current = self._entries.get(entry.id)
        if current is None or current.created != entry.created or current.expires_at <= time.time():
            return False
        current.vector = entry.vector
        return True

    def _expire(self, namespace: str) -> list[str]:
        now = time.time()
        gone = [i for i in self._lru.get(namespace, ()) if self._entries[i].expires_at <= now]
        for entry_id in gone:
            self._drop(entry_id)
        return gone

    def _drop(self, entry_id: str) -> None:
        entry = self._entries.pop(entry_id, None)
        if entry is not None:
            lru = self._lru[entry.namespace]
            lru.pop(entry_id, None)
            if not lru:
                del self._lru[entry.namespace]

    async def purge(self, flt: PurgeFilter) -> list[str]:
        now = time.time()
        gone = [e.id for e in self._entries.values()
                if flt.matches(e.namespace, e.model, e.created, now)]
        for entry_id in gone:
            self._drop(entry_id)
        return gone

    async def ids(self) -> dict[str, str]:
        return {i: e.namespace for i, e in self._entries.items()}

    async def aclose(self) -> None:
        self._entries.clear()
        self._lru.clear()
