"""A fleet of real processes on loopback for chaos and soak runs: vllm_sim replicas, Redis, one kvgate.

Real processes because the faults worth testing are process faults: SIGKILL
drops every TCP connection at once and refuses new ones; SIGSTOP leaves
sockets open with nobody answering. Everything binds 127.0.0.1 only, and
every wait here is bounded.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from bench.ports import free_port
from vllm_sim.process import start_sim_process

ROOT = Path(__file__).resolve().parent.parent

MODEL = "sim-model"
HOST = "127.0.0.1"


def _kill(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.kill()
    if proc is not None:
        proc.wait(10)


@dataclass
class Sim:
    """One vllm_sim process; ``restart`` brings it back on the same port with the same flags."""

    name: str
    port: int
    flags: dict[str, Any]
    proc: subprocess.Popen[bytes] | None = None
    # Loading a real tokenizer (--tokenizer) takes seconds more, and longer with several starting at once.
    startup_timeout: float = 20.0

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> "Sim":
        self.proc = start_sim_process(self.port, host=HOST, name=self.name, model=MODEL,
                                      startup_timeout=self.startup_timeout, **self.flags)
        return self

    def kill(self) -> None:
        """SIGKILL: every open connection drops, new ones are refused."""
        _kill(self.proc)
        self.proc = None

    def restart(self) -> None:
        self.kill()
        self.start()


class RedisProc:
    """A private redis-server that can be killed, paused and restarted on the same port."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="kvgate-chaos-redis-")
        self.proc: subprocess.Popen[bytes] | None = None
        self.paused = False

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = 10.0) -> "RedisProc":
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed")
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", HOST, "--save", "", "--appendonly", "no",
             "--dir", self.dir],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.paused = False
        deadline = time.monotonic() + timeout
        while True:
            try:
                with socket.create_connection((HOST, self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(64).startswith(b"+PONG"):
                        return self
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.05)

    def kill(self) -> None:
        if self.paused and self.alive:
            self.resume()
        _kill(self.proc)
        self.proc = None

    def dbsize(self) -> int:
        with socket.create_connection((HOST, self.port), timeout=2) as s:
            s.sendall(b"DBSIZE\r\n")
            reply = s.recv(64)  # ":<n>\r\n"
        return int(reply[1:].split(b"\r\n")[0])

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        if self.proc is not None and self.paused:
            self.proc.send_signal(signal.SIGCONT)
        self.paused = False

    def restart(self) -> None:
        self.kill()
        self.start()

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


@dataclass
class LocalServer:
    """A server started as its own process on a loopback port, with its log."""

    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


class Kvgate(LocalServer):
    """A kvgate process (``start_kvgate``)."""


def start_kvgate(workdir: Path, config: dict[str, Any], *, timeout: float = 60.0) -> Kvgate:
    """``python -m gateway.server.cli serve`` as its own process; returns once /readyz answers 200."""
    path = workdir / "kvgate.yaml"
    path.write_text(yaml.safe_dump(config))
    log_path = workdir / "kvgate.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "gateway.server.cli", "serve", "--config", str(path)],
                                env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    gw = Kvgate(config["listen"]["port"], proc, log_path)
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(gw.url + "/readyz", timeout=1).status_code == 200:
                return gw
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            _kill(proc)
            raise RuntimeError(f"kvgate did not become ready:\n{gw.log_tail()}")
        time.sleep(0.05)


def kvgate_config(port: int, sims: list[Sim], **sections: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "listen": {"host": HOST, "port": port},
        "admin": {"enabled": False},
        # A sim started with a P/D ``role`` has the same role in kvgate.
        "replicas": [{"name": s.name, "url": s.url, "models": [MODEL],
                      **({"role": s.flags["role"]} if "role" in s.flags else {})} for s in sims],
        "log_level": "warning",
        "shutdown_delay_s": 0,
        "shutdown_grace_s": 2,
    }
    config.update(sections)
    return config


def start_sims(names: list[str], flags: dict[str, Any], roles: dict[str, str] | None = None) -> list[Sim]:
    """Start the replicas in parallel (each takes about a second to import and bind), each with its
    ``--role`` from ``roles`` when given."""
    sims = [Sim(name, free_port(), {**flags, **({"role": roles[name]} if roles else {})}) for name in names]
    with ThreadPoolExecutor(len(sims)) as pool:
        list(pool.map(Sim.start, sims))
    return sims


@dataclass
class Fleet:
    sims: list[Sim]
    gateway: Kvgate
    redis: RedisProc | None = None
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="kvgate-chaos-")))

    def sim(self, name: str) -> Sim:
        return next(s for s in self.sims if s.name == name)

    def close(self) -> None:
        # Gateway first, so it does not spend its last seconds health-checking dead replicas.
        _kill(self.gateway.proc)
        for s in self.sims:
            s.kill()
        if self.redis is not None:
            self.redis.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


def start_fleet(*, replicas: int = 4, sim_flags: dict[str, Any] | None = None, with_redis: bool = True,
                gateway: dict[str, Any] | None = None, roles: dict[str, str] | None = None) -> Fleet:
    """Replicas r1..rN (or, with ``roles``, one per name in its P/D role), optionally Redis, then
    kvgate in front of them. Closes what it started on failure."""
    workdir = Path(tempfile.mkdtemp(prefix="kvgate-chaos-"))
    sims: list[Sim] = []
    redis: RedisProc | None = None
    try:
        names = list(roles) if roles else [f"r{i + 1}" for i in range(replicas)]
        sims = start_sims(names, sim_flags or {}, roles)
        sections = dict(gateway or {})
        if with_redis:
            redis = RedisProc().start()
            sections["redis_url"] = redis.url
        gw = start_kvgate(workdir, kvgate_config(free_port(), sims, **sections))
    except BaseException:
        for s in sims:
            s.kill()
        if redis is not None:
            redis.close()
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    return Fleet(sims, gw, redis, workdir)


# -- reading kvgate's own view -----------------------------------------------------------------------
def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {"name{labels}": value} (histogram buckets skipped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#") or "_bucket{" in line:
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name] = float(value)
        except ValueError:
            continue
    return out


def metric_sum(metrics: dict[str, float], name: str) -> float:
    return sum(v for k, v in metrics.items() if k == name or k.startswith(name + "{"))
