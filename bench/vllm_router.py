"""vLLM's own router (``vllm-router`` on PyPI: a Rust extension behind a Python launcher, no torch) on loopback.

    vllm-router --host H --port P --worker-urls URL... --policy cache_aware

It waits for every worker's ``/health`` before it listens, and is ready once
``/readiness`` reports every worker healthy, as smg's does. Policy
``cache_aware`` (its default) asks every worker for
``/v1/chat/completions/render`` (or ``/v1/completions/render``) of every
request (0.1.17: one render per worker per request), falling back to
``/tokenize``, and routes on the token ids; ``round_robin`` and
``consistent_hash`` need only ``/health``. ``vllm_sim`` serves all of these
(``tests/test_routing_vllm_router.py``). ``power_of_two`` polls SGLang's
``/get_load``, which vLLM does not serve, and ``kv_aware`` needs ZMQ KV-event
sources per worker; ``bench.routing_e2e`` runs neither. Its Prometheus
exporter gets a free port of its own (the default, 29000, would collide
between runs), and the workers are probed every second at start-up instead
of every 30 s.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench.chaos_fleet import HOST, LocalServer, _kill, free_port

__all__ = ["VLLM_ROUTER_POLICIES", "VllmRouter", "start_vllm_router", "vllm_router_binary"]

VLLM_ROUTER_POLICIES = ("cache_aware", "round_robin", "consistent_hash")


def vllm_router_binary() -> str | None:
    """The ``vllm-router`` next to this interpreter (the venv's), else on PATH; None if not installed."""
    here = Path(sys.executable).parent / "vllm-router"
    return str(here) if here.exists() else shutil.which("vllm-router")


class VllmRouter(LocalServer):
    """A vllm-router process (``start_vllm_router``)."""


def start_vllm_router(policy: str, worker_urls: list[str], workdir: Path, *, timeout: float = 60.0) -> VllmRouter:
    """``vllm-router`` with ``policy`` over ``worker_urls``; returns once every worker is healthy."""
    binary = vllm_router_binary()
    if binary is None:
        raise RuntimeError("vllm-router is not installed (pip install vllm-router: the bench extra)")
    port = free_port()
    log_path = workdir / f"vllm-router-{policy}.log"
    argv = [binary, "--host", HOST, "--port", str(port), "--worker-urls", *worker_urls, "--policy", policy,
            "--prometheus-host", HOST, "--prometheus-port", str(free_port()),
            "--worker-startup-check-interval", "1", "--log-level", "warning"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    router = VllmRouter(port, proc, log_path)
    deadline = time.monotonic() + timeout
    while True:
        try:
            r = httpx.get(router.url + "/readiness", timeout=1)
            if r.status_code == 200 and r.json().get("healthy_workers") == len(worker_urls):
                return router
        except (httpx.HTTPError, ValueError):
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            _kill(proc)
            raise RuntimeError(f"vllm-router did not become ready:\n{router.log_tail()}")
        time.sleep(0.1)
