"""A peer gateway (smg, vllm-router: compiled binaries from PyPI) as a process on loopback.

Both are found next to this interpreter (the venv's) or on PATH, listen on a
free port with their Prometheus exporter on another (their defaults would
collide between runs), and are ready once ``/readiness`` reports every worker
healthy.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import httpx

from bench.chaos_fleet import HOST, LocalServer, _kill, free_port

__all__ = ["binary", "start_peer"]


def binary(name: str) -> str | None:
    """The executable ``name`` next to this interpreter, else on PATH; None if not installed."""
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else shutil.which(name)


def start_peer(name: str, args: list[str], worker_urls: list[str], workdir: Path, label: str,
               timeout: float = 60.0, ready: Callable[[dict[str, Any]], bool] | None = None) -> LocalServer:
    """Run ``name ARGS --host H --port P --worker-urls ... --prometheus-*``; return once every worker is healthy.

    With no ``worker_urls`` the workers are in ``args`` (vllm-router's P/D mode: ``--prefill``,
    ``--decode``) and ``ready`` says, from the ``/readiness`` JSON, when they are all healthy."""
    exe = binary(name)
    if exe is None:
        raise RuntimeError(f"{name} is not installed (pip install {name}: the bench extra)")
    port = free_port()
    log_path = workdir / f"{name}-{label}.log"
    workers = ["--worker-urls", *worker_urls] if worker_urls else []
    argv = [exe, *args, "--host", HOST, "--port", str(port), *workers,
            "--prometheus-host", HOST, "--prometheus-port", str(free_port())]
    if ready is None:
        def ready(state: dict[str, Any]) -> bool:
            return state.get("healthy_workers") == len(worker_urls)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    server = LocalServer(port, proc, log_path)
    deadline = time.monotonic() + timeout
    while True:
        try:
            r = httpx.get(server.url + "/readiness", timeout=1)
            if r.status_code == 200 and ready(r.json()):
                return server
        except (httpx.HTTPError, ValueError):
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            _kill(proc)
            raise RuntimeError(f"{name} did not become ready:\n{server.log_tail()}")
        time.sleep(0.1)
