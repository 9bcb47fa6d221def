"""Run under vLLM's own Python (tests.support.vllm_env): one vLLM interpreter for the whole test run.

Importing vLLM takes 10-20 s on a loaded 2-core machine, so one process serves
every parity test (the session fixture ``vllm_worker``): one JSON command per
line on stdin, one JSON answer per line on the protocol pipe (the process's
original stdout; anything else written to stdout, vLLM's logger included, goes
to stderr so it cannot break a line).

* ``{"op": "run", "code": ..., "argv": [...], "stdin": ...}``: the script run as
  ``python -c code *argv`` would run it, with ``stdin`` as its standard input;
  answers ``{"returncode": n, "stdout": ..., "stderr": ...}`` (a traceback in
  stderr and returncode 1 on an exception, the code of ``sys.exit``).
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

The KV ops import vLLM's KV code on first use. This file imports nothing from
kvgate: it stands for vLLM.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import time
import traceback
from typing import Any, TextIO


def run_script(code: str, argv: list[str], stdin: str) -> dict[str, Any]:
    """``python -c code *argv`` with ``stdin``, in this interpreter (vLLM already imported)."""
    out, err = io.StringIO(), io.StringIO()
    saved_argv, saved_stdin = sys.argv, sys.stdin
    sys.argv, sys.stdin = ["-c", *argv], io.StringIO(stdin)
    returncode = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            exec(compile(code, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit as exc:
        returncode = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            err.write(f"{exc.code}\n")
    except BaseException:  # noqa: BLE001 - reported to the test, as a failed `python -c` would be
        err.write(traceback.format_exc())
        returncode = 1
    finally:
        sys.argv, sys.stdin = saved_argv, saved_stdin
    return {"returncode": returncode, "stdout": out.getvalue(), "stderr": err.getvalue()}


def main() -> None:
    # The protocol keeps the original stdout; fd 1 (and sys.stdout) become stderr, so a
    # stray print or vLLM's logger (it writes to stdout) cannot split an answer.
    channel: TextIO = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    import vllm  # noqa: F401 - the import every command needs, paid (and any failure seen) before "ready"

    print(json.dumps({"ready": True}), file=channel, flush=True)
    kv: dict[str, Any] = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        if cmd["op"] == "run":
            answer: Any = run_script(cmd["code"], cmd.get("argv", []), cmd.get("stdin", ""))
        else:
            if not kv:
                kv.update(kv_ops())
            answer = kv["handle"](cmd)
        print(json.dumps(answer), file=channel, flush=True)
    if kv:
        kv["close"]()


def kv_ops() -> dict[str, Any]:
    """vLLM's KV-event and hashing code: ``handle(cmd)`` answers one command; ``close()``."""
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

    state: dict[str, Any] = {"publisher": None}

    def handle(cmd: dict[str, Any]) -> Any:
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
            publisher = state["publisher"]
            if publisher is None:
                config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=cmd["endpoint"],
                                        replay_endpoint=cmd["replay"], topic="kv-events")
                publisher = state["publisher"] = EventPublisherFactory.create(config, 0)
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
        else:
            answer = {"error": f"unknown op {op}"}
        return answer

    def close() -> None:
        if state["publisher"] is not None:
            state["publisher"].shutdown()

    return {"handle": handle, "close": close}


if __name__ == "__main__":
    main()
