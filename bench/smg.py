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

from pathlib import Path

from bench.chaos_fleet import LocalServer
from bench.peers import binary, start_peer

__all__ = ["SMG_POLICIES", "smg_binary", "start_smg"]

SMG_POLICIES = ("cache_aware", "round_robin", "prefix_hash")


def smg_binary() -> str | None:
    """The ``smg`` next to this interpreter (the venv's), else on PATH; None if not installed."""
    return binary("smg")


def start_smg(policy: str, worker_urls: list[str], workdir: Path, *, timeout: float = 60.0) -> LocalServer:
    """``smg`` with ``policy`` over ``worker_urls``; returns once every worker is healthy."""
    args = ["launch", "--policy", policy, "--log-level", "warn"]
    return start_peer("smg", args, worker_urls, workdir, policy, timeout)
