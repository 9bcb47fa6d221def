"""The real SGLang model gateway (``smg``, on PyPI: a Rust binary, no torch) as a process on loopback.

    smg launch --host H --port P --worker-urls URL... --policy cache_aware

It needs only ``/health`` and ``/v1/models`` of its workers, which ``vllm_sim``
serves, and is ready once ``/readiness`` answers 200 with every worker
healthy. ``bench.routing_e2e`` runs it over the same replicas as kvgate
(policies ``cache_aware``, ``round_robin``, ``prefix_hash``) with smg's own
defaults otherwise; its Prometheus exporter gets a free port of its own so
runs do not collide on smg's default.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench.chaos_fleet import HOST, LocalServer, _kill, free_port

__all__ = ["Smg", "smg_binary", "start_smg", "SMG_POLICIES"]

SMG_POLICIES = ("cache_aware", "round_robin", "prefix_hash")


def smg_binary() -> str | None:
    """The ``smg`` next to this interpreter (the venv's), else on PATH; None if not installed."""
    here = Path(sys.executable).parent / "smg"
    return str(here) if here.exists() else shutil.which("smg")


class Smg(LocalServer):
    """An SGLang model gateway process (``start_smg``)."""


def start_smg(policy: str, worker_urls: list[str], workdir: Path, *, timeout: float = 60.0) -> Smg:
    """``smg launch`` with ``policy`` over ``worker_urls``; returns once every worker is healthy."""
    binary = smg_binary()
    if binary is None:
        raise RuntimeError("smg is not installed (pip install smg: the bench extra)")
    port = free_port()
    log_path = workdir / f"smg-{policy}.log"
    argv = [binary, "launch", "--host", HOST, "--port", str(port), "--worker-urls", *worker_urls,
            "--policy", policy, "--prometheus-host", HOST, "--prometheus-port", str(free_port()),
            "--log-level", "warn"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    gw = Smg(port, proc, log_path)
    deadline = time.monotonic() + timeout
    while True:
        try:
            r = httpx.get(gw.url + "/readiness", timeout=1)
            if r.status_code == 200 and r.json().get("healthy_workers") == len(worker_urls):
                return gw
        except (httpx.HTTPError, ValueError):
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            _kill(proc)
            raise RuntimeError(f"smg did not become ready:\n{gw.log_tail()}")
        time.sleep(0.1)
