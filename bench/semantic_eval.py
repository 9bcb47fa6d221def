"""Does the semantic cache serve wrong answers? Measured on labelled question pairs.

For every pair (a, b, label) of each development set: store an answer for
``a``, look up ``b``, through the same code path the gateway uses
(``cache_request`` -> ``SemanticCache.store`` / ``lookup``, in-process store,
real all-MiniLM-L6-v2). Every pair gets its own namespace, so pairs never see
each other's entries. A hit on a label-1 pair is a true hit; on a label-0 pair
it is a false hit: the wrong answer served.

Two configurations side by side: kvgate's defaults (threshold + verifier) and
a plain cosine threshold of 0.92 (what most semantic caches ship). Both share
one memoised embedder, so the model runs once per distinct text.

Then the retrieval test (gptcache_mock_data): every ``a`` in ONE partition,
every ``b`` looked up; correct only when the hit is its own ``a``.

    python -m bench.semantic_eval                 # default: at most 6,000 pairs per set
    python -m bench.semantic_eval --limit 0       # every pair (QQP alone: ~80K embeddings)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from semantic_cache import CachedAnswer, LocalEmbedder, SemanticCache, SemanticCacheSettings, cache_request
from semantic_cache.settings import embedder_threads

REPO = Path(__file__).resolve().parent.parent
PAIR_SETS = ["qqp_dev", "paws_wiki_dev", "mrpc_train", "stsb_train", "sick_train"]
RETRIEVAL_SET = "gptcache_mock_data"
CHUNK = 64  # pairs in flight at once: lets the micro-batcher fill its batches


class MemoEmbedder:
    """Wraps the real embedder; each distinct text is encoded once for all configurations."""

    def __init__(self, inner: LocalEmbedder) -> None:
        self.inner = inner
        self.name = inner.name
        self.memo: dict[str, np.ndarray] = {}

    @property
    def ready(self) -> bool:
        return self.inner.ready

    async def start(self) -> None:
        await self.inner.start()

    async def embed(self, texts: Sequence[str]) -> np.ndarray:
        missing = [t for t in dict.fromkeys(texts) if t not in self.memo]
        if missing:
            for text, vec in zip(missing, await self.inner.embed(missing)):
                self.memo[text] = vec
        return np.stack([self.memo[t] for t in texts])

    async def aclose(self) -> None:
        return None  # the shared inner embedder is closed once, by main()


def load_pairs(path: Path, limit: int, seed: int) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in path.open(encoding="utf-8") if line.strip()]
    if limit and len(rows) > limit:
        rows = random.Random(seed).sample(rows, limit)
    return rows


def chat(namespace: str, text: str, s: SemanticCacheSettings):  # type: ignore[no-untyped-def]
    body = {"model": "eval-model", "messages": [{"role": "user", "content": text}]}
    return cache_request("chat", namespace, body, {}, settings=s)


async def eval_pairs(cache: SemanticCache, name: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    s = cache.settings
    tp = fp = 0
    for start in range(0, len(rows), CHUNK):
        chunk = list(enumerate(rows[start:start + CHUNK], start))
        answers = {i: CachedAnswer(f"answer {i}", "stop", "eval-model") for i, _ in chunk}
        await asyncio.gather(*[cache.store(chat(f"{name}/{i}", r["a"], s), answers[i]) for i, r in chunk])
        results = await asyncio.gather(*[cache.lookup(chat(f"{name}/{i}", r["b"], s)) for i, r in chunk])
        for (i, row), result in zip(chunk, results):
            if result.status == "hit" and result.answer == answers[i]:
                tp, fp = (tp + 1, fp) if row["label"] == 1 else (tp, fp + 1)
    pos = sum(1 for r in rows if r["label"] == 1)
    neg = len(rows) - pos
    return {"set": name, "pairs": len(rows), "pos": pos, "neg": neg, "true_hits": tp, "false_hits": fp,
            "recall": tp / pos if pos else None, "false_hit_rate": fp / neg if neg else None,
            "precision": tp / (tp + fp) if tp + fp else None}


async def eval_retrieval(cache: SemanticCache, rows: list[dict[str, Any]]) -> dict[str, Any]:
    s = cache.settings
    answers = [CachedAnswer(f"answer {i}", "stop", "eval-model") for i in range(len(rows))]
    for start in range(0, len(rows), CHUNK):
        await asyncio.gather(*[cache.store(chat("retrieval", rows[i]["a"], s), answers[i])
                               for i in range(start, min(start + CHUNK, len(rows)))])
    correct = wrong = 0
    for start in range(0, len(rows), CHUNK):
        idx = range(start, min(start + CHUNK, len(rows)))
        results = await asyncio.gather(*[cache.lookup(chat("retrieval", rows[i]["b"], s)) for i in idx])
        for i, result in zip(idx, results):
            if result.status == "hit":
                correct, wrong = (correct + 1, wrong) if result.answer == answers[i] else (correct, wrong + 1)
    return {"set": RETRIEVAL_SET, "queries": len(rows), "correct_hits": correct, "wrong_hits": wrong,
            "misses": len(rows) - correct - wrong, "correct_rate": correct / len(rows),
            "wrong_rate": wrong / len(rows)}


def fmt(x: float | None) -> str:
    return "   -  " if x is None else f"{100 * x:5.1f}%"


def print_tables(results: dict[str, list[dict[str, Any]]], retrieval: dict[str, dict[str, Any]]) -> None:
    names = list(results)
    print("\nPairs: store a, look up b, one namespace per pair. Recall on label-1 pairs, "
          "false hits on label-0 pairs.\n")
    head = f"{'set':<16}{'pairs':>7}{'pos':>7}{'neg':>7}"
    for n in names:
        head += f" | {n + ' recall':>20}{'false-hit':>11}{'precision':>11}"
    print(head)
    print("-" * len(head))
    for i, base in enumerate(results[names[0]]):
        line = f"{base['set']:<16}{base['pairs']:>7}{base['pos']:>7}{base['neg']:>7}"
        for n in names:
            r = results[n][i]
            line += f" | {fmt(r['recall']):>20}{fmt(r['false_hit_rate']):>11}{fmt(r['precision']):>11}"
        print(line)
    print(f"\nRetrieval ({RETRIEVAL_SET}): all a in one partition, each b looked up.\n")
    print(f"{'config':<22}{'queries':>8}{'correct hit':>13}{'wrong hit':>11}{'miss':>8}")
    for n, r in retrieval.items():
        print(f"{n:<22}{r['queries']:>8}{fmt(r['correct_rate']):>13}{fmt(r['wrong_rate']):>11}"
              f"{r['misses']:>8}")


async def run(args: argparse.Namespace) -> dict[str, Any]:
    data = Path(args.data)
    # embed_timeout_s is a production safety valve (a lookup stuck behind a busy model becomes
    # a miss); here it would count CPU starvation as cache misses, so it is lifted.
    common: dict[str, Any] = {"enabled": True, "batch_max": CHUNK, "embed_timeout_s": 600}
    configs = {
        "kvgate": SemanticCacheSettings(**common),
        "plain-0.92": SemanticCacheSettings(**common, threshold=0.92, verifier=False),
    }
    torch_threads, ort_threads = embedder_threads(args.threads)
    inner = LocalEmbedder(batch_max=CHUNK, threads=torch_threads, ort_threads=ort_threads)
    memo = MemoEmbedder(inner)
    await memo.start()
    sets = {name: load_pairs(data / f"{name}.jsonl", args.limit, args.seed) for name in PAIR_SETS}
    retrieval_rows = load_pairs(data / f"{RETRIEVAL_SET}.jsonl", 0, args.seed)
    results: dict[str, list[dict[str, Any]]] = {}
    retrieval: dict[str, dict[str, Any]] = {}
    faults: dict[str, int] = {}
    for cname, settings in configs.items():
        results[cname], faults[cname] = [], 0
        for name, rows in [*sets.items(), (RETRIEVAL_SET, retrieval_rows)]:
            # A fresh cache per set keeps memory flat; pairs are isolated by namespace anyway.
            cache = await SemanticCache.open(settings, None, embedder=memo)
            t0 = time.monotonic()
            if name == RETRIEVAL_SET:
                retrieval[cname] = await eval_retrieval(cache, rows)
            else:
                results[cname].append(await eval_pairs(cache, name, rows))
            # Anything but a clean hit or miss would bias the numbers: count it.
            stats = cache.stats()
            faults[cname] += sum(n for reason, n in stats["miss"].items()
                                 if reason in ("embedder_error", "embedder_timeout", "error", "embedder_not_ready"))
            faults[cname] += sum(n for reason, n in stats["stores"].items()
                                 if reason.startswith(("failed", "vector_failed")))
            print(f"[{cname}] {name}: {len(rows)} pairs in {time.monotonic() - t0:.0f}s", file=sys.stderr)
            await cache.aclose()
    await inner.aclose()
    print_tables(results, retrieval)
    print(f"\nfaulted lookups/stores (must be 0): {faults}")
    return {"pairs": results, "retrieval": retrieval, "faults": faults, "limit": args.limit, "seed": args.seed}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=str(REPO.parent / "shared" / "data" / "pairs"),
                        help="folder with the *.jsonl pair sets")
    parser.add_argument("--limit", type=int, default=6_000,
                        help="at most this many pairs per set, sampled with --seed (0 = all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=SemanticCacheSettings().embed_threads,
                        help="threads for the model (default: the embed_threads setting's, one per core)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    started = time.monotonic()
    out = asyncio.run(run(args))
    print(f"\n{sum(r['pairs'] for r in out['pairs']['kvgate'])} pairs "
          f"(limit {args.limit or 'none'}, seed {args.seed}) in {time.monotonic() - started:.0f}s")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
