"""vLLM itself, for the parity tests: ``need_vllm()`` skips a test, saying why, where it is missing.

The venv and the render server are driven by ``bench.vllm_render`` (benchmarks
use them too); this module adds only the pytest side.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from bench.vllm_render import DEFAULT_VENV, TOOL_ARGS, RenderServer, vllm_env, vllm_python
from bench.vllm_render import render_server as _render_server

__all__ = ["DEFAULT_VENV", "RenderServer", "need_vllm", "render_server", "vllm_env", "vllm_python"]


def need_vllm() -> str:
    """The vLLM venv's Python, or skip the calling test with the reason."""
    python = vllm_python()
    if python is None:
        pytest.skip("vLLM is not installed: run .ci/vllm_venv.sh (CI does) or set VLLM_VENV_PYTHON "
                    "to a Python that can import vllm==0.33.0")
    return python


@contextmanager
def render_server(model_dir: str | Path, *, model: str = "parity-model",
                  extra_args: tuple[str, ...] = TOOL_ARGS) -> Iterator[RenderServer]:
    """``vllm launch render MODEL_DIR`` on a free loopback port (skips without vLLM)."""
    with _render_server(model_dir, model=model, python=need_vllm(), extra_args=extra_args) as server:
        yield server
