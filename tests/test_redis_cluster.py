"""Two kvgate instances sharing a 3-node Redis Cluster (``redis+cluster://``): rate limits,
semantic-cache entries and runtime tenants hold across both, through the real SDK."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
from redis.asyncio import RedisCluster

from gateway.admin.api import build_admin_app
from gateway.app import build_app
from gateway.redis_client import connect, is_cluster_url
from gateway.runtime import Runtime
from gateway.settings import load_settings
from tests.support.redis_cluster import PrivateRedisCluster
from tests.support.servers import ServerThread
from tests.support.stack import MODEL, Stack, start_stack

TOKEN = "admin-token-cluster"
SYSTEM = {"role": "system", "content": "You answer questions about our router product."}


@dataclass
class Pair:
    stack: Stack
    second: ServerThread

    @property
    def urls(self) -> tuple[str, str]:
        return self.stack.base_url, self.second.url + "/v1"


@pytest.fixture(scope="module")
def pair(redis_cluster: PrivateRedisCluster) -> Iterator[Pair]:
    cache = {"enabled": True, "embedder": "hash", "key_prefix": f"kvgate:test:{uuid.uuid4().hex[:8]}:"}
    tenants = [{"name": "limited", "api_keys": ["sk-limited"], "requests_per_minute": 4},
               {"name": "free", "api_keys": ["sk-free"]}]
    stack = start_stack(1, redis_url=redis_cluster.url, semantic_cache=cache, tenants=tenants)
    settings = load_settings(environ={}, overrides={
        "redis_url": redis_cluster.url, "semantic_cache": cache, "tenants": tenants, "admin": {"token": TOKEN},
        "replicas": [{"name": "r1", "url": stack.sim_url("r1")}]})
    app = build_app(settings, runtime=Runtime(settings))
    # The admin API on the same event loop as the gateway, as ``gateway.server.serve`` runs them
    # (the Redis clients belong to the loop that made them).
    second = ServerThread(_with_admin(app, build_admin_app(app.state.runtime))).start()
    try:
        yield Pair(stack, second)
    finally:
        second.stop()
        stack.close()


def _with_admin(public: Any, admin: Any) -> Any:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        target = admin if scope["type"] == "http" and scope["path"].startswith("/admin") else public
        await target(scope, receive, send)
    return app


def _sdk(base_url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)


def _ask(client: openai.OpenAI, question: str, **kw: Any) -> Any:
    return client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[SYSTEM, {"role": "user", "content": question}], **kw)


def test_the_url_scheme_selects_a_cluster_client(redis_cluster: PrivateRedisCluster) -> None:
    assert is_cluster_url(redis_cluster.url) and is_cluster_url("rediss+cluster://h:1")
    assert not is_cluster_url("redis://127.0.0.1:6379/0")
    assert isinstance(connect(redis_cluster.url, timeout_s=0.25), RedisCluster)
    assert not isinstance(connect("redis://127.0.0.1:1/0", timeout_s=0.25), RedisCluster)


def test_rate_limits_hold_across_both_instances(pair: Pair) -> None:
    one, two = (_sdk(u, "sk-limited") for u in pair.urls)
    for i in range(4):  # 4 per minute, alternating instances
        (one if i % 2 else two).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"n{i}"}], max_tokens=1)
    for client in (one, two):
        with pytest.raises(openai.RateLimitError) as err:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "over"}], max_tokens=1)
        assert int(err.value.response.headers["retry-after"]) >= 1
    assert not pair.stack.runtime.engine.limiter.degraded


def test_a_cache_entry_written_through_one_is_served_by_the_other(pair: Pair) -> None:
    one, two = (_sdk(u, "sk-free") for u in pair.urls)
    q = f"Does the router support IPv6 {uuid.uuid4().hex[:6]}?"
    first = _ask(one, q)
    assert first.headers["x-kvgate-cache"] == "miss"
    answer = first.parse().choices[0].message.content
    t = time.monotonic()
    assert pair.stack.wait_for(lambda: _ask(two, q).headers["x-kvgate-cache"] == "hit", timeout=1.0)
    assert time.monotonic() - t < 1.0
    assert _ask(two, q).parse().choices[0].message.content == answer


def test_a_tenant_created_through_one_admin_api_authenticates_on_the_other(pair: Pair) -> None:
    name = f"t{uuid.uuid4().hex[:8]}"
    with httpx.Client(base_url=pair.second.url, headers={"authorization": f"Bearer {TOKEN}"}, timeout=10) as admin:
        created = admin.post("/admin/tenants", json={"name": name, "requests_per_minute": 100})
        assert created.status_code == 201, created.text
        key = created.json()["api_key"]
        other = _sdk(pair.urls[0], key)

        def works() -> bool:
            try:
                other.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1)
                return True
            except openai.AuthenticationError:
                return False

        assert pair.stack.wait_for(works, timeout=1.0, interval=0.05)
        assert admin.delete(f"/admin/tenants/{name}").status_code == 204
        assert pair.stack.wait_for(lambda: not works(), timeout=1.0, interval=0.05)
