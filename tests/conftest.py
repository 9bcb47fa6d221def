"""Shared fixtures: anyio on asyncio, a real Redis (REDIS_URL or a private one), a Redis Cluster, vLLM."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator

import pytest
from hypothesis import settings as hypothesis_settings

# Property tests check invariants, not speed: a busy 2-core CI machine must not
# turn a slow example into a failure (speed lives in bench/).
hypothesis_settings.register_profile("kvgate", deadline=None)
hypothesis_settings.load_profile("kvgate")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tests.support.minilm import shared_minilm  # noqa: E402
from tests.support.redis_cluster import PrivateRedisCluster  # noqa: E402
from tests.support.redis_server import PrivateRedis, redis_url_from_env  # noqa: E402
from tests.support.vllm_env import BACKGROUND_NICE, VLLM, RenderServer, VllmWorker, need_vllm  # noqa: E402


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def redis_service() -> Iterator[str]:
    """A Redis URL for the session. Tests flush only keys under their own prefix/db."""
    url = redis_url_from_env()
    if url:
        yield url
        return
    server = PrivateRedis().start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def private_redis() -> Iterator[PrivateRedis]:
    """A Redis this test may kill or pause (never the shared one)."""
    server = PrivateRedis().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[PrivateRedisCluster]:
    """A private 3-primary Redis Cluster for the session (``.url`` is ``redis+cluster://…``).
    Tests keep to their own key prefixes; nothing else uses it."""
    cluster = PrivateRedisCluster().start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def minilm() -> Any:
    """all-MiniLM-L6-v2, loaded once per run (offline: it raises if it would need the network);
    stacks built with ``start_stack`` share the same model."""
    return shared_minilm()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start vLLM's worker and render server in the background if the collected tests use them."""
    used = {name for item in session.items for name in getattr(item, "fixturenames", ())}
    worker, render = "vllm_worker" in used, bool({"vllm_render", "vllm_tokdir"} & used)
    if worker or render:
        try:
            python = need_vllm()
        except pytest.skip.Exception:
            return  # the tests that need vLLM skip, saying why
        VLLM.start(python, worker=worker, render=render, nice=BACKGROUND_NICE)


def pytest_sessionfinish(session: pytest.Session) -> None:
    VLLM.close()


@pytest.fixture(scope="session")
def vllm_worker() -> VllmWorker:
    """vLLM's own Python, shared by every parity test (skips where vLLM is missing)."""
    return VLLM.worker(need_vllm())


@pytest.fixture(scope="session")
def vllm_tokdir() -> Path:
    """The tokenizer directory (built from the MiniLM package) the render server serves."""
    VLLM.start(need_vllm(), worker=False)
    assert VLLM.tokdir is not None
    return VLLM.tokdir


@pytest.fixture(scope="session")
def vllm_render() -> RenderServer:
    """vLLM's render server on ``vllm_tokdir``, serving the model ``parity-model``, for the whole run."""
    return VLLM.render(need_vllm())
