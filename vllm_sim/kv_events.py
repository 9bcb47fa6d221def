"""KV-cache events in vLLM's wire format: what the replica caches and evicts, as it happens.

The same sockets and frames as vLLM's ``ZmqEventPublisher``
(``vllm/distributed/kv_events.py``), written here from the format, not shared
with kvgate's consumer (``routing.kv_wire``), so that one cannot agree with the
other by sharing a mistake; the parity tests hold both to vLLM's own code.

* A PUB socket sends each batch as three frames: the topic, the sequence number
  (8 bytes, big-endian, from 0 at every start of the process) and a msgpack
  payload ``[ts, events, data_parallel_rank]``.
* Each event is a map tagged by ``"type"`` (vLLM since PR #42892), or with
  ``legacy`` an array whose first element is the tag (vLLM before it):
  ``BlockStored{block_hashes, parent_block_hash, token_ids, block_size, lora_id,
  medium, lora_name, extra_keys}``, ``BlockRemoved{block_hashes, medium}``,
  ``AllBlocksCleared{}``.
* Block hashes are the low 64 bits of the digest (vLLM's default) or the whole
  digest (``int_hashes=False``, ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``).
* A ROUTER socket answers a replay request ``[b"", start_seq]`` with
  ``[b"", topic, seq, payload]`` for every buffered batch from ``start_seq`` on
  (the last ``buffer_steps``), then ``[b"", b"", -1, b""]`` (vLLM 0.33; older
  versions sent no topic frame).

Sending and replay run on one thread, as in vLLM, so a slow subscriber never
stalls the engine's event loop. The ``kv_events_drop`` fault (``drop``) makes
the PUB socket lose batches while the replay buffer keeps them: the gap a
consumer must fill through replay. The ``kv_events_delay_s`` fault (``delay``)
holds each batch until that long after its step ended, in order, as a
congested link or a publisher thread starved of CPU delivers them late: the
delay in force is read while a batch waits, so lowering it releases what is
held at once. A held batch has no sequence number yet and is not in the
replay buffer (vLLM numbers a batch when its thread sends it).
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections import deque
from typing import Any, Callable

import msgpack
import zmq

from vllm_sim.kv import Cleared, PoolEvent, Removed, Stored
from vllm_sim.vllm_hash import external_hash

__all__ = ["KVEventPublisher", "encode_batch"]

log = logging.getLogger("vllm_sim.kv_events")

_END = (-1).to_bytes(8, "big", signed=True)
# vLLM's publisher queues this many messages per subscriber before PUB drops them.
_HWM = 100_000
MEDIUM_GPU = "GPU"


def _event(e: PoolEvent, block_size: int, int_hashes: bool, legacy: bool) -> Any:
    if isinstance(e, Stored):
        # vLLM's untagged per-block keys: the adapter's name on every block, then the salt on the first.
        adapter = (e.lora,) if e.lora else ()
        extra = [(*adapter, *((e.salt,) if i == 0 and e.salt else ())) or None for i in range(len(e.hashes))]
        fields: list[tuple[str, Any]] = [
            ("block_hashes", [external_hash(h, int_hashes) for h in e.hashes]),
            ("parent_block_hash", None if e.parent is None else external_hash(e.parent, int_hashes)),
            ("token_ids", list(e.token_ids)),
            ("block_size", block_size),
            ("lora_id", None),
            ("medium", MEDIUM_GPU),
            ("lora_name", e.lora),
            # vLLM 0.33 sends one entry per block, None where a block has no keys.
            ("extra_keys", extra),
            ("group_idx", 0),
        ]
        tag = "BlockStored"
    elif isinstance(e, Removed):
        fields = [("block_hashes", [external_hash(h, int_hashes) for h in e.hashes]), ("medium", MEDIUM_GPU),
                  ("group_idx", 0)]
        tag = "BlockRemoved"
    else:
        assert isinstance(e, Cleared)
        fields, tag = [], "AllBlocksCleared"
    if legacy:
        return [tag, *(v for _, v in fields)]
    return {"type": tag, **dict(fields)}


def encode_batch(events: list[PoolEvent], block_size: int, *, ts: float | None = None, int_hashes: bool = True,
                 legacy: bool = False, dp_rank: int = 0) -> bytes:
    """One batch's msgpack payload."""
    body = [_event(e, block_size, int_hashes, legacy) for e in events]
    return msgpack.packb([time.time() if ts is None else ts, body, dp_rank], use_bin_type=True)


class KVEventPublisher:
    """PUB + ROUTER sockets and a bounded replay buffer, served by one thread."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, *, block_size: int = 16,
                 topic: str = "kv-events", buffer_steps: int = 10_000, int_hashes: bool = True,
                 legacy: bool = False, drop: Callable[[], bool] = lambda: False,
                 delay: Callable[[], float] = lambda: 0.0) -> None:
        self.block_size = block_size
        self.int_hashes = int_hashes
        self.legacy = legacy
        self._drop = drop
        self._delay = delay
        self._topic = topic.encode()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, _HWM)
        self._pub.bind(endpoint)
        self._replay: zmq.Socket[bytes] | None = None
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(replay_endpoint)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        # (monotonic time the step ended, payload); None stops the thread.
        self._queue: queue.Queue[tuple[float, bytes] | None] = queue.Queue()
        self._seq = 0
        self.published = 0
        self.dropped = 0
        # Batches handed over by the engine; each counter has one writer thread.
        self._handed = 0
        self._closing = False
        self._thread = threading.Thread(target=self._serve, daemon=True, name="vllm_sim-kv-events")
        self._thread.start()

    def publish(self, events: list[PoolEvent]) -> None:
        """Queue one batch (the caller's step); encoded here, sent by the thread."""
        payload = encode_batch(events, self.block_size, int_hashes=self.int_hashes, legacy=self.legacy)
        self._handed += 1
        self._queue.put((time.monotonic(), payload))

    @property
    def pending(self) -> int:
        """Batches handed over and not yet numbered and sent (queued, or held by the delay fault)."""
        return self._handed - self._seq

    def close(self) -> None:
        self._closing = True
        self._queue.put(None)
        self._thread.join(2.0)
        self._pub.close(0)
        if self._replay is not None:
            self._replay.close(0)
        self._ctx.term()

    def _serve(self) -> None:
        while True:
            self._answer_replays(0)
            try:
                item = self._queue.get(timeout=0.01)
            except queue.Empty:
                continue
            if item is None:
                return
            ended, payload = item
            self._hold(ended)
            seq = self._seq
            self._seq += 1
            self._buffer.append((seq, payload))
            if self._drop():
                self.dropped += 1
                continue
            try:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                self.published += 1
            except zmq.ZMQError:
                log.exception("KV event publish failed")

    def _hold(self, ended: float) -> None:
        """Wait out the delay fault for a batch whose step ended at ``ended``, answering replays meanwhile."""
        while not self._closing and (wait := ended + self._delay() - time.monotonic()) > 0:
            # Short waits: a lowered delay (or close) takes effect within 50 ms.
            self._answer_replays(min(wait, 0.05))

    def _answer_replays(self, wait_s: float) -> None:
        if self._replay is None:
            if wait_s > 0:
                time.sleep(wait_s)
            return
        timeout_ms = math.ceil(wait_s * 1000)
        while self._replay.poll(timeout_ms):
            self._answer_replay()
            timeout_ms = 0

    def _answer_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            return  # not a replay request: vLLM ignores it too
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", _END, b""))
