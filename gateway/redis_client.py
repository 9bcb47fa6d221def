"""The one place that turns ``redis_url`` into a client: one server or a Redis Cluster.

    redis://[user:pass@]host:port/db, rediss://…, unix://…   one server (``redis.asyncio.Redis``)
    redis+cluster://[user:pass@]host:port                  a Redis Cluster (``redis.asyncio.RedisCluster``)
    rediss+cluster://…                                      the same over TLS

For a cluster, ``host:port`` is any one node: the client asks it for the slot map
and then talks to every primary directly (no database number in cluster mode).
Query-string options are passed on as redis-py's ``from_url`` does.

``policies`` (rate limits, tenant store) take the ready client; ``semantic_cache``
takes a ``connect(read_timeout_s)`` callable built here, because it opens a second
client with a longer read timeout for its blocking stream reads. Neither package
parses URL schemes, so neither depends on the gateway.

Keys that one Lua script or MULTI touches together must share a hash slot on a
cluster: the stores see that they were given a ``RedisCluster`` and wrap their key
prefix in a hash tag (``{kvgate:tenants:}tenants``, ``{kvgate:sc:}e:<id>``). On a
single server the key names are unchanged.
"""

from __future__ import annotations

from typing import Any, Callable

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
Client = aioredis.Redis | aioredis.RedisCluster


def is_cluster_url(url: str) -> bool:
    return url.partition("://")[0].lower() in CLUSTER_SCHEMES


def connect(url: str, *, timeout_s: float, read_timeout_s: float | None = None,
            **single: Any) -> Client:
    """A client for ``url``; connect timeout ``timeout_s``, read timeout ``read_timeout_s``
    (default the same). ``single`` adds options for a single-server client only."""
    read = timeout_s if read_timeout_s is None else read_timeout_s
    scheme, _, rest = url.partition("://")
    if scheme.lower() in CLUSTER_SCHEMES:
        # No client retries (a retry on a hung node multiplies the wait, and the callers'
        # breakers take over); the client re-reads the slot map after MOVED/ASK or a failure.
        return aioredis.RedisCluster.from_url(
            f"{CLUSTER_SCHEMES[scheme.lower()]}://{rest}", socket_timeout=read, socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0), health_check_interval=0)
    return aioredis.Redis.from_url(url, socket_timeout=read, socket_connect_timeout=timeout_s, **single)


def connector(url: str) -> Callable[[float, float], Client]:
    """``connect`` bound to ``url``: ``f(timeout_s, read_timeout_s)`` (for the semantic cache)."""
    def make(timeout_s: float, read_timeout_s: float) -> Client:
        return connect(url, timeout_s=timeout_s, read_timeout_s=read_timeout_s, retry=Retry(NoBackoff(), 0),
                       health_check_interval=0)
    return make
