"""Start a simulator as a separate OS process, for tests and benchmarks that must SIGKILL a replica.

A real process is the only faithful crash: killing it drops every TCP
connection at once and refuses new ones, exactly what a gateway sees when a
vLLM pod dies.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx

__all__ = ["start_sim_process", "sim_flags"]


def sim_flags(**flags: Any) -> list[str]:
    """CLI arguments for keyword flags: ``kv_blocks=64`` -> ``--kv-blocks 64``.

    True adds a bare switch, False and None are left out, a list or tuple repeats
    the flag (``model=["a", "b"]``).
    """
    argv: list[str] = []
    for key, value in flags.items():
        flag = "--" + key.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            argv.append(flag)
        elif isinstance(value, (list, tuple)):
            for item in value:
                argv += [flag, str(item)]
        else:
            argv += [flag, str(value)]
    return argv


def start_sim_process(
    port: int,
    *,
    host: str = "127.0.0.1",
    startup_timeout: float = 20.0,
    env: dict[str, str] | None = None,
    **flags: Any,
) -> subprocess.Popen[bytes]:
    """Run ``python -m vllm_sim`` on ``port`` and return once ``/health`` answers (any status).

    Raises RuntimeError, with the process's output, if it exits or does not answer
    within ``startup_timeout`` seconds; the process is killed first. The caller owns
    the returned process: ``terminate()`` or ``kill()`` it, then ``wait()``.
    """
    argv = [sys.executable, "-m", "vllm_sim", "--host", host, "--port", str(port), *sim_flags(**flags)]
    # Output goes to a file, not a pipe: an unread pipe fills up and blocks the simulator.
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    try:
        _wait_until_up(proc, f"http://{host}:{port}/health", startup_timeout)
    except RuntimeError as exc:
        proc.kill()
        proc.wait()
        log.seek(0)
        output = log.read().decode(errors="replace")[-4000:]
        log.close()
        raise RuntimeError(f"{exc}\n--- simulator output ---\n{output}") from None
    log.close()  # the child keeps its own descriptor
    return proc


def _wait_until_up(proc: subprocess.Popen[bytes], url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=1.0) as client:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm_sim exited with code {proc.returncode} during start-up")
            try:
                client.get(url)
                return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"vllm_sim did not answer {url} within {timeout} s")
            time.sleep(0.02)
