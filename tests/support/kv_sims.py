"""Simulated replicas that publish KV events on fixed loopback ports, so they can be restarted on them."""

from __future__ import annotations

import random
from typing import Any

import httpx

from vllm_sim.server import build_app as build_sim

from .servers import ServerThread, free_port
from .stack import MODEL, sim_config

__all__ = ["EventSim", "token_prompt"]


class EventSim:
    def __init__(self, name: str, **kw: Any) -> None:
        self.name, self.kw = name, kw
        self.pub, self.replay = free_port(), free_port()
        self.server: ServerThread | None = None

    @property
    def endpoints(self) -> tuple[str, str]:
        return f"tcp://127.0.0.1:{self.pub}", f"tcp://127.0.0.1:{self.replay}"

    @property
    def url(self) -> str:
        assert self.server is not None
        return self.server.url

    @property
    def replica(self) -> Any:
        """The running simulator's ``vllm_sim.replica.Replica`` (its engine, pool and publisher)."""
        assert self.server is not None
        return self.server.config.app.state.replica

    def replica_settings(self) -> dict[str, Any]:
        """This replica's entry in kvgate's ``replicas``."""
        pub, replay = self.endpoints
        return {"name": self.name, "url": self.url, "kv_events": pub, "kv_events_replay": replay}

    def start(self) -> "EventSim":
        pub, replay = self.endpoints
        port = self.server.port if self.server is not None else None  # a restart keeps its HTTP port too
        cfg = sim_config(self.name, kv_events=pub, kv_events_replay=replay, **self.kw)
        self.server = ServerThread(build_sim(cfg), port=port).start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()

    async def complete(self, ids: list[int], salt: str | None = None, model: str = MODEL) -> None:
        body: dict[str, Any] = {"model": model, "prompt": ids, "max_tokens": 1}
        if salt:
            body["cache_salt"] = salt
        async with httpx.AsyncClient() as c:
            (await c.post(self.url + "/v1/completions", json=body, timeout=10)).raise_for_status()

    async def faults(self, **faults: Any) -> None:
        async with httpx.AsyncClient() as c:
            (await c.post(self.url + "/sim/faults", json=faults, timeout=5)).raise_for_status()


def token_prompt(seed: int, blocks: int, block_size: int = 16, tail: int = 3) -> list[int]:
    """Token ids for ``blocks`` full blocks and a partial one (ids of the MiniLM vocabulary's ordinary range)."""
    rng = random.Random(seed)
    return [rng.randrange(1000, 29_000) for _ in range(blocks * block_size + tail)]
