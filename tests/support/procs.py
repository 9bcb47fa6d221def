"""kvgate and vllm_sim as real processes, for tests that send signals or need separate CPUs."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[2]


def start_kvgate(tmp: Path, config: dict[str, Any], *, name: str = "kvgate", wait: bool = True,
                 timeout: float = 30.0) -> subprocess.Popen[bytes]:
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    log = open(tmp / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen([sys.executable, "-m", "gateway.server.cli", "serve", "--config", str(path)],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    if wait:
        wait_ready(proc, tmp, config, name=name, timeout=timeout)
    return proc


def wait_ready(proc: subprocess.Popen[bytes], tmp: Path, config: dict[str, Any], *, name: str = "kvgate",
               timeout: float = 30.0) -> None:
    """Until a kvgate started with ``start_kvgate(..., wait=False)`` answers /readyz with 200."""
    url = f"http://{config['listen']['host']}:{config['listen']['port']}/readyz"
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"kvgate did not become ready: {(tmp / f'{name}.log').read_text()[-2000:]}")
        time.sleep(0.05)


@contextmanager
def sim_process(model: str, **timing: Any) -> Iterator[str]:
    """A simulated replica in its own process (``timing``: its TimingModel fields); yields its URL."""
    from tests.support.servers import free_port
    from vllm_sim.process import start_sim_process

    port = free_port()
    proc = start_sim_process(port, model=model, **timing)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait(5)
