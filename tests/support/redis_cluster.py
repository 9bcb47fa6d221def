"""A local Redis Cluster for tests: three primaries on free loopback ports, no persistence."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time

import redis

from .servers import free_port


def _free_cluster_port(taken: list[int]) -> int:
    """A free port whose cluster bus port (port + 10000) is free and valid too."""
    for _ in range(200):
        port = free_port()
        if port + 10000 > 65535 or port in taken or port + 10000 in taken:
            continue
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


def _node(port: int, timeout_s: float = 0.5) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=port, socket_timeout=timeout_s, single_connection_client=True)


class PrivateRedisCluster:
    def __init__(self, nodes: int = 3) -> None:
        self.nodes = nodes
        self.procs: list[subprocess.Popen[bytes]] = []
        self.ports: list[int] = []
        self.dir: str | None = None

    @property
    def url(self) -> str:
        """The kvgate URL: any node seeds the client."""
        return f"redis+cluster://127.0.0.1:{self.ports[0]}"

    def start(self) -> "PrivateRedisCluster":
        exe, cli = shutil.which("redis-server"), shutil.which("redis-cli")
        if exe is None or cli is None:
            raise RuntimeError("redis-server and redis-cli are needed for the cluster tests")
        self.dir = tempfile.mkdtemp(prefix="kvgate-redis-cluster-")
        try:
            for i in range(self.nodes):
                port = _free_cluster_port(self.ports)
                self.ports.append(port)
                self.procs.append(subprocess.Popen(
                    [exe, "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                     "--cluster-config-file", f"{self.dir}/nodes-{i}.conf", "--cluster-node-timeout", "2000",
                     "--save", "", "--appendonly", "no", "--dir", self.dir],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            for port in self.ports:
                self._wait(lambda p=port: _node(p).ping())
            subprocess.run([cli, "--cluster", "create", *[f"127.0.0.1:{p}" for p in self.ports],
                            "--cluster-replicas", "0", "--cluster-yes"],
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30)
            for port in self.ports:
                self._wait(lambda p=port: _node(p).cluster("INFO").get("cluster_state") == "ok")
        except BaseException:
            self.stop()
            raise
        return self

    @staticmethod
    def _wait(check: object, timeout_s: float = 15.0) -> None:
        deadline = time.monotonic() + timeout_s
        error: Exception | None = None
        while True:
            try:
                if check():  # type: ignore[operator]
                    return
            except redis.RedisError as exc:
                error = exc
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis cluster did not come up: {error!r}")
            time.sleep(0.05)

    def flush(self) -> None:
        for port in self.ports:
            with _node(port, timeout_s=2) as node:
                node.flushall()

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()
        for proc in self.procs:
            proc.wait(5)
        self.procs = []
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None


def delete_prefix(url: str, prefix: str) -> None:
    """Delete a test's keys under ``prefix`` on a server or a cluster (``redis+cluster://``).
    On a cluster the stores wrap the prefix in a hash tag (``{prefix}…``): match both."""
    if url.startswith("redis+cluster://"):
        with redis.RedisCluster.from_url("redis://" + url.partition("://")[2]) as cluster:
            for key in list(cluster.scan_iter(match="*" + prefix + "*")):
                cluster.delete(key)
        return
    with redis.Redis.from_url(url) as sync:
        keys = list(sync.scan_iter(match=prefix + "*"))
        if keys:
            sync.delete(*keys)
