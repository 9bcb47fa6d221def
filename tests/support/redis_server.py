"""A Redis for tests: REDIS_URL when set, else a private redis-server on a free port."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from contextlib import contextmanager
from typing import Iterator

import redis

from .servers import free_port


class PrivateRedis:
    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.dir: str | None = None
        self.url: str = ""
        self.port: int = 0

    def start(self) -> "PrivateRedis":
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed and REDIS_URL is not set")
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="kvgate-redis-")
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.dir],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        self.url = f"redis://127.0.0.1:{self.port}/0"
        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis.from_url(self.url, socket_timeout=0.5).ping()
                return self
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def pause(self) -> None:
        """A hung Redis (SIGSTOP): connections stay open and nothing answers."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    @contextmanager
    def paused(self) -> Iterator[None]:
        self.pause()
        try:
            yield
        finally:
            self.resume()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(5)
            self.proc = None
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)


def redis_url_from_env() -> str | None:
    return os.environ.get("REDIS_URL") or None
