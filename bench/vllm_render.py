"""vLLM itself on this machine: its CPU venv and its render server, for parity tests and benchmarks.

vLLM cannot live in kvgate's venv (it pins its own torch, transformers and
fastapi), so it has its own, built by ``.ci/vllm_venv.sh`` at /work/vllm-venv
or wherever ``$VLLM_VENV_PYTHON`` points. ``render_server(model_dir)`` runs
``vllm launch render`` (vLLM's GPU-less rendering server: chat templates and
tokenization, no weights) on a free loopback port and waits until it answers.
The tests' wrapper (tests/support/vllm_env.py) skips where vLLM is missing.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator

import httpx

from routing.render_tokens import RENDER_PATHS

__all__ = ["DEFAULT_VENV", "RenderServer", "render_server", "vllm_env", "vllm_python"]

DEFAULT_VENV = Path("/work/vllm-venv")
# Measured 11-24 s on this 2-core machine; a loaded CI box gets headroom.
START_TIMEOUT_S = 180.0
TOOL_ARGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")


@lru_cache(maxsize=1)
def vllm_python() -> str | None:
    """A Python that can ``import vllm``: $VLLM_VENV_PYTHON, else the default venv's; None if neither.

    Not a ``KVGATE_`` name: kvgate reads every ``KVGATE_*`` variable as a setting and
    refuses to start on one it does not know, and test gateways inherit the environment."""
    for python in (os.environ.get("VLLM_VENV_PYTHON"), str(DEFAULT_VENV / "bin" / "python")):
        if not python or not Path(python).exists():
            continue
        probe = subprocess.run([python, "-c", "import vllm"], capture_output=True, timeout=120, check=False)
        if probe.returncode == 0:
            return python
    return None


def vllm_env() -> dict[str, str]:
    """Environment for vLLM processes: CPU only, offline, no usage reports, not kvgate's PYTHONPATH."""
    # Not kvgate's PYTHONPATH, nor our own variable (vLLM warns of VLLM_* names it does not know).
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VLLM_VENV_PYTHON")}
    env.update(VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", VLLM_LOGGING_LEVEL="WARNING")
    return env


class RenderServer:
    def __init__(self, url: str, model: str, proc: subprocess.Popen[bytes], log: Path) -> None:
        self.url = url
        self.model = model
        self.proc = proc
        self.log = log

    def render(self, endpoint: str, body: dict[str, Any]) -> list[int]:
        """The token ids vLLM would prefill for ``body`` (endpoint "chat", "completions", "messages"
        or "responses")."""
        r = httpx.post(self.url + RENDER_PATHS[endpoint], json={"model": self.model, **body}, timeout=60)
        r.raise_for_status()
        data = r.json()
        return (data[0] if isinstance(data, list) else data)["token_ids"]  # type: ignore[no-any-return]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    for sig, wait in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


@contextmanager
def render_server(model_dir: str | Path, *, model: str = "parity-model", python: str | None = None,
                  extra_args: tuple[str, ...] = TOOL_ARGS) -> Iterator[RenderServer]:
    """``vllm launch render MODEL_DIR`` on a free loopback port; yields once /health answers 200."""
    python = python or vllm_python()
    if python is None:
        raise RuntimeError("vLLM is not installed: run .ci/vllm_venv.sh or set VLLM_VENV_PYTHON")
    port = _free_port()
    log = Path(tempfile.mkstemp(prefix="vllm-render-", suffix=".log")[1])
    cmd = [str(Path(python).with_name("vllm")), "launch", "render", str(model_dir), "--host", "127.0.0.1",
           "--port", str(port), "--served-model-name", model, *extra_args]
    with open(log, "wb") as out:
        # Its own session, so the whole group (vLLM may fork helpers) goes at the end.
        proc = subprocess.Popen(cmd, env=vllm_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm launch render exited {proc.returncode}: {log.read_text()[-3000:]}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"vllm launch render not up after {START_TIMEOUT_S:.0f} s: "
                                   f"{log.read_text()[-3000:]}")
            time.sleep(0.25)
        yield RenderServer(url, model, proc, log)
    finally:
        _stop_group(proc)
        log.unlink(missing_ok=True)
