"""Graceful shutdown, a rolling restart under load (one worker and two), and slowloris clients (real processes)."""

from __future__ import annotations

import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from tests.support.procs import sim_process, start_kvgate, wait_ready
from tests.support.servers import free_port

MODEL = "sim-model"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "tell me a story"}], "max_tokens": 30}


@pytest.fixture(scope="module")
def sim() -> Iterator[str]:
    with sim_process(MODEL, decode_base_s=0.03, decode_s_per_seq=0.0) as url:  # streams last long enough
        yield url


def _config(port: int, sim: str, **kw: Any) -> dict[str, Any]:
    return {"listen": {"host": "127.0.0.1", "port": port}, "admin": {"enabled": False},
            "replicas": [{"name": "r1", "url": sim, "models": [MODEL]}], "log_level": "warning",
            # The delay lets a follower of /readyz see the change; the grace is sized for these
            # streams (at most 30 tokens x 30 ms), with margin for a busy machine.
            "shutdown_delay_s": 1.0, "shutdown_grace_s": 5, **kw}


def test_sigterm_turns_unready_at_once_and_lets_streams_finish(tmp_path: Path, sim: str) -> None:
    port = free_port()
    proc = start_kvgate(tmp_path, _config(port, sim))
    url = f"http://127.0.0.1:{port}"
    result: dict[str, Any] = {}

    def stream() -> None:
        with httpx.stream("POST", url + "/v1/chat/completions", json={**BODY, "stream": True}, timeout=30) as r:
            result["text"] = "".join(r.iter_text())

    t = threading.Thread(target=stream)
    t.start()
    time.sleep(0.3)  # the stream is under way (30 tokens x 30 ms)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.1)
    assert httpx.get(url + "/readyz", timeout=2).status_code == 503
    assert httpx.post(url + "/v1/chat/completions", json={**BODY, "max_tokens": 2}, timeout=5).status_code == 200
    t.join(30)
    assert result["text"].rstrip().endswith("data: [DONE]"), "the stream in flight finished"
    assert proc.wait(30) == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/healthz", timeout=2)


@pytest.mark.parametrize("workers", [1, 2])
def test_rolling_restart_under_load_loses_nothing(tmp_path: Path, sim: str, workers: int) -> None:
    ports = [free_port(), free_port()]
    configs = {p: _config(p, sim, workers=workers) for p in ports}
    # Both instances start at once; the restarts below go one at a time.
    procs: dict[int, subprocess.Popen[bytes]] = {p: start_kvgate(tmp_path, configs[p], name=f"gw{p}", wait=False)
                                                 for p in ports}
    for p in ports:
        wait_ready(procs[p], tmp_path, configs[p], name=f"gw{p}")
    ready = {p: True for p in ports}
    stop = threading.Event()
    outcomes: list[int] = []
    lock = threading.Lock()

    def endpoints() -> None:  # what a Service's endpoint controller does: follow /readyz
        while not stop.is_set():
            for p in ports:
                try:
                    ready[p] = httpx.get(f"http://127.0.0.1:{p}/readyz", timeout=0.5).status_code == 200
                except httpx.HTTPError:
                    ready[p] = False
            time.sleep(0.1)

    def client(i: int) -> None:
        with httpx.Client(timeout=30) as c:
            n = 0
            while not stop.is_set():
                live = [p for p in ports if ready[p]]
                if not live:
                    time.sleep(0.02)
                    continue
                p = live[(i + n) % len(live)]
                n += 1
                status = c.post(f"http://127.0.0.1:{p}/v1/chat/completions",
                                json={**BODY, "max_tokens": 3, "stream": bool(n % 2)}).status_code
                with lock:
                    outcomes.append(status)

    threads = [threading.Thread(target=endpoints)] + [threading.Thread(target=client, args=(i,)) for i in range(6)]
    for th in threads:
        th.start()
    try:
        for p in ports:  # one instance at a time, as a Deployment's rolling update does
            time.sleep(1.0)
            procs[p].send_signal(signal.SIGTERM)
            assert procs[p].wait(30) == 0
            procs[p] = start_kvgate(tmp_path, _config(p, sim, workers=workers), name=f"gw{p}-new")
        time.sleep(1.0)
    finally:
        stop.set()
        for th in threads:
            th.join(30)
        for proc in procs.values():
            proc.terminate()
            proc.wait(30)
    assert len(outcomes) > 50
    assert set(outcomes) == {200}, {s: outcomes.count(s) for s in set(outcomes)}


def test_slowloris_connections_are_dropped_and_do_not_starve_others(tmp_path: Path, sim: str) -> None:
    port = free_port()
    proc = start_kvgate(tmp_path, _config(port, sim, timeouts={"header_receive_s": 2.0}))
    slow: list[socket.socket] = []
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as c:
            def latency() -> float:
                samples = []
                for _ in range(20):
                    t = time.perf_counter()
                    assert c.get("/healthz").status_code == 200
                    samples.append(time.perf_counter() - t)
                return sorted(samples)[10]

            base = latency()
            for _ in range(1000):
                s = socket.create_connection(("127.0.0.1", port), timeout=5)
                s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
                slow.append(s)
            loaded = latency()
            assert loaded < max(0.05, base * 10), (base, loaded)
            time.sleep(3.0)  # past the header deadline
            dropped = 0
            for s in slow:
                s.settimeout(0.01)
                try:
                    dropped += s.recv(1) == b""
                except (ConnectionResetError, BrokenPipeError):
                    dropped += 1
                except OSError:
                    pass
            assert dropped >= 990, dropped
            assert c.post("/v1/chat/completions", json={**BODY, "max_tokens": 2}).status_code == 200
    finally:
        for s in slow:
            s.close()
        proc.terminate()
        proc.wait(30)
