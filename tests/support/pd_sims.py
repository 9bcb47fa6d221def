"""Simulated replicas in P/D roles (vllm_sim.pd) on loopback, and the router's three steps by hand.

Each sim's HTTP port is chosen before its config is built, so the ``remote_port`` a
prefill puts in its ``kv_transfer_params`` is the port its side channel really listens
on. KV events are on (PUB and replay on their own free ports), so a test can read
what a replica cached through vLLM's replay socket.
"""

from __future__ import annotations

from typing import Any, Iterator

import httpx
import msgpack
import zmq

from vllm_sim.server import build_app as build_sim

from .servers import ServerThread, free_port
from .stack import sim_config

__all__ = ["PDSim", "REMOTE_DECODE", "chat", "prefill_body", "decode_body", "reference_sim", "replayed_stored"]

# What a router sends a prefill replica (vLLM's toy proxy and vllm-router alike).
REMOTE_DECODE: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                 "remote_block_ids": None, "remote_host": None, "remote_port": None}


class PDSim:
    def __init__(self, name: str, role: str = "both", **kw: Any) -> None:
        self.name = name
        for attempt in range(5):
            # A port found free may be taken by another test process before it is bound: try others.
            self.port, self.pub, self.replay = free_port(), free_port(), free_port()
            cfg = sim_config(name, role=role, port=self.port, kv_events=f"tcp://127.0.0.1:{self.pub}",
                             kv_events_replay=f"tcp://127.0.0.1:{self.replay}", **kw)
            try:
                self.server = ServerThread(build_sim(cfg), port=self.port)
                break
            except (OSError, zmq.ZMQError):  # the HTTP port, or a KV-event socket's (zmq raises its own)
                if attempt == 4:
                    raise

    def __enter__(self) -> "PDSim":
        self.server.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.stop()

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def replica(self) -> Any:
        return self.server.config.app.state.replica

    def stats(self) -> dict[str, Any]:
        return httpx.get(self.url + "/sim/stats", timeout=5).json()

    def stored_token_ids(self) -> list[tuple[int, ...]]:
        return replayed_stored(f"tcp://127.0.0.1:{self.replay}")


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """Step 1: the request as a router sends it to a prefill replica."""
    return {**body, "kv_transfer_params": dict(REMOTE_DECODE), "stream": False, "max_tokens": 1,
            "max_completion_tokens": 1}


def decode_body(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """Step 3: the original request with the params the prefill returned."""
    return {**body, "kv_transfer_params": params}


def replayed_stored(endpoint: str, timeout_ms: int = 5000) -> list[tuple[int, ...]]:
    """The ``token_ids`` of every ``BlockStored`` a replica's replay socket still buffers."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
    sock.connect(endpoint)
    out: list[tuple[int, ...]] = []
    try:
        sock.send_multipart((b"", (0).to_bytes(8, "big")))
        while True:
            frames = sock.recv_multipart()
            seq = int.from_bytes(frames[-2], "big", signed=True)
            if seq == -1:
                return out
            _, events, _ = msgpack.unpackb(frames[-1], raw=False)
            out.extend(tuple(ev["token_ids"]) for ev in events if ev.get("type") == "BlockStored")
    finally:
        sock.close()


def chat(text: str) -> list[dict[str, str]]:
    """Several KV blocks of prompt, distinct from the first block on (tests share the replicas)."""
    return [{"role": "system", "content": f"{text}: " + "You answer with care. " * 20},
            {"role": "user", "content": text}]


def reference_sim() -> Iterator[PDSim]:
    """A plain replica outside kvgate, for the right answers (a module fixture's body)."""
    with PDSim("ref") as sim:
        yield sim
