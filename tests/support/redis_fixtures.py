"""Fixtures shared by the tests that run against both one Redis server and a 3-node cluster.

Import them into a test module (``from tests.support.redis_fixtures import client, pfx, redis_service``)
to run its shared-Redis tests twice, once per kind.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from redis.asyncio import Redis

from gateway.redis_client import connect
from tests.support.redis_cluster import delete_prefix


@pytest.fixture(params=["redis", "cluster"])
def redis_service(request: pytest.FixtureRequest, redis_service: str) -> str:
    """Every shared-Redis test runs against one server and against a 3-node Redis Cluster."""
    return redis_service if request.param == "redis" else request.getfixturevalue("redis_cluster").url


@pytest.fixture
def pfx(redis_service: str) -> Iterator[str]:
    """A key prefix of this test's own on the shared Redis, deleted afterwards."""
    prefix = f"kvgate-test:{uuid.uuid4().hex[:8]}:"
    yield prefix
    delete_prefix(redis_service, prefix)


# The shared-Redis tests are about what instances share, not about a slow Redis (the
# fault tests use a private server): a generous timeout keeps a busy CI machine's
# scheduling stall from turning into a silent local fallback.
SHARED_TIMEOUT_S = 2.0


@asynccontextmanager
async def client(url: str) -> AsyncIterator[Redis]:
    r: Any = connect(url, timeout_s=SHARED_TIMEOUT_S)  # a RedisCluster for redis+cluster:// URLs
    try:
        yield r
    finally:
        await r.aclose()
