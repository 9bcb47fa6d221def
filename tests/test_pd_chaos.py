"""The two kvgate faults the P/D chaos run (``bench.chaos_pd``, tests/test_chaos.py) found, fixed and pinned.

* A decode replica that dies after it pulled the blocks (the connection dropped after the request
  was sent) must not have its ``kv_transfer_params`` sent to another decode replica: the prefill
  replica freed the blocks once read, and reading them again is a wrong answer once they are
  reused. The decode leg is sent once (``UpstreamCall.once``); its retry prefills again.
* The last decode-capable replica is never ejected (``ReplicaPool._eject``), whatever prefill
  replicas remain: only it can serve a whole request.

Real processes or servers on loopback, every answer checked against vllm_sim's deterministic one.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx

from bench.chaos_check import expected_answer
from bench.chaos_fleet import MODEL, start_fleet
from tests.support.pd_stack import PDStack


def _body(text: str) -> dict[str, Any]:
    # Several KV blocks of prompt, so the decode replica has blocks to pull.
    return {"model": MODEL, "max_tokens": 8,
            "messages": [{"role": "system", "content": "You answer with care. " * 20},
                         {"role": "user", "content": text}]}


def test_a_decode_replica_dying_after_its_pull_is_not_retried_with_the_same_params() -> None:
    # Both decodes hold each request 3 s after pulling (a unary answer sends no byte before its end);
    # the one that pulled is SIGKILLed then: kvgate meets a dropped connection, not a refused one.
    # Before that p1 drops its cache: the freed blocks reused, as on a busy prefill replica.
    fleet = start_fleet(roles={"p1": "prefill", "d1": "decode", "d2": "decode"}, with_redis=False,
                        gateway={"routing": {"disaggregation": "always"}, "timeouts": {"first_byte_s": 20.0},
                                 "pool": {"health_interval_s": 60.0}})
    try:
        decodes = [fleet.sim("d1"), fleet.sim("d2")]
        for sim in decodes:
            httpx.post(sim.url + "/sim/faults", json={"stall_before_first_token_s": 3.0}).raise_for_status()
        body = _body("dies after its pull")
        answer: dict[str, httpx.Response] = {}
        sender = threading.Thread(target=lambda: answer.setdefault("r", httpx.post(
            fleet.gateway.url + "/v1/chat/completions", json=body, timeout=30)))
        sender.start()
        deadline = time.monotonic() + 10
        while not (pulled := [s for s in decodes
                              if httpx.get(s.url + "/sim/stats").json()["kv_transfer"]["transfers"]]):
            assert time.monotonic() < deadline, "no decode replica pulled the blocks"
            time.sleep(0.02)
        httpx.post(fleet.sim("p1").url + "/sim/reset").raise_for_status()
        pulled[0].kill()
        sender.join(30)
        r = answer["r"]
        # A clean error would do; a 200 must carry the right answer.
        if r.status_code == 200:
            assert r.json()["choices"][0]["message"]["content"] == expected_answer(body).texts[0]
    finally:
        fleet.close()


def test_the_last_decode_replica_is_never_ejected() -> None:
    stack = PDStack({"p1": "prefill", "d1": "decode"}, routing={"disaggregation": "always"},
                    pool={"eject_consecutive_failures": 2, "health_interval_s": 60})
    try:
        stack.faults("d1", error_rate=1.0, error_status=500)
        for i in range(2):
            r = httpx.post(stack.url + "/v1/chat/completions", json=_body(f"fails {i}"), timeout=10)
            assert r.status_code >= 500, r.text
        stack.faults("d1")  # d1 answers again
        body = _body("d1 is back")
        r = httpx.post(stack.url + "/v1/chat/completions", json=body, timeout=10)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == expected_answer(body).texts[0]
    finally:
        stack.close()
