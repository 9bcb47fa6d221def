"""all-MiniLM-L6-v2 loaded once per test run and shared by every test and stack that needs the real model.

Loading it (torch, sentence-transformers, the weights) and building its fast
path (semantic_cache/fast_encode.py, built once per model) cost seconds each
time; a stack built in-process takes ``shared_minilm`` as its semantic cache's
loader (``start_stack`` does by default), so only the first pays.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any


@lru_cache(maxsize=1)
def shared_minilm() -> Any:
    """The run's one loaded model (the packaged weights, offline)."""
    from semantic_cache.embedder import load_minilm

    return load_minilm()
