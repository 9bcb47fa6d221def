"""P/D beside the rest of kvgate: tenants' salts on both legs, mixed fleets, selective decisions,
admission's slots per leg, ``kvgate check`` (gateway.proxy.disagg over vllm_sim.pd)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest

from gateway.server.check import check_fleet
from policies import cache_salt
from routing.token_keys import block_keys
from tests.support.kv_sims import token_prompt
from tests.support.pd_sims import PDSim
from tests.support.pd_stack import PDStack
from tests.support.stack import MODEL
from vllm_sim.tokenizer_dir import build_tokenizer_dir

TENANTS = [{"name": "a", "api_keys": ["sk-a"]}, {"name": "b", "api_keys": ["sk-b"]}]


def chat(text: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": "You are the support desk of a router maker. " * 20},
            {"role": "user", "content": text}]


def ask(base_url: str, key: str, messages: list[dict[str, str]]) -> httpx.Headers:
    with openai.OpenAI(base_url=base_url, api_key=key, max_retries=0) as client:
        raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages,  # type: ignore
                                                                max_tokens=4)
        raw.parse()
        return raw.headers


def kv(stack: PDStack, name: str) -> dict[str, int]:
    return stack.sims[name].stats()["kv_transfer"]  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def salted() -> Iterator[PDStack]:
    # Tenants turn admission on: every leg takes and gives back a slot.
    s = PDStack({"p1": "prefill", "d1": "decode"}, routing={"disaggregation": "always"}, tenants=TENANTS)
    yield s
    s.close()


def test_each_tenants_salt_is_on_both_legs(salted: PDStack) -> None:
    messages = chat("Which firmware fixes the reboot loop?")
    ask(salted.base_url, "sk-a", messages)
    hit = salted.runtime.disagg.prefill_cached
    before = kv(salted, "d1")
    # The same prompt from a: the prefill replica reuses a's blocks (same salt on the prefill
    # leg), and the decode replica, holding them under a's salt, pulls only the last block.
    ask(salted.base_url, "sk-a", messages)
    assert salted.runtime.disagg.prefill_cached > hit
    again = kv(salted, "d1")
    assert again["transfer_tokens"] - before["transfer_tokens"] <= 16
    # From b: another salt on both legs. The prefill replica reuses nothing of a's (no cached
    # tokens), and the decode replica pulls the whole prompt, its own blocks not matching a's.
    cached = salted.runtime.disagg.prefill_cached
    ask(salted.base_url, "sk-b", messages)
    assert salted.runtime.disagg.prefill_cached == cached
    after = kv(salted, "d1")
    prompt = salted.runtime.disagg.prefill_prompt
    assert after["transfer_tokens"] - again["transfer_tokens"] > 16 * 10
    assert prompt > 0


def test_admissions_slots_are_each_legs_and_all_come_back(salted: PDStack) -> None:
    rt = salted.runtime
    assert rt.admission.active
    # Concurrent requests of both tenants, each holding a slot per leg in turn.
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: ask(salted.base_url, ("sk-a", "sk-b")[i % 2], chat(f"slot {i}")), range(16)))

    def settled() -> bool:
        # The client has its last byte a moment before the relay closes the upstream and lets go.
        return (sum(rt.admission.shares.held(t) for t in ("a", "b")) == 0
                and all(r.in_flight == 0 for r in rt.pool.replicas.values()))

    deadline = time.monotonic() + 5
    while not settled() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert settled()
    assert rt.admission.stats()["tenants"].get("b", {}).get("timeout", 0) == 0


def test_a_mixed_fleet_serves_correctly_and_may_serve_a_request_whole_on_a_both_replica() -> None:
    roles = {"p1": "prefill", "d1": "decode", "b1": "both"}
    with PDSim("ref") as ref:
        stack = PDStack(roles)  # selective
        try:
            served = set()
            for i in range(8):
                messages = chat(f"mixed fleet question {i}")
                headers = ask(stack.base_url, "x", messages)
                served.add(headers["x-kvgate-replica"])
                with openai.OpenAI(base_url=stack.base_url, api_key="x", max_retries=0) as client:
                    got = client.chat.completions.create(model=MODEL, messages=messages,  # type: ignore
                                                         max_tokens=6).choices[0].message.content
                want = httpx.post(ref.url + "/v1/chat/completions", timeout=10, json={
                    "model": MODEL, "messages": messages, "max_tokens": 6}).json()["choices"][0]["message"]["content"]
                assert got == want
            # Never decoded on the prefill replica; the both replica took requests whole.
            assert served <= {"d1", "b1"} and "b1" in served
            stats = stack.runtime.disagg.stats()
            # Every request decided, and a prefill leg exactly for those decided remote. (On an idle
            # fleet a cold prefill replica costs what a local prefill does, so most stay local.)
            assert stats["decisions"]["local"] + stats["decisions"]["remote"] == 16
            assert stats["decisions"]["local"] > 0
            assert stack.sims["p1"].stats()["requests"] == stats["decisions"]["remote"]
        finally:
            stack.close()


@pytest.mark.parametrize("policy", ["prefix_affinity", "ttft"])
def test_selective_keeps_a_follow_up_local_and_explains_why(policy: str) -> None:
    stack = PDStack({"p1": "prefill", "d1": "decode"}, routing={"policy": policy})
    try:
        messages = chat("What does the amber light mean?")
        ask(stack.base_url, "x", messages)
        # The follow-up turn: most of its prompt is now on d1.
        follow = [*messages, {"role": "assistant", "content": "It means updating."},
                  {"role": "user", "content": "How long does it take?"}]
        r = stack.admin_post("/admin/routing/explain", {"body": {"model": MODEL, "messages": follow}})
        assert r.status_code == 200, r.text
        row = r.json()["disaggregation"]
        assert row["remote"] is False and row["mode"] == "selective"
        assert row["terms"]["uncached_decode"] < row["terms"]["uncached_prefill"]
        ask(stack.base_url, "x", follow)
        assert stack.sims["p1"].stats()["requests"] == 0
    finally:
        stack.close()


def test_kvgate_check_reports_each_replicas_role() -> None:
    stack = PDStack({"p1": "prefill", "d1": "decode", "b1": "both"})
    try:
        checks = {(c.replica, c.name): c for c in check_fleet(stack.settings, timeout_s=5)}
        assert checks[("p1", "role")].detail.startswith("prefill")
        assert checks[("d1", "role")].detail.startswith("decode")
        assert checks[("b1", "role")].detail.startswith("both")
    finally:
        stack.close()


def test_precise_mode_learns_the_prefill_leg_at_the_prefill_replica_and_the_pulled_blocks_at_the_decode(
        tmp_path: Path) -> None:
    tokenizer = build_tokenizer_dir(tmp_path / "model")
    stack = PDStack({"p1": "prefill", "d1": "decode"}, events=True, routing={
        "disaggregation": "always", "tokenizers": {MODEL: str(tokenizer)}})
    try:
        ids = token_prompt(29, 6)
        with openai.OpenAI(base_url=stack.base_url, api_key="x", max_retries=0) as client:
            client.completions.create(model=MODEL, prompt=ids, max_tokens=2)
        kv = stack.runtime.kv_events
        assert kv is not None
        keys = block_keys(ids, 16, cache_salt("default", stack.settings.server_secret.get_secret_value()))

        def held() -> dict[str, float]:
            return dict(kv.index.held(keys, ["p1", "d1"]))

        deadline = time.monotonic() + 10
        while held() != {"p1": 6, "d1": 6} and time.monotonic() < deadline:
            time.sleep(0.02)
        # Both replicas' own events: the prefill computed the 6 full blocks, the decode pulled them.
        assert held() == {"p1": 6, "d1": 6}
        assert kv_stats(stack, "d1")["transfer_blocks"] == 7  # and the partial one
    finally:
        stack.close()


def kv_stats(stack: PDStack, name: str) -> dict[str, int]:
    return stack.sims[name].stats()["kv_transfer"]  # type: ignore[no-any-return]
