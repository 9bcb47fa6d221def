"""vLLM itself, for the parity tests: a separate CPU venv and its render server.

vLLM cannot live in kvgate's venv (it pins its own torch, transformers and
fastapi), so it has its own, built by ``.ci/run`` (``.ci/vllm_venv.sh``) at
/work/vllm-venv or wherever ``$KVGATE_VLLM_PYTHON`` points. Tests that need it
call ``need_vllm()`` and are skipped, saying why, where it is missing.

``render_server(model_dir)`` runs ``vllm launch render`` (vLLM's GPU-less
rendering server: chat templates and tokenization only, no weights) on an
ephemeral port and waits until it answers.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Iterator

import httpx
import pytest

__all__ = ["vllm_python", "need_vllm", "render_server", "RenderServer", "DEFAULT_VENV"]

DEFAULT_VENV = Path("/work/vllm-venv")
# Measured 11-24 s on this 2-core machine; a loaded CI box gets headroom.
START_TIMEOUT_S = 180.0


@lru_cache(maxsize=1)
def vllm_python() -> str | None:
    """A Python that can ``import vllm``: $KVGATE_VLLM_PYTHON, else the default venv's; None if neither."""
    candidates = [os.environ.get("KVGATE_VLLM_PYTHON"), str(DEFAULT_VENV / "bin" / "python")]
    for python in candidates:
        if not python or not Path(python).exists():
            continue
        probe = subprocess.run([python, "-c", "import vllm"], capture_output=True, timeout=120, check=False)
        if probe.returncode == 0:
            return python
    return None


def need_vllm() -> str:
    """The vLLM venv's Python, or skip the calling test with the reason."""
    python = vllm_python()
    if python is None:
        pytest.skip("vLLM is not installed: run .ci/vllm_venv.sh (CI does) or set KVGATE_VLLM_PYTHON "
                    "to a Python that can import vllm==0.33.0")
    return python


def vllm_env() -> dict[str, str]:
    """Environment for vLLM processes: CPU only, offline, no usage reports."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", VLLM_LOGGING_LEVEL="WARNING")
    return env


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    import signal

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


class RenderServer:
    def __init__(self, url: str, model: str, proc: subprocess.Popen[bytes], log: Path) -> None:
        self.url = url
        self.model = model
        self.proc = proc
        self.log = log

    def render(self, endpoint: str, body: dict) -> list[int]:
        """The token ids vLLM would prefill for ``body`` (endpoint "chat" or "completions")."""
        path = "/v1/chat/completions/render" if endpoint == "chat" else "/v1/completions/render"
        r = httpx.post(self.url + path, json={"model": self.model, **body}, timeout=60)
        r.raise_for_status()
        data = r.json()
        return (data[0] if isinstance(data, list) else data)["token_ids"]


@contextmanager
def render_server(model_dir: str | Path, *, model: str = "parity-model",
                  extra_args: tuple[str, ...] = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes"),
                  ) -> Iterator[RenderServer]:
    """``vllm launch render MODEL_DIR`` on a free loopback port; yields once /health answers 200."""
    from tests.support.servers import free_port

    python = need_vllm()
    port = free_port()
    log = Path(tempfile.mkstemp(prefix="vllm-render-", suffix=".log")[1])
    vllm = str(Path(python).with_name("vllm"))
    cmd = [vllm, "launch", "render", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", model, *extra_args]
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
