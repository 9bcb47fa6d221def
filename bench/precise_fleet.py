"""Replicas that tokenize as vLLM would and publish KV events, and the kvgate config that routes on them.

What ``kvgate demo --precise`` runs in one process, as separate ``vllm_sim``
processes instead (so one can be killed and restarted on the same ports):
each replica loads the MiniLM tokenizer directory (``vllm_sim.tokenizer_dir``)
and binds its own PUB and replay sockets; kvgate gets the same directory for
the model and each replica's two endpoints (README, "Precise routing").
"""

from __future__ import annotations

import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.chaos_fleet import HOST, MODEL, Sim, free_port

__all__ = ["PRECISE", "tokenizer_dir", "start_event_sims", "replica_entries", "precise_routing"]

# The row name of prefix_affinity in precise mode (token ids plus KV events).
PRECISE = "prefix_affinity precise"


def tokenizer_dir() -> str:
    """The MiniLM-based directory ``kvgate demo --precise`` uses (built once per user, idempotent)."""
    from vllm_sim.tokenizer_dir import build_tokenizer_dir

    return str(build_tokenizer_dir(Path(tempfile.gettempdir()) / "kvgate-demo-tokenizer"))


def start_event_sims(names: list[str], flags: dict[str, Any], tokenizer: str) -> list[Sim]:
    """Replicas with the real tokenizer and KV events on ports of their own, started in parallel.

    The endpoints live in each ``Sim``'s flags, so ``Sim.restart`` binds the same ones
    again: what a restarted vLLM pod does, its sequence starting from 0.
    """
    sims = [Sim(name, free_port(), {**flags, "tokenizer": tokenizer,
                                    "kv_events": f"tcp://{HOST}:{free_port()}",
                                    "kv_events_replay": f"tcp://{HOST}:{free_port()}"},
                startup_timeout=120.0)
            for name in names]
    with ThreadPoolExecutor(len(sims)) as pool:
        list(pool.map(Sim.start, sims))
    return sims


def replica_entries(sims: list[Sim], *, events: bool = True) -> list[dict[str, Any]]:
    """kvgate's ``replicas``: with each replica's event endpoints, or (``events=False``) without."""
    out = []
    for s in sims:
        entry: dict[str, Any] = {"name": s.name, "url": s.url, "models": [MODEL]}
        if events and s.flags.get("kv_events"):
            entry.update(kv_events=s.flags["kv_events"], kv_events_replay=s.flags.get("kv_events_replay"))
        out.append(entry)
    return out


def precise_routing(tokenizer: str, **extra: Any) -> dict[str, Any]:
    """kvgate's ``routing`` for precise mode: ``prefix_affinity`` (the row ``PRECISE`` names) unless
    ``extra`` names another policy (``bench.routing_e2e``'s ``ttft precise`` rows), and token ids from
    the replicas' tokenizer."""
    return {"policy": "prefix_affinity", "tokenizers": {MODEL: tokenizer}, **extra}
