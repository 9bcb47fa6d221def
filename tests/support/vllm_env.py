"""vLLM itself, for the parity tests: one vLLM interpreter and one render server per test run.

Each vLLM process costs 10-25 s of imports on a loaded 2-core machine, so the
parity tests share two (the session fixtures ``vllm_worker``, ``vllm_tokdir``
and ``vllm_render`` in tests/conftest.py), held by ``VLLM``:

* ``VllmWorker``: vLLM's Python running tests/support/vllm_worker.py; it runs
  check scripts (``run``, as ``python -c`` would) and drives vLLM's KV-event
  and hashing code (``ask``);
* a render server (``bench.vllm_render``: ``vllm launch render``) on the
  tokenizer directory built from the MiniLM package.

When the collected tests need them, conftest starts both in the background as
the run begins, at a lower CPU priority, so their imports use the cycles the
other tests leave idle; the first parity test waits only for what is left.

``need_vllm()`` skips a test, saying why, where vLLM is missing; it only looks
for the package (importing vLLM is the worker's job, and a venv that has it but
cannot import it fails the tests rather than skipping them).
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import tempfile
import threading
from contextlib import AbstractContextManager, contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator

import pytest

from bench.vllm_render import DEFAULT_VENV, START_TIMEOUT_S, TOOL_ARGS, RenderServer, vllm_env
from bench.vllm_render import render_server as _render_server

__all__ = ["DEFAULT_VENV", "VLLM", "RenderServer", "VllmProcesses", "VllmWorker", "need_vllm", "render_server",
           "vllm_env"]

WORKER = Path(__file__).with_name("vllm_worker.py")
PARITY_MODEL = "parity-model"
# Started in the background: below the tests' priority, so the imports take idle cycles.
BACKGROUND_NICE = 10
SKIP_REASON = ("vLLM is not installed: run .ci/vllm_venv.sh (`make test` does) or set VLLM_VENV_PYTHON "
               "to a Python that can import vllm==0.33.0")


@lru_cache(maxsize=1)
def _find_vllm_python() -> str | None:
    """$VLLM_VENV_PYTHON, else the default venv's Python, if it has the vllm package (not imported)."""
    for python in (os.environ.get("VLLM_VENV_PYTHON"), str(DEFAULT_VENV / "bin" / "python")):
        if not python or not Path(python).exists():
            continue
        probe = subprocess.run([python, "-c", "import importlib.util, sys; "
                                "sys.exit(importlib.util.find_spec('vllm') is None)"],
                               capture_output=True, timeout=60, check=False)
        if probe.returncode == 0:
            return python
    return None


def need_vllm() -> str:
    """The vLLM venv's Python, or skip the calling test with the reason."""
    python = _find_vllm_python()
    if python is None:
        pytest.skip(SKIP_REASON)
    return python


class VllmWorker:
    """vLLM's Python running tests/support/vllm_worker.py: one JSON line each way per command."""

    def __init__(self, python: str, *, wait: bool = True) -> None:
        """``wait=False``: return once started; ``wait_ready()`` (or the first command) waits for vLLM's import."""
        self.python = python
        self._ready = False
        env = vllm_env()
        env["PYTHONHASHSEED"] = "0"  # the KV tests' seed (they switch it with op=seed and back)
        self.log = Path(tempfile.mkstemp(prefix="vllm-worker-", suffix=".log")[1])
        with open(self.log, "wb") as err:
            # Its own session, so a stuck worker and anything it forked go with one signal.
            self.proc = subprocess.Popen([python, str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=err, env=env, text=True, start_new_session=True)
        self._lock = threading.Lock()
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        with self._lock:
            if self._ready:
                return
            try:
                ready = self._answer(START_TIMEOUT_S)
            except Exception:
                self.close()
                raise
            assert ready == {"ready": True}, ready
            self._ready = True

    def _answer(self, timeout: float) -> Any:
        assert self.proc.stdout is not None
        readable, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if readable else ""
        if not line:
            state = "exited" if self.proc.poll() is not None else f"gave no answer in {timeout:.0f} s"
            raise RuntimeError(f"the vLLM worker {state}: {self.log.read_text(errors='replace')[-3000:]}")
        return json.loads(line)

    def ask(self, timeout: float = 240.0, **cmd: Any) -> Any:
        """Send one command (see tests/support/vllm_worker.py) and return its answer."""
        assert self.proc.stdin is not None
        self.wait_ready()
        with self._lock:
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
            return self._answer(timeout)

    def run(self, code: str, *argv: str, input: str = "", timeout: float = 240.0) -> subprocess.CompletedProcess[str]:
        """``python -c code *argv`` under vLLM's Python, with ``input`` on stdin, in the shared interpreter."""
        done = self.ask(timeout, op="run", code=code, argv=list(argv), stdin=input)
        return subprocess.CompletedProcess(["vllm-worker", "-c", "...", *argv], done["returncode"], done["stdout"],
                                           done["stderr"])

    def close(self) -> None:
        try:
            if self.proc.poll() is None and self.proc.stdin is not None:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
            self.proc.wait(15)
        except (BrokenPipeError, OSError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(5)
        self.log.unlink(missing_ok=True)


class VllmProcesses:
    """The run's vLLM worker and render server, each started once (in a thread) and stopped by ``close``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self._threads: dict[str, threading.Thread] = {}
        self._errors: dict[str, BaseException] = {}
        self._worker: VllmWorker | None = None
        self._render: RenderServer | None = None
        self._render_cm: AbstractContextManager[RenderServer] | None = None
        self._tmp: Path | None = None
        self.tokdir: Path | None = None

    def start(self, python: str, *, worker: bool = True, render: bool = True, nice: int = 0) -> None:
        """Start what is asked for and not yet started; returns at once."""
        with self._lock:
            if render and self.tokdir is None:
                from vllm_sim.tokenizer_dir import build_tokenizer_dir

                self._tmp = Path(tempfile.mkdtemp(prefix="vllm-parity-"))
                self.tokdir = build_tokenizer_dir(self._tmp / "model")
            for name, wanted, target in (("worker", worker, self._start_worker),
                                         ("render", render, self._start_render)):
                if wanted and name not in self._threads:
                    thread = threading.Thread(target=self._guard, args=(name, target, python, nice), daemon=True,
                                              name=f"vllm-{name}")
                    self._threads[name] = thread
                    thread.start()

    def _guard(self, name: str, target: Any, python: str, nice: int) -> None:
        try:
            if nice:
                # Linux keeps a nice value per thread and a child inherits its forking
                # thread's: this lowers the vLLM process started here, not the tests.
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
            target(python)
        except BaseException as exc:  # noqa: BLE001 - raised again to the test that needs it
            self._errors[name] = exc

    def _start_worker(self, python: str) -> None:
        self._worker = VllmWorker(python, wait=False)
        self._worker.wait_ready()

    def _start_render(self, python: str) -> None:
        assert self.tokdir is not None
        cm = _render_server(self.tokdir, model=PARITY_MODEL, python=python)
        self._render = cm.__enter__()
        self._render_cm = cm

    def _wait(self, name: str) -> None:
        self._threads[name].join()
        if name in self._errors:
            raise RuntimeError(f"vLLM's {name} did not start: {self._errors[name]!r}") from self._errors[name]

    def worker(self, python: str) -> VllmWorker:
        self.start(python, render=False)
        self._wait("worker")
        assert self._worker is not None
        return self._worker

    def render(self, python: str) -> RenderServer:
        self.start(python, worker=False)
        self._wait("render")
        assert self._render is not None
        return self._render

    def close(self) -> None:
        for thread in self._threads.values():
            thread.join()
        if self._worker is not None:
            self._worker.close()
        if self._render_cm is not None:
            self._render_cm.__exit__(None, None, None)
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
        self._reset()


VLLM = VllmProcesses()


@contextmanager
def render_server(model_dir: str | Path, *, model: str = "parity-model",
                  extra_args: tuple[str, ...] = TOOL_ARGS) -> Iterator[RenderServer]:
    """``vllm launch render MODEL_DIR`` on a free loopback port (skips without vLLM)."""
    with _render_server(model_dir, model=model, python=need_vllm(), extra_args=extra_args) as server:
        yield server
