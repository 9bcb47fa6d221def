"""In-memory vector index, hard-partitioned: a search sees one partition only.

Each partition (namespace + model + context hash) has its own index, so no
filter can be forgotten: an entry of another tenant, model, system prompt or
conversation is simply not in the structure being searched.

Most partitions are tiny (a conversation's history is unique, so its partition
holds a handful of entries), and an HNSW graph per tiny partition would waste
memory and time. A partition is therefore an exact numpy matrix until it holds
``brute_force_max`` live entries, then it is converted to an hnswlib graph
(inner product on unit vectors = cosine). Deleted entries are masked in the
matrix and ``mark_deleted`` in the graph, whose slots new entries reuse.

Thread safety: one lock guards all partitions. Searches take well under a
millisecond, so the event loop calls them inline; bulk loads from a worker
thread take the lock per entry and interleave with searches.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import hnswlib
import numpy as np


@dataclass(frozen=True)
class Hit:
    id: str
    similarity: float
    query: str


class _Partition:
    def __init__(self, dim: int) -> None:
        self.dim = dim
        self.labels: dict[str, int] = {}          # entry id -> label
        self.items: dict[int, tuple[str, str]] = {}  # label -> (entry id, query)
        self.next_label = 0
        self.matrix: np.ndarray | None = np.zeros((1, dim), dtype=np.float32)
        self.alive = np.zeros(1, dtype=bool)
        self.graph: hnswlib.Index | None = None

    def __len__(self) -> int:
        return len(self.labels)


class VectorIndex:
    """Partitioned nearest-neighbour search over unit vectors."""

    def __init__(self, *, m: int = 16, ef_construction: int = 100, ef_search: int = 64,
                 brute_force_max: int = 256) -> None:
        self._m = m
        self._ef_construction = ef_construction
        self._ef_search = ef_search
        self._brute_force_max = brute_force_max
        self._parts: dict[str, _Partition] = {}
        self._where: dict[str, str] = {}  # entry id -> partition
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, entry_id: object) -> bool:
        return entry_id in self._where

    @property
    def partitions(self) -> int:
        return len(self._parts)

    def has_partition(self, partition: str) -> bool:
        """Whether a search could find anything: lets a lookup skip the embedding."""
        return partition in self._parts

    def add(self, partition: str, entry_id: str, vector: np.ndarray, query: str) -> None:
        """Insert or replace one entry. Raises ValueError on a dimension mismatch."""
        vec = np.ascontiguousarray(vector, dtype=np.float32).reshape(-1)
        with self._lock:
            part = self._parts.get(partition)
            if part is None:
                part = self._parts[partition] = _Partition(vec.shape[0])
            if vec.shape[0] != part.dim:
                raise ValueError(f"vector has dim {vec.shape[0]}, partition has {part.dim}")
            if entry_id in self._where:
                self._remove_locked(entry_id)
                # _remove_locked may drop an emptied partition; make sure ours exists.
                part = self._parts.setdefault(partition, part)
            if part.graph is None and part.next_label >= part.alive.shape[0]:
                self._make_room(part)
            label = part.next_label
            part.next_label += 1
            part.labels[entry_id] = label
            part.items[label] = (entry_id, query)
            self._where[entry_id] = partition
            self._insert_locked(part, label, vec)

    def add_many(self, partition: str, ids: list[str], vectors: np.ndarray, queries: list[str]) -> None:
        """Bulk insert for rebuilds: a new large partition is built as one graph, on all
        cores and outside the lock (lookups keep running), then swapped in. Anything
        else (an existing partition, a replaced id) goes through ``add`` one by one."""
        vecs = np.ascontiguousarray(vectors, dtype=np.float32)
        with self._lock:
            bulk = (partition not in self._parts and len(ids) > self._brute_force_max
                    and len(set(ids)) == len(ids) and not any(i in self._where for i in ids))
        if not bulk:
            for entry_id, vec, query in zip(ids, vecs, queries):
                self.add(partition, entry_id, vec, query)
            return
        part = _Partition(vecs.shape[1])
        graph = hnswlib.Index(space="ip", dim=part.dim)
        graph.init_index(max_elements=max(1024, 2 * len(ids)), M=self._m,
                         ef_construction=self._ef_construction, allow_replace_deleted=True)
        graph.add_items(vecs, np.arange(len(ids)))  # multi-threaded
        graph.set_num_threads(1)
        graph.set_ef(self._ef_search)
        part.graph, part.matrix, part.alive = graph, None, np.zeros(0, dtype=bool)
        part.labels = {entry_id: label for label, entry_id in enumerate(ids)}
        part.items = dict(enumerate(zip(ids, queries)))
        part.next_label = len(ids)
        with self._lock:
            if partition in self._parts or any(i in self._where for i in ids):
                raced = True  # someone added meanwhile: fall back to the safe path
            else:
                raced = False
                self._parts[partition] = part
                self._where.update(dict.fromkeys(ids, partition))
        if raced:
            for entry_id, vec, query in zip(ids, vecs, queries):
                self.add(partition, entry_id, vec, query)

    def _insert_locked(self, part: _Partition, label: int, vec: np.ndarray) -> None:
        if part.graph is not None:
            graph = part.graph
            if graph.get_current_count() >= graph.get_max_elements():
                graph.resize_index(graph.get_max_elements() * 2)
            graph.add_items(vec[None, :], [label], replace_deleted=True)
            return
        assert part.matrix is not None
        part.matrix[label] = vec
        part.alive[label] = True
        if len(part) > self._brute_force_max:
            self._to_graph(part)

    @staticmethod
    def _make_room(part: _Partition) -> None:
        """Full matrix: drop deleted rows if at least half are dead, else double it."""
        assert part.matrix is not None
        live = np.flatnonzero(part.alive[: part.next_label])
        size = part.matrix.shape[0] if 2 * len(live) <= part.matrix.shape[0] else 2 * part.matrix.shape[0]
        matrix = np.zeros((size, part.dim), dtype=np.float32)
        matrix[: len(live)] = part.matrix[live]
        items = {}
        for new, old in enumerate(live.tolist()):
            entry_id, query = part.items[old]
            items[new] = (entry_id, query)
            part.labels[entry_id] = new
        part.items = items
        part.matrix = matrix
        part.alive = np.zeros(size, dtype=bool)
        part.alive[: len(live)] = True
        part.next_label = len(live)

    def _to_graph(self, part: _Partition) -> None:
        assert part.matrix is not None
        labels = np.flatnonzero(part.alive)
        graph = hnswlib.Index(space="ip", dim=part.dim)
        graph.init_index(max_elements=max(1024, 2 * len(labels)), M=self._m,
                         ef_construction=self._ef_construction, allow_replace_deleted=True)
        graph.set_num_threads(1)
        graph.set_ef(self._ef_search)
        graph.add_items(part.matrix[labels], labels)
        part.graph, part.matrix, part.alive = graph, None, np.zeros(0, dtype=bool)

    def remove(self, entry_id: str) -> bool:
        with self._lock:
            return self._remove_locked(entry_id)

    def _remove_locked(self, entry_id: str) -> bool:
        partition = self._where.pop(entry_id, None)
        if partition is None:
            return False
        part = self._parts[partition]
        label = part.labels.pop(entry_id)
        del part.items[label]
        if part.graph is not None:
            part.graph.mark_deleted(label)
        else:
            part.alive[label] = False
        if not part.labels:
            del self._parts[partition]
        return True

    def clear(self) -> None:
        with self._lock:
            self._parts.clear()
            self._where.clear()

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._where)

    def search(self, partition: str, vector: np.ndarray, k: int, min_similarity: float) -> list[Hit]:
        """Up to ``k`` entries of ``partition`` with cosine >= ``min_similarity``, best first."""
        vec = np.ascontiguousarray(vector, dtype=np.float32).reshape(-1)
        with self._lock:
            part = self._parts.get(partition)
            if part is None or vec.shape[0] != part.dim:
                return []
            k = min(k, len(part))
            if part.graph is not None:
                labels, sims = self._graph_search(part.graph, vec, k)
            else:
                labels, sims = self._exact_search(part, vec, k)
            return [Hit(part.items[int(lab)][0], float(s), part.items[int(lab)][1])
                    for lab, s in zip(labels, sims) if s >= min_similarity and int(lab) in part.items]

    @staticmethod
    def _graph_search(graph: hnswlib.Index, vec: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        while k > 0:
            try:
                labels, dists = graph.knn_query(vec[None, :], k=k)
                return labels[0], 1.0 - dists[0]
            except RuntimeError:
                # hnswlib cannot fill k results when deletions disconnected part of the
                # graph; fewer candidates is still a correct (if poorer) answer.
                k //= 2
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)

    @staticmethod
    def _exact_search(part: _Partition, vec: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        assert part.matrix is not None
        n = part.next_label
        sims = part.matrix[:n] @ vec
        sims[~part.alive[:n]] = -np.inf
        top = np.argsort(-sims)[:k] if n <= 64 else np.argpartition(-sims, k - 1)[:k]
        top = top[np.argsort(-sims[top])]
        return top, sims[top]

    def memory_bytes(self) -> int:
        """Approximate bytes held by vectors and graph links (not Python overhead)."""
        with self._lock:
            total = 0
            for part in self._parts.values():
                if part.graph is not None:
                    per = part.dim * 4 + self._m * 2 * 4 + 8
                    total += part.graph.get_max_elements() * per
                elif part.matrix is not None:
                    total += part.matrix.nbytes
            return total
