"""P/D disaggregation between simulated replicas (vllm_sim.pd), the router's three steps by hand over HTTP.

Step 1 sends the request to a prefill replica with ``do_remote_decode``; step 2 takes
the ``kv_transfer_params`` it answers with; step 3 sends the original request with
them to a decode replica, which pulls what it lacks over the prefill's side channel.
The simulator's answers are deterministic, so a decode's answer must equal a plain
replica's, and its counters and KV events show that it pulled rather than prefilled.
"""

from __future__ import annotations

import time
from typing import Any, Iterator

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.kv_sims import token_prompt
from tests.support.pd_sims import REMOTE_DECODE, PDSim, decode_body, prefill_body
from tests.support.stack import MODEL

BS = 16
# The keys and value types of NixlPullConnectorScheduler.request_finished's dict, plus the
# scheduler's remote_prefill_cached_tokens (tests/test_sim_pd_vllm_parity.py checks them against vLLM).
PARAM_TYPES: dict[str, Any] = {
    "do_remote_prefill": bool, "do_remote_decode": bool, "remote_block_ids": list, "remote_engine_id": str,
    "remote_request_id": str, "remote_host": str, "remote_port": int, "tp_size": int, "dcp_size": int,
    "pp_size": int, "remote_num_tokens": int, "remote_blocks_expiry_time": type(None),
    "remote_registration_generation": int, "transfer_mode": str, "remote_prefill_cached_tokens": int,
}


@pytest.fixture(scope="module")
def pd() -> Iterator[tuple[PDSim, PDSim, PDSim]]:
    """A prefill, a decode and a plain replica (the reference answers)."""
    with PDSim("p", "prefill") as p, PDSim("d", "decode") as d, PDSim("plain") as plain:
        yield p, d, plain


def chat(text: str, **extra: Any) -> dict[str, Any]:
    # Several blocks of prompt, unique from the first block on: tests share the replicas.
    system = f"{text}: " + "You are a careful assistant. " * 20
    return {"model": MODEL, "messages": [{"role": "system", "content": system},
                                         {"role": "user", "content": text}], "max_tokens": 12, **extra}


def completion(ids: list[int]) -> dict[str, Any]:
    return {"model": MODEL, "prompt": ids, "max_tokens": 10}


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=10)


def three_steps(p: PDSim, d: PDSim, path: str, body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    first = post(p.url, path, prefill_body(body))
    assert first.status_code == 200, first.text
    params = first.json()["kv_transfer_params"]
    second = post(d.url, path, decode_body(body, params))
    assert second.status_code == 200, second.text
    return first.json(), second.json()


def text_of(answer: dict[str, Any]) -> str:
    choice = answer["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def test_the_prefill_answers_one_token_and_vllm_shaped_params_and_holds_the_blocks(pd: tuple[PDSim, ...]) -> None:
    p, d, _ = pd
    answer = post(p.url, "/v1/chat/completions", prefill_body(chat("what is a block?"))).json()
    params = answer["kv_transfer_params"]
    assert {k: type(v) for k, v in params.items()} == PARAM_TYPES
    prompt = answer["usage"]["prompt_tokens"]
    assert answer["usage"]["completion_tokens"] == 1
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_engine_id"] == p.replica.pd.engine_id
    assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", p.port)
    assert params["remote_num_tokens"] == prompt
    assert len(params["remote_block_ids"]) == 1 and len(params["remote_block_ids"][0]) == -(-prompt // BS)
    assert params["transfer_mode"] == "pull" and params["tp_size"] == 1
    assert p.stats()["kv_held_requests"] >= 1
    # The decode leg, so the held blocks do not wait for the lease.
    assert post(d.url, "/v1/chat/completions", decode_body(chat("what is a block?"), params)).status_code == 200


def test_the_decode_answers_as_a_plain_replica_would_from_pulled_blocks(pd: tuple[PDSim, ...]) -> None:
    p, d, plain = pd
    body = chat("how are blocks pulled?")
    expected = post(plain.url, "/v1/chat/completions", body).json()
    before_p, before_d = p.stats(), d.stats()
    stored_before = sum(map(len, d.stored_token_ids()))
    first, second = three_steps(p, d, "/v1/chat/completions", body)
    prompt = second["usage"]["prompt_tokens"]
    assert text_of(second) == text_of(expected) and prompt == expected["usage"]["prompt_tokens"]
    assert second["kv_transfer_params"] is None  # vLLM's decode returns none
    after_p, after_d = p.stats(), d.stats()
    moved = after_d["kv_transfer"]["transfer_blocks"] - before_d["kv_transfer"]["transfer_blocks"]
    assert moved == -(-prompt // BS)  # nothing of it was on the decode replica
    assert after_d["kv_transfer"]["transfer_tokens"] - before_d["kv_transfer"]["transfer_tokens"] == prompt
    # The decode computed none of the prompt; the prefill computed it.
    assert after_d["prefill_computed_tokens_sum"] == before_d["prefill_computed_tokens_sum"]
    assert after_p["prefill_computed_tokens_sum"] > before_p["prefill_computed_tokens_sum"]
    # The prefill freed the blocks once read; the decode reports the prefill's hit as cached.
    assert after_p["kv_transfer"]["reads"] == before_p["kv_transfer"]["reads"] + 1
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == \
        first["kv_transfer_params"]["remote_prefill_cached_tokens"]
    # Its KV events store the pulled blocks (every full one), as vLLM caches loaded blocks.
    assert sum(map(len, d.stored_token_ids())) - stored_before == prompt // BS * BS
    # /metrics says the same, in vLLM's names where it has them.
    metrics = scrape(d)
    assert metrics["vllm_sim:kv_transfer_blocks_total"] == after_d["kv_transfer"]["transfer_blocks"]
    assert metrics["vllm:external_prefix_cache_hits_total"] == after_d["kv_transfer"]["external_hits"]
    assert metrics["vllm:nixl_xfer_time_seconds_count"] == after_d["kv_transfer"]["transfers"]
    assert scrape(p)["vllm_sim:kv_remote_prefills_total"] == after_p["kv_transfer"]["remote_prefills"]


def scrape(sim: PDSim) -> dict[str, float]:
    text = httpx.get(sim.url + "/metrics", timeout=5).text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if "le" not in s.labels}


def test_blocks_the_decode_holds_are_not_pulled_again(pd: tuple[PDSim, ...]) -> None:
    p, d, plain = pd
    ids = token_prompt(7, 6)  # 6 full blocks and 3 tokens
    assert post(d.url, "/v1/completions", completion(ids[: 4 * BS + 1])).status_code == 200  # 4 blocks cached on d
    before = d.stats()["kv_transfer"]
    stored_before = len(d.stored_token_ids())
    _, second = three_steps(p, d, "/v1/completions", completion(ids))
    after = d.stats()["kv_transfer"]
    assert after["transfer_blocks"] - before["transfer_blocks"] == 3  # blocks 4, 5 and the partial one
    assert after["transfer_tokens"] - before["transfer_tokens"] == len(ids) - 4 * BS
    assert text_of(second) == text_of(post(plain.url, "/v1/completions", completion(ids)).json())
    new_runs = d.stored_token_ids()[stored_before:]
    assert [t for run in new_runs for t in run] == ids[4 * BS: 6 * BS]  # only the pulled full blocks are new


def test_a_prompt_held_whole_still_pulls_its_last_block_and_releases_the_prefills(pd: tuple[PDSim, ...]) -> None:
    p, d, _ = pd
    ids = token_prompt(8, 3, tail=0)
    assert post(d.url, "/v1/completions", completion(ids)).status_code == 200
    before_d, before_p = d.stats()["kv_transfer"], p.stats()["kv_transfer"]
    three_steps(p, d, "/v1/completions", completion(ids))
    after_d, after_p = d.stats()["kv_transfer"], p.stats()["kv_transfer"]
    # 3 blocks: vLLM's local hit stops before the last token, so 2 blocks are local and the third is pulled.
    assert after_d["transfer_blocks"] - before_d["transfer_blocks"] == 1
    assert after_p["reads"] == before_p["reads"] + 1


def test_an_unknown_engine_fails_the_request_as_vllms_default_policy_does(pd: tuple[PDSim, ...]) -> None:
    p, d, _ = pd
    body = chat("which engine?")
    params = post(p.url, "/v1/chat/completions", prefill_body(body)).json()["kv_transfer_params"]
    before = d.stats()["kv_transfer"]["failed_transfers"]
    wrong = {**params, "remote_engine_id": "no-such-engine"}
    answer = post(d.url, "/v1/chat/completions", decode_body(body, wrong))
    assert answer.status_code == 500
    assert answer.json()["error"]["type"] == "InternalServerError"
    assert d.stats()["kv_transfer"]["failed_transfers"] == before + 1
    # Nobody listening there at all: the same.
    unreachable = {**params, "remote_port": 9}
    assert post(d.url, "/v1/chat/completions", decode_body(body, unreachable)).status_code == 500
    # The right params still work: the failed attempts did not consume the held blocks.
    assert post(d.url, "/v1/chat/completions", decode_body(body, params)).status_code == 200


def test_the_recompute_policy_prefills_locally_when_the_pull_fails() -> None:
    with PDSim("p2", "prefill") as p, PDSim("d2", "decode", kv_load_failure_policy="recompute") as d, \
            PDSim("plain2") as plain:
        body = chat("recompute it")
        params = post(p.url, "/v1/chat/completions", prefill_body(body)).json()["kv_transfer_params"]
        answer = post(d.url, "/v1/chat/completions", decode_body(body, {**params, "remote_engine_id": "x"}))
        assert answer.status_code == 200
        assert text_of(answer.json()) == text_of(post(plain.url, "/v1/chat/completions", body).json())
        stats = d.stats()
        assert stats["kv_transfer"]["failed_transfers"] == 1 and stats["kv_transfer"]["transfers"] == 0
        assert stats["prefill_computed_tokens_sum"] == answer.json()["usage"]["prompt_tokens"]


def wait_for(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(0.01)


def test_expired_blocks_are_read_anyway_and_wrong_once_reused() -> None:
    with PDSim("p3", "prefill", kv_lease_s=0.05) as p, PDSim("d3", "decode") as d, PDSim("plain3") as plain:
        kept, reused = chat("kept after expiry"), chat("reused after expiry")
        params = {name: post(p.url, "/v1/chat/completions", prefill_body(body)).json()["kv_transfer_params"]
                  for name, body in (("kept", kept), ("reused", reused))}
        wait_for(lambda: p.stats()["kv_transfer"]["kv_expired_reqs"] == 2)
        assert p.stats()["kv_held_requests"] == 0
        # Freed but still cached on the prefill: the read gets the right KV.
        answer = post(d.url, "/v1/chat/completions", decode_body(kept, params["kept"])).json()
        assert text_of(answer) == text_of(post(plain.url, "/v1/chat/completions", kept).json())
        assert p.stats()["kv_transfer"]["notifications_after_expiry"] == 1
        # Its blocks reused (the prefill's cache dropped): vLLM decodes from whatever they hold.
        httpx.post(p.url + "/sim/reset", timeout=5).raise_for_status()
        answer = post(d.url, "/v1/chat/completions", decode_body(reused, params["reused"])).json()
        assert text_of(answer) != text_of(post(plain.url, "/v1/chat/completions", reused).json())
        assert p.stats()["kv_transfer"]["notifications_after_expiry"] == 1  # counted after the reset
        assert d.stats()["kv_transfer"]["stale_reads"] == 1


def test_roles_refuse_the_other_sides_leg_and_serve_plain_requests(pd: tuple[PDSim, ...]) -> None:
    p, d, plain = pd
    body = chat("roles")
    params = post(p.url, "/v1/chat/completions", prefill_body(body)).json()["kv_transfer_params"]
    refused = post(p.url, "/v1/chat/completions", decode_body(body, params))
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "kv_transfer_params"
    assert post(d.url, "/v1/chat/completions", prefill_body(body)).status_code == 400
    for sim in (p, d):
        assert post(sim.url, "/v1/chat/completions", body).status_code == 200
    # A kv_both replica takes either leg.
    assert "kv_transfer_params" in post(plain.url, "/v1/chat/completions", prefill_body(body)).json()
    assert post(d.url, "/v1/chat/completions", decode_body(body, params)).status_code == 200
    bad = post(plain.url, "/v1/chat/completions", {**body, "kv_transfer_params": "yes"})
    assert bad.status_code == 400


def test_the_messages_route_carries_the_params_both_ways(pd: tuple[PDSim, ...]) -> None:
    p, d, plain = pd
    body = {"model": MODEL, "max_tokens": 9, "system": "You answer briefly. " * 12,
            "messages": [{"role": "user", "content": "messages over P/D"}]}
    first = post(p.url, "/v1/messages", prefill_body(body)).json()
    params = first["kv_transfer_params"]
    assert params["do_remote_prefill"] is True
    second = post(d.url, "/v1/messages", decode_body(body, params)).json()
    expected = post(plain.url, "/v1/messages", body).json()
    assert second["content"] == expected["content"]


def test_the_responses_route_carries_the_params_both_ways(pd: tuple[PDSim, ...]) -> None:
    p, d, plain = pd
    body = {"model": MODEL, "input": "responses over P/D: " + "tell me more. " * 12, "max_output_tokens": 9}
    first = post(p.url, "/v1/responses", {**body, "max_output_tokens": 1, "stream": False,
                                          "kv_transfer_params": dict(REMOTE_DECODE)}).json()
    params = first["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_request_id"] == first["id"]
    before = d.stats()["kv_transfer"]["transfers"]
    second = post(d.url, "/v1/responses", decode_body(body, params)).json()
    expected = post(plain.url, "/v1/responses", body).json()
    assert second["output"][0]["content"][0]["text"] == expected["output"][0]["content"][0]["text"]
    assert second["kv_transfer_params"] is None
    assert d.stats()["kv_transfer"]["transfers"] == before + 1


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_streamed_prefill_leg_sends_the_params_on_its_last_chunk(pd: tuple[PDSim, ...], path: str) -> None:
    p, d, plain = pd
    body = chat("streamed prefill") if path == "/v1/chat/completions" else completion(token_prompt(21, 4))
    first = {**prefill_body(body), "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", p.url + path, json=first, timeout=10) as r:
        chunks = [orjson.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    last = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(last) == 1 and all("kv_transfer_params" not in c for c in chunks if c is not last[0])
    params = last[0]["kv_transfer_params"]
    assert {k: type(v) for k, v in params.items()} == PARAM_TYPES
    answer = post(d.url, path, decode_body(body, params)).json()
    assert text_of(answer) == text_of(post(plain.url, path, body).json())


def test_local_blocks_evicted_before_admission_count_as_pulled_not_computed() -> None:
    """vLLM picks local or remote when it admits the request; the simulator pulls on arrival, so
    local blocks evicted in between are counted as pulled at admission (as vLLM would pull them)."""
    import asyncio

    from vllm_sim.engine import Engine, GenRequest, RemoteLoad
    from vllm_sim.kv import KVPool
    from vllm_sim.timing import TimingModel

    ids = token_prompt(31, 4)
    late: list[int] = []

    async def run() -> tuple[int, float]:
        engine = Engine(KVPool(64, BS), TimingModel(time_scale=0))
        async with engine.generate(GenRequest("warm", ids[: 3 * BS + 1], 1)) as gen:
            async for _ in gen:
                pass
        local = engine.pool.match(engine.pool.hash_prompt(ids)) * BS  # 3 blocks held at "arrival"
        engine.pool.clear()  # evicted before admission
        before = engine.stats.prefill_computed_tokens.sum
        request = GenRequest("d", ids, 2, remote=RemoteLoad(local, None, late.append))
        async with engine.generate(request) as gen:
            async for _ in gen:
                pass
        await engine.aclose()
        return local, engine.stats.prefill_computed_tokens.sum - before

    local, computed = asyncio.run(run())
    assert local == 3 * BS and late == [3 * BS] and computed == 0


def test_the_p_d_flags_reach_the_config() -> None:
    import argparse

    from vllm_sim.cli import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = config_from_args(parser.parse_args([
        "--role", "decode", "--engine-id", "e-1", "--side-channel-host", "10.0.0.2", "--side-channel-port", "7000",
        "--kv-lease-s", "5", "--kv-load-failure-policy", "recompute", "--kv-transfer-s-per-token", "0.001"]))
    assert (config.role, config.engine_id, config.side_channel_host, config.side_channel_port) == \
        ("decode", "e-1", "10.0.0.2", 7000)
    assert (config.kv_lease_s, config.kv_load_failure_policy, config.timing.kv_transfer_s_per_token) == \
        (5.0, "recompute", 0.001)
    defaults = config_from_args(parser.parse_args([]))
    assert (defaults.role, defaults.kv_load_failure_policy, defaults.kv_lease_s) == ("both", "fail", 30.0)


def test_an_aborted_prefill_leg_frees_its_blocks_and_returns_nothing() -> None:
    """vLLM's request_finished frees an aborted request's blocks at once (no params, nothing held)."""
    with PDSim("p4", "prefill", time_scale=1.0) as p:
        body = {**prefill_body(chat("left early")), "max_tokens": 400, "max_completion_tokens": 400}  # ~4 s of decode
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(p.url + "/v1/chat/completions", json=body, timeout=0.5)
        wait_for(lambda: p.stats()["aborted"] == 1)
        stats = p.stats()
        assert stats["engine_requests"] == 1
        assert stats["kv_held_requests"] == 0 and stats["kv_transfer"]["remote_prefills"] == 0
        assert stats["kv_cache_usage_perc"] == 0.0 and stats["num_cached_blocks"] > 0  # prefilled, then freed


def test_a_decode_leg_retried_with_the_same_params_reads_freed_blocks(pd: tuple[PDSim, ...]) -> None:
    """The first read freed the prefill's blocks; a second is vLLM's 'unrecognized request': right
    while they stay cached there, wrong once they are reused."""
    p, d, plain = pd
    body = completion(token_prompt(41, 3))
    expected = text_of(post(plain.url, "/v1/completions", body).json())
    params = post(p.url, "/v1/completions", prefill_body(body)).json()["kv_transfer_params"]
    before = p.stats()["kv_transfer"]["notifications_after_expiry"]
    for _ in range(2):  # read, then read again
        assert text_of(post(d.url, "/v1/completions", decode_body(body, params)).json()) == expected
    assert p.stats()["kv_transfer"]["notifications_after_expiry"] == before + 1


def test_without_the_prefills_hit_the_decode_reports_local_and_pulled_tokens_as_cached(
        pd: tuple[PDSim, ...]) -> None:
    """vLLM's OutputProcessor reports remote_prefill_cached_tokens when the params carry it, else the
    decode's PrefillStats: local plus pulled tokens, the whole prompt."""
    p, d, _ = pd
    body = completion(token_prompt(51, 3))
    params = post(p.url, "/v1/completions", prefill_body(body)).json()["kv_transfer_params"]
    assert params["remote_prefill_cached_tokens"] == 0
    stripped = {k: v for k, v in params.items() if k != "remote_prefill_cached_tokens"}
    usage = post(d.url, "/v1/completions", decode_body(body, stripped)).json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] == len(body["prompt"])
