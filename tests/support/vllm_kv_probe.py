"""Run under vLLM's own Python (tests.support.vllm_env): vLLM's KV-event and hashing code, driven over stdin.

Importing vLLM takes most of a minute on a loaded 2-core machine, so one
process serves a whole test module: one JSON command per line on stdin, one
JSON answer per line on stdout.

* ``{"op": "hash", "cases": [{"ids": [...], "salt": s|null, "block_size": n, "lora": [name, path]|null}]}``:
  the block hashes vLLM's scheduler gives a real ``vllm.v1.request.Request`` with that
  prompt, cache_salt and LoRA adapter (``get_request_block_hasher`` with ``sha256_cbor``
  after ``init_none_hash``), as hex.
* ``{"op": "event_keys", "cases": [...as for hash]}``: the per-block ``extra_keys`` vLLM's
  block pool publishes in ``BlockStored`` for that request (``generate_block_hash_extra_keys``
  per full block, then ``to_event_extra_keys``), as JSON.
* ``{"op": "decode", "payloads": [hex, ...]}``: each payload decoded with vLLM's
  ``msgspec`` ``KVEventBatch`` decoder, re-encoded as plain JSON.
* ``{"op": "publish", "endpoint": ..., "replay": ..., "batches": [[event, ...], ...]}``: a
  ``ZmqEventPublisher`` (built by ``EventPublisherFactory`` as vLLM builds it, kept
  for later commands) publishes those batches; events are JSON maps with ``type``.
* ``{"op": "seed", "seed": s|null}``: set (or unset) PYTHONHASHSEED and run
  ``init_none_hash`` again, as a vLLM process started that way would.
* ``{"op": "quit"}``.

This file imports nothing from kvgate: it stands for vLLM.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def main() -> None:
    import msgspec
    from vllm.config.kv_events import KVEventsConfig
    from vllm.distributed.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, EventPublisherFactory,
                                            KVEventBatch)
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.lora.request import LoRARequest
    from vllm.v1.core.kv_cache_utils import (generate_block_hash_extra_keys, get_request_block_hasher,
                                             init_none_hash, to_event_extra_keys)
    from vllm.v1.request import Request

    init_none_hash(sha256_cbor)
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    publisher = None
    kinds = {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved, "AllBlocksCleared": AllBlocksCleared}

    def plain(obj: Any) -> Any:
        if isinstance(obj, bytes):
            return {"bytes": obj.hex()}
        if isinstance(obj, (list, tuple)):
            return [plain(x) for x in obj]
        if isinstance(obj, msgspec.Struct):
            return {"type": type(obj).__name__, **{f: plain(getattr(obj, f)) for f in obj.__struct_fields__}}
        return obj

    def request(case: dict[str, Any]) -> Any:
        hasher = get_request_block_hasher(case["block_size"], sha256_cbor)
        lora = case.get("lora")
        return Request("probe", case["ids"], SamplingParams(max_tokens=1), None, cache_salt=case["salt"],
                       block_hasher=hasher, lora_request=LoRARequest(lora[0], 1, lora[1]) if lora else None)

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "hash":
            answer: Any = [[bytes(h).hex() for h in request(case).block_hashes] for case in cmd["cases"]]
        elif op == "event_keys":
            answer = []
            for case in cmd["cases"]:
                req, bs = request(case), case["block_size"]
                keys = [generate_block_hash_extra_keys(req, s, s + bs, 0)[0]
                        for s in range(0, len(case["ids"]) - bs + 1, bs)]
                answer.append(to_event_extra_keys(keys))
        elif op == "decode":
            answer = [plain(decoder.decode(bytes.fromhex(p))) for p in cmd["payloads"]]
        elif op == "publish":
            if publisher is None:
                config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=cmd["endpoint"],
                                        replay_endpoint=cmd["replay"], topic="kv-events")
                publisher = EventPublisherFactory.create(config, 0)
                time.sleep(0.2)  # let the sockets bind before the first batch
            for events in cmd["batches"]:
                publisher.publish(KVEventBatch(ts=time.time(), events=[
                    kinds[e.pop("type")](**e) for e in events]))
            time.sleep(0.2)  # the publisher thread sends asynchronously
            answer = "published"
        elif op == "seed":
            os.environ.pop("PYTHONHASHSEED", None)
            if cmd["seed"] is not None:
                os.environ["PYTHONHASHSEED"] = cmd["seed"]
            init_none_hash(sha256_cbor)
            answer = "seeded"
        elif op == "quit":
            break
        else:
            answer = {"error": f"unknown op {op}"}
        print(json.dumps(answer), flush=True)
    if publisher is not None:
        publisher.shutdown()


if __name__ == "__main__":
    main()
