"""Faster single-query paths through all-MiniLM-L6-v2, with the same vectors.

Profiled on the 2-core box (one thread, one 10-token query), a semantic hit is
almost all model time, and much of that is overhead, not arithmetic:
``SentenceTransformer.encode`` (feature plumbing, sorting, conversions) and
transformers' per-layer module calls and mask building. Two backends remove
it, best first:

* **ONNX Runtime** (when ``onnxruntime`` and ``onnx`` are installed): the model
  with mean pooling and normalisation is exported once at load time, in
  memory (about 2 s), and run by ORT's fused CPU kernels: 24.6 -> 9.6 ms per
  query, measured side by side on one core (``bench/semantic_perf.py``).
* **TorchScript**: the BERT forward traced once and frozen (about 30% off).

Each backend is checked against ``encode`` on probes of several lengths and a
padded batch before use (they agree to ~1e-7): ``build`` returns None (the
caller keeps ``model.encode``) for any model that is not the plain
Transformer -> mean Pooling [-> Normalize] stack these replicate, or if the
export or the self-check fails: never a different vector.
"""

from __future__ import annotations

import logging
import warnings
import weakref
from typing import Any, Callable

import numpy as np

log = logging.getLogger("kvgate.semantic_cache")

EncodeFn = Callable[[list[str]], np.ndarray]

# Probes of different lengths, one batch with padding: a trace that baked in one
# shape would fail this check.
_PROBES = (["warm up"], ["why is the sky blue?", "a much longer question, with commas, about how tokens are padded"])
_TOLERANCE = 1e-4


def _is_plain_mean_stack(model: Any) -> bool:
    try:
        names = [type(m).__name__ for m in model]
    except TypeError:
        return False  # not a SentenceTransformer (e.g. a test double)
    if names not in (["Transformer", "Pooling"], ["Transformer", "Pooling", "Normalize"]):
        return False
    return getattr(model[1], "pooling_mode", None) == "mean" and hasattr(model[0], "auto_model")


# Built once per loaded model and thread count: embedders that share a model (the test
# suite's stacks share one) share its fast path instead of exporting again (seconds each).
# Weak keys, and encode functions that hold the tokenizer, not the model, so a model let
# go is freed with its entry.
_BUILT: "weakref.WeakKeyDictionary[Any, dict[int, EncodeFn | None]]" = weakref.WeakKeyDictionary()


def build(model: Any, threads: int = 1) -> EncodeFn | None:
    """An encode function equivalent to ``model.encode(..., normalize_embeddings=True)``, or None."""
    if not _is_plain_mean_stack(model):
        return None
    built = _BUILT.setdefault(model, {})
    if threads not in built:
        built[threads] = _build(model, threads)
    return built[threads]


def _build(model: Any, threads: int) -> EncodeFn | None:
    for backend in (_onnx_backend, _traced_backend):
        try:
            encode = backend(model, threads)
        except Exception as exc:  # an optimisation only: any failure tries the next path
            log.warning("semantic cache: %s encoder unavailable (%r)", backend.__name__, exc)
            continue
        if encode is not None and _agrees(model, encode):
            return encode
    return None


def _agrees(model: Any, encode: EncodeFn) -> bool:
    for probe in _PROBES:
        want = model.encode(list(probe), normalize_embeddings=True, convert_to_numpy=True,
                            show_progress_bar=False)
        got = encode(list(probe))
        if got.shape != want.shape or float(np.abs(got - want).max()) > _TOLERANCE:
            log.warning("semantic cache: fast encoder disagrees with encode(); not used")
            return False
    return True


def _pooled_module(model: Any) -> Any:
    """BERT + attention-masked mean pooling + L2 normalisation, as one module."""
    import torch

    bert = model[0].auto_model.eval()

    class _Pooled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, ids: Any, types: Any, mask: Any) -> Any:
            hidden = self.bert(input_ids=ids, token_type_ids=types, attention_mask=mask).last_hidden_state
            weights = mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
            return torch.nn.functional.normalize(pooled, dim=1)

    return _Pooled().eval()


def _tokenizer(model: Any) -> Callable[[list[str], str], dict[str, Any]]:
    """The model's tokenization as ``encode`` does it (the tokenizer only: no reference to the model)."""
    tokenizer, max_length = model.tokenizer, int(model.max_seq_length)

    def tokens(texts: list[str], tensors: str) -> dict[str, Any]:
        return dict(tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors=tensors))

    return tokens


def _example(model: Any) -> tuple[Any, Any, Any] | None:
    """Inputs to export or trace with (a padded batch), or None for a tokenizer without token types."""
    t = _tokenizer(model)(list(_PROBES[1]), "pt")
    if "token_type_ids" not in t:
        return None
    return t["input_ids"], t["token_type_ids"], t["attention_mask"]


def _onnx_backend(model: Any, threads: int) -> EncodeFn | None:
    try:
        import onnx  # noqa: F401  (torch's exporter needs it)
        import onnxruntime as ort
    except ImportError:
        return None
    import io

    import torch

    example = _example(model)
    if example is None:
        return None
    buffer = io.BytesIO()
    axes = {"ids": {0: "batch", 1: "seq"}, "types": {0: "batch", 1: "seq"}, "mask": {0: "batch", 1: "seq"}}
    with warnings.catch_warnings(), torch.inference_mode():
        warnings.simplefilter("ignore")
        # The TorchScript exporter writes to any binary file object: no file on disk.
        torch.onnx.export(_pooled_module(model), example, buffer,  # type: ignore[arg-type]
                          input_names=["ids", "types", "mask"], output_names=["vectors"],
                          dynamic_axes={**axes, "vectors": {0: "batch"}}, opset_version=17, dynamo=False)
    options = ort.SessionOptions()
    options.intra_op_num_threads = max(1, threads)
    options.inter_op_num_threads = 1
    # No spinning worker threads: they would compete with the event loop for the cores.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.log_severity_level = 3
    session = ort.InferenceSession(buffer.getvalue(), options, providers=["CPUExecutionProvider"])
    tokens = _tokenizer(model)

    def encode(texts: list[str]) -> np.ndarray:
        t = tokens(texts, "np")
        feed = {"ids": t["input_ids"].astype(np.int64), "types": t["token_type_ids"].astype(np.int64),
                "mask": t["attention_mask"].astype(np.int64)}
        return np.asarray(session.run(None, feed)[0], dtype=np.float32)

    return encode


def _traced_backend(model: Any, threads: int) -> EncodeFn | None:
    import torch

    example = _example(model)
    if example is None:
        return None
    with warnings.catch_warnings(), torch.inference_mode():
        # Tracing warns about shape-dependent Python in transformers' mask helpers;
        # the multi-length self-check is what proves the trace general.
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(_pooled_module(model), example, check_trace=False)
        frozen = torch.jit.optimize_for_inference(torch.jit.freeze(traced))
    tokens = _tokenizer(model)

    def encode(texts: list[str]) -> np.ndarray:
        t = tokens(texts, "pt")
        with torch.inference_mode():
            return frozen(t["input_ids"], t["token_type_ids"], t["attention_mask"]).numpy()

    return encode
