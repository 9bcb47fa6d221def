"""Tenant isolation and limits end to end: real SDK, real kvgate, vllm_sim, real Redis."""

from __future__ import annotations

import httpx
import openai
import pytest

from gateway.app import build_app
from gateway.settings import load_settings
from tests.support.servers import ServerThread
from tests.support.stack import MODEL, start_stack

LONG = "You are the support agent of a company that sells routers. " * 40


def _chat(client: openai.OpenAI, content: str = "What is my order status?", system: str = LONG,
          **kw: object) -> object:
    return client.chat.completions.create(model=MODEL, max_tokens=2, messages=[
        {"role": "system", "content": system}, {"role": "user", "content": content}], **kw)


def test_cross_tenant_probe_sees_no_cached_tokens() -> None:
    stack = start_stack(1, tenants=[{"name": "a", "api_keys": ["sk-a"]}, {"name": "b", "api_keys": ["sk-b"]}])
    try:
        a = openai.OpenAI(base_url=stack.base_url, api_key="sk-a", max_retries=0)
        b = openai.OpenAI(base_url=stack.base_url, api_key="sk-b", max_retries=0)
        first = _chat(a)
        probe = _chat(b)
        again = _chat(a)
        assert first.usage.prompt_tokens_details.cached_tokens == 0  # type: ignore[attr-defined]
        assert probe.usage.prompt_tokens_details.cached_tokens == 0  # type: ignore[attr-defined]
        assert again.usage.prompt_tokens_details.cached_tokens > 0  # type: ignore[attr-defined]
    finally:
        stack.close()


def test_shared_namespace_shares_and_client_salt_is_overwritten() -> None:
    stack = start_stack(1, tenants=[{"name": "a", "api_keys": ["sk-a"], "namespace": "team"},
                                    {"name": "b", "api_keys": ["sk-b"], "namespace": "team"},
                                    {"name": "c", "api_keys": ["sk-c"]}])
    try:
        a, b, c = (openai.OpenAI(base_url=stack.base_url, api_key=k, max_retries=0) for k in ("sk-a", "sk-b", "sk-c"))
        _chat(a)
        assert _chat(b).usage.prompt_tokens_details.cached_tokens > 0  # type: ignore[attr-defined]
        # c guesses the salt value a plain client would use, and sends a's namespace name: no effect.
        for i, guess in enumerate(("team", "", "a")):
            secret = f"Account {i}: " + LONG
            _chat(a, system=secret)
            probe = _chat(c, system=secret, extra_body={"cache_salt": guess})
            assert probe.usage.prompt_tokens_details.cached_tokens == 0  # type: ignore[attr-defined]
    finally:
        stack.close()


def test_hygiene_flags_timestamp_above_boundary_only() -> None:
    stack = start_stack(1, tenants=[{"name": "a", "api_keys": ["sk-a"]}])
    try:
        http = httpx.Client(base_url=stack.base_url, headers={"authorization": "Bearer sk-a"}, timeout=10)
        bad = http.post("/chat/completions", json={"model": MODEL, "max_tokens": 1, "messages": [
            {"role": "system", "content": "Current time: 2026-11-30T08:14:49Z. You are helpful."},
            {"role": "user", "content": "hi"}]})
        assert "timestamp" in bad.headers.get("x-kvgate-prefix-warning", "")
        fine = http.post("/chat/completions", json={"model": MODEL, "max_tokens": 1, "messages": [
            {"role": "system", "content": "You are helpful."},
            {"role": "user", "content": "It is 2026-11-30T08:14:49Z now; what day is it?"}]})
        assert "x-kvgate-prefix-warning" not in fine.headers
        metrics = httpx.get(stack.url + "/metrics", timeout=5).text
        assert 'kvgate_prefix_warnings_total{kind="timestamp",tenant="a"} 1.0' in metrics
    finally:
        stack.close()


def test_model_allow_list_and_401() -> None:
    stack = start_stack(1, tenants=[{"name": "a", "api_keys": ["sk-a"], "models": ["other"]}])
    try:
        a = openai.OpenAI(base_url=stack.base_url, api_key="sk-a", max_retries=0)
        with pytest.raises(openai.NotFoundError):
            _chat(a)
        with pytest.raises(openai.AuthenticationError):
            _chat(openai.OpenAI(base_url=stack.base_url, api_key="sk-nobody", max_retries=0))
    finally:
        stack.close()


def test_rate_limits_hold_across_two_instances_sharing_redis(redis_service: str) -> None:
    stack = start_stack(1, redis_url=redis_service,
                        tenants=[{"name": "rl-shared", "api_keys": ["sk-rl"], "requests_per_minute": 4}])
    second = ServerThread(build_app(load_settings(environ={}, overrides={
        "redis_url": redis_service, "replicas": [{"name": "r1", "url": stack.sim_url("r1")}],
        "tenants": [{"name": "rl-shared", "api_keys": ["sk-rl"], "requests_per_minute": 4}]}))).start()
    try:
        import redis as sync_redis
        sync_redis.Redis.from_url(redis_service).delete(*sync_redis.Redis.from_url(redis_service).keys(
            "kvgate:rl:*rl-shared*") or ["none"])
        one = openai.OpenAI(base_url=stack.base_url, api_key="sk-rl", max_retries=0)
        two = openai.OpenAI(base_url=second.url + "/v1", api_key="sk-rl", max_retries=0)
        for client in (one, two, one, two):
            _chat(client)
        with pytest.raises(openai.RateLimitError) as e:
            _chat(two)
        retry_after = e.value.response.headers.get("retry-after")
        assert retry_after is not None and int(retry_after) >= 1
        with pytest.raises(openai.RateLimitError):
            _chat(one)
        ready = httpx.get(stack.url + "/readyz", timeout=5).json()
        assert not any("rate_limits" in d for d in ready["degraded"])
    finally:
        second.stop()
        stack.close()
