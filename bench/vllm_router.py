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

In P/D mode (``start_vllm_router_pd``: ``--vllm-pd-disaggregation --prefill URL ...
--decode URL ...``) it runs each request as vLLM's toy proxy does: to a prefill worker
with ``kv_transfer_params.do_remote_decode``, ``stream: false`` and ``max_tokens`` 1
(plus ``min_tokens`` 1 and its own defaults for sampling fields), then the original
request with the ``kv_transfer_params`` the prefill returned to a decode worker, whose
answer (streamed or not) goes back to the client; its ``/readiness`` then counts
healthy prefill and decode workers apart. ``vllm_sim --role prefill|decode`` serves
both legs (``bench.pd``, ``tests/test_bench_pd.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.chaos_fleet import LocalServer
from bench.peers import binary, start_peer

__all__ = ["VLLM_ROUTER_POLICIES", "vllm_router_binary", "start_vllm_router", "start_vllm_router_pd"]

VLLM_ROUTER_POLICIES = ("cache_aware", "round_robin", "consistent_hash")


def vllm_router_binary() -> str | None:
    """The ``vllm-router`` next to this interpreter (the venv's), else on PATH; None if not installed."""
    return binary("vllm-router")


def start_vllm_router(policy: str, worker_urls: list[str], workdir: Path, *,
                      timeout: float = 60.0) -> LocalServer:
    """``vllm-router`` with ``policy`` over ``worker_urls``; returns once every worker is healthy."""
    args = ["--policy", policy, "--worker-startup-check-interval", "1", "--log-level", "warning"]
    return start_peer("vllm-router", args, worker_urls, workdir, policy, timeout)


def start_vllm_router_pd(prefill_urls: list[str], decode_urls: list[str], workdir: Path, *,
                         policy: str = "round_robin", timeout: float = 60.0) -> LocalServer:
    """``vllm-router --vllm-pd-disaggregation`` over prefill and decode workers; returns once all are healthy."""
    args = ["--vllm-pd-disaggregation", "--policy", policy, "--worker-startup-check-interval", "1",
            "--log-level", "warning"]
    for url in prefill_urls:
        args += ["--prefill", url]
    for url in decode_urls:
        args += ["--decode", url]

    def ready(state: dict[str, Any]) -> bool:
        return ((state.get("prefill") or {}).get("healthy") == len(prefill_urls)
                and (state.get("decode") or {}).get("healthy") == len(decode_urls))

    return start_peer("vllm-router", args, [], workdir, f"pd-{policy}", timeout, ready=ready)

