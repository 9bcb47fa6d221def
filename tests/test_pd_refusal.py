"""A client's ``kv_transfer_params`` is refused in the route's shape, and a fleet without P/D roles
never runs P/D's code (gateway.proxy.disagg)."""

from __future__ import annotations

from typing import Iterator

import anthropic
import httpx
import openai
import pytest

from tests.support.stack import MODEL, Stack, start_stack

PARAMS = {"do_remote_prefill": True, "remote_engine_id": "other-tenants-engine", "remote_block_ids": [[1, 2]],
          "remote_host": "10.0.0.9", "remote_port": 5600}
CHAT = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    s = start_stack(2)
    yield s
    s.close()


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT}),
    ("/v1/completions", {"model": MODEL, "prompt": "hello"}),
    ("/v1/responses", {"model": MODEL, "input": "hello"}),
])
def test_openai_routes_refuse_a_clients_kv_transfer_params(stack: Stack, path: str, body: dict) -> None:
    before = {n: stack.sim_stats(n)["requests"] for n in stack.sims}
    r = httpx.post(stack.url + path, json={**body, "kv_transfer_params": PARAMS}, timeout=10)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "kv_transfer_params_refused" and err["param"] == "kv_transfer_params"
    assert {n: stack.sim_stats(n)["requests"] for n in stack.sims} == before  # nothing reached a replica


def test_the_sdks_see_a_bad_request_in_their_own_shape(stack: Stack) -> None:
    with openai.OpenAI(base_url=stack.base_url, api_key="x", max_retries=0) as client:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=CHAT,  # type: ignore[arg-type]
                                                 extra_body={"kv_transfer_params": PARAMS})
        assert e.value.code == "kv_transfer_params_refused"
    with anthropic.Anthropic(base_url=stack.url, api_key="x", max_retries=0) as aclient:
        with pytest.raises(anthropic.BadRequestError) as ae:
            aclient.messages.create(model=MODEL, max_tokens=8, messages=CHAT,  # type: ignore[arg-type]
                                          extra_body={"kv_transfer_params": PARAMS})
        body = ae.value.body
        assert isinstance(body, dict) and body["type"] == "error"
        assert body["error"]["type"] == "invalid_request_error" and "kv_transfer_params" in body["error"]["message"]


def test_without_pd_roles_nothing_of_pd_runs(stack: Stack) -> None:
    rt = stack.runtime
    assert not rt.pool.disaggregated
    for stream in (False, True):
        with httpx.stream("POST", stack.base_url + "/chat/completions", timeout=10,
                          json={"model": MODEL, "messages": CHAT, "stream": stream}) as r:
            assert r.status_code == 200
            r.read()
    stats = rt.disagg.stats()
    assert stats["active"] is False and stats["legs"] == {}
    assert stats["decisions"]["remote"] == stats["decisions"]["local"] == 0
    assert stats["replicas"] == {"both": 2}
