"""``kvgate serve --workers 2``: two real worker processes on one port under a supervisor."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest

from tests.support.procs import ROOT, sim_process, start_kvgate
from tests.support.servers import free_port

MODEL = "sim-model"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "tell me a story"}], "max_tokens": 2}
TOKEN = "admin-token"
ADMIN = {"authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def sim() -> Iterator[str]:
    with sim_process(MODEL, decode_base_s=0.03, decode_s_per_seq=0.0) as url:  # streams last long enough
        yield url


class Gateway:
    def __init__(self, tmp: Path, sim: str, **kw: Any) -> None:
        self.port, self.admin_port = free_port(), free_port()
        config = {"listen": {"host": "127.0.0.1", "port": self.port},
                  "admin": {"host": "127.0.0.1", "port": self.admin_port, "token": TOKEN},
                  "replicas": [{"name": "r1", "url": sim, "models": [MODEL]}], "log_level": "warning",
                  # Sized for these tests: the longest stream is 40 tokens x 30 ms, so a 5 s grace
                  # has margin on a busy machine; the drain test sets its own delay.
                  "shutdown_delay_s": 0.2, "shutdown_grace_s": 5, "workers": 2, **kw}
        self.proc = start_kvgate(tmp, config)
        self.log = tmp / "kvgate.log"
        self.url = f"http://127.0.0.1:{self.port}"
        self.admin = f"http://127.0.0.1:{self.admin_port}"
        self.wait_for(lambda: self.workers()["running"] == 2)
        # "running" counts live processes; a worker joins the port's SO_REUSEPORT group only
        # once it listens, so wait until both have answered (else the kernel sends all to one).
        answered: set[str] = set()
        self.wait_for(lambda: answered.add(self.fresh("GET", "/healthz").headers["x-kvgate-worker"])
                      or answered == {"0", "1"})

    def fresh(self, method: str, path: str, **kw: Any) -> httpx.Response:
        """On a connection of its own, so the kernel picks a worker for it anew."""
        return httpx.request(method, self.url + path, headers={"connection": "close"}, timeout=10, **kw)

    def workers(self) -> dict[str, Any]:
        status = httpx.get(self.admin + "/admin/status", headers=ADMIN, timeout=5).json()
        return dict(status["workers"])

    def served_by(self, n: int = 24, **body: Any) -> list[str]:
        out = []
        for _ in range(n):
            r = self.fresh("POST", "/v1/chat/completions", json={**BODY, **body})
            assert r.status_code == 200, r.text
            out.append(r.headers["x-kvgate-worker"])
        return out

    @staticmethod
    def wait_for(check: Callable[[], bool], timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if check():
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "timed out"
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, sim: str) -> Iterator[Gateway]:
    """One two-worker kvgate for the tests below (each takes seconds to start): they count
    from what they find, and the one that kills a worker checks it came back."""
    gw = Gateway(tmp_path_factory.mktemp("workers"), sim)
    yield gw
    gw.stop()


def _sample(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{name}\{{(.*)\}} (\S+)$", line)
        if m and all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
            total += float(m.group(2))
    return total


def _scrape_each_worker(gw: Gateway) -> dict[str, str]:
    """/metrics as answered by each worker."""
    seen: dict[str, str] = {}
    for _ in range(60):
        r = gw.fresh("GET", "/metrics")
        seen[r.headers["x-kvgate-worker"]] = r.text
        if len(seen) == 2:
            return seen
    raise AssertionError(f"only worker(s) {sorted(seen)} answered /metrics")


def test_two_workers_share_the_port_and_metrics_sum_over_them(gateway: Gateway) -> None:
    before = {name: _sample(text, "kvgate_requests_total", endpoint="chat", status="200")
              for name, text in _scrape_each_worker(gateway).items()}
    durations = {name: _sample(text, "kvgate_request_duration_seconds_count", endpoint="chat")
                 for name, text in _scrape_each_worker(gateway).items()}
    assert len(set(before.values())) == 1 and before == durations, (before, durations)  # both see one sum
    start = before["0"]
    served = gateway.served_by(40)
    assert set(served) == {"0", "1"}, served  # 40 connections on one worker: odds 2^-39
    scrapes = _scrape_each_worker(gateway)
    for worker, text in scrapes.items():  # whichever worker answers, it counts both
        assert _sample(text, "kvgate_requests_total", endpoint="chat", status="200") == start + 40, worker
        assert _sample(text, "kvgate_request_duration_seconds_count", endpoint="chat") == start + 40, worker
        assert _sample(text, "kvgate_replica_up", replica="r1") == 1, worker  # one replica, not summed
    workers = gateway.workers()
    assert workers["configured"] == 2 and workers["running"] == 2 and workers["this_worker"] == 0


def test_in_flight_is_the_sum_over_workers(gateway: Gateway) -> None:
    streams: list[tuple[httpx.Client, Any]] = []
    seen = set()
    try:
        while len(streams) < 12 or len(seen) < 2:  # streams in flight on both workers (30 s each, closed early)
            assert len(streams) < 40
            client = httpx.Client(timeout=30)
            r = client.send(client.build_request("POST", gateway.url + "/v1/chat/completions",
                                                 json={**BODY, "max_tokens": 1000, "stream": True}), stream=True)
            streams.append((client, r))
            seen.add(r.headers["x-kvgate-worker"])
        n = len(streams)
        gateway.wait_for(lambda: all(_sample(text, "kvgate_replica_in_flight", replica="r1") == n
                                     for text in _scrape_each_worker(gateway).values()), timeout=5)
    finally:
        for client, r in streams:
            r.close()
            client.close()


def test_sigterm_drains_every_worker(tmp_path: Path, sim: str) -> None:
    # Time for the checks below on a busy machine (3 s was refused in two full runs beside benchmarks).
    gateway = Gateway(tmp_path, sim, shutdown_delay_s=6.0)
    try:
        _drain(gateway)
    finally:
        gateway.stop()


def _drain(gateway: Gateway) -> None:
    run_dir = _run_dir(gateway)
    assert (run_dir / "metrics").is_dir()
    texts: dict[int, str] = {}
    workers: dict[int, str] = {}

    def stream(i: int) -> None:
        with httpx.stream("POST", gateway.url + "/v1/chat/completions", headers={"connection": "close"},
                          json={**BODY, "max_tokens": 40, "stream": True}, timeout=30) as r:
            workers[i] = r.headers["x-kvgate-worker"]
            texts[i] = "".join(r.iter_text())

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    gateway.wait_for(lambda: len(workers) == 12)
    assert set(workers.values()) == {"0", "1"}, workers
    gateway.proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    readiness = {gateway.fresh("GET", "/readyz").status_code for _ in range(8)}
    assert readiness == {503}, "every worker turns unready at once"
    assert len(gateway.served_by(4)) == 4, "new requests are served during the delay"
    for t in threads:
        t.join(30)
    assert all(text.rstrip().endswith("data: [DONE]") for text in texts.values()), "streams in flight finished"
    assert gateway.proc.wait(30) == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(gateway.url + "/healthz", timeout=2)
    assert not run_dir.exists(), "the supervisor removes its run directory"


def _run_dir(gw: Gateway) -> Path:
    pid = gw.workers()["workers"][0]["pid"]
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return Path(cmdline[cmdline.index(b"--run-dir") + 1].decode())


def test_a_killed_worker_is_restarted_and_its_counts_stay_in_the_sums(gateway: Gateway) -> None:
    start = _sample(gateway.fresh("GET", "/metrics").text, "kvgate_requests_total", endpoint="chat")
    gateway.served_by(20)
    before = _sample(gateway.fresh("GET", "/metrics").text, "kvgate_requests_total", endpoint="chat")
    assert before == start + 20
    victim = gateway.workers()["workers"][1]["pid"]
    assert gateway.workers()["workers"][1]["restarts"] == 0
    os.kill(victim, signal.SIGKILL)
    gateway.wait_for(lambda: (w := gateway.workers()["workers"][1])["restarts"] == 1 and w["pid"] != victim
                     and gateway.workers()["running"] == 2)
    gateway.wait_for(lambda: "1" in gateway.served_by(4))  # the new worker 1 serves on the port
    total = _sample(gateway.fresh("GET", "/metrics").text, "kvgate_requests_total", endpoint="chat")
    assert total >= before + 4, total  # the dead worker's requests are still counted
    records = [json.loads(line) for line in gateway.log.read_text().splitlines() if line.startswith("{")]
    died = [r for r in records if r["msg"] == "worker died; restarting"]
    assert [(r["worker"], r["pid"], r["exit_code"]) for r in died] == [(1, victim, -signal.SIGKILL)]


def test_admin_changes_reach_every_worker(tmp_path: Path, gateway: Gateway) -> None:
    with sim_process("other-model", decode_base_s=0.001, decode_s_per_seq=0.0) as other:
        r = httpx.post(gateway.admin + "/admin/replicas", headers=ADMIN, timeout=10,
                       json={"name": "r2", "url": other, "models": ["other-model"]})
        assert r.status_code == 201, r.text
        assert r.headers["x-kvgate-workers-applied"] == "2/2"
        # Only a worker that learnt of r2 can serve other-model; both must.
        assert set(gateway.served_by(24, model="other-model")) == {"0", "1"}
        r = httpx.post(gateway.admin + "/admin/tenants", headers=ADMIN, json={"name": "t1"}, timeout=10)
        assert r.status_code == 409 and r.json()["error"]["code"] == "tenants_need_shared_store"


def test_workers_setting_is_validated(tmp_path: Path) -> None:
    cfg = tmp_path / "k.yaml"
    cfg.write_text("workers: 0\n")
    out = subprocess.run([sys.executable, "-m", "gateway.server.cli", "serve", "--config", str(cfg)], check=False,
                         capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 2 and "workers" in out.stderr, out.stderr


def test_a_port_in_use_fails_start_up_with_a_message(tmp_path: Path) -> None:
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        cfg = tmp_path / "k.yaml"
        cfg.write_text(f"listen: {{host: 127.0.0.1, port: {held.getsockname()[1]}}}\nadmin: {{enabled: false}}\n"
                       "workers: 2\n")
        out = subprocess.run([sys.executable, "-m", "gateway.server.cli", "serve", "--config", str(cfg)], check=False,
                             capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 1 and "cannot bind the listeners" in out.stderr, out.stderr


def test_workers_drain_and_exit_when_the_supervisor_is_killed(tmp_path: Path, sim: str) -> None:
    # A grace of 2 s: a worker drains as on SIGTERM, up to shutdown_delay_s + shutdown_grace_s
    # by design, so the 40 s wait leaves ample margin (with a 20 s grace, a full suite on
    # 2 cores sometimes used all of it).
    gateway = Gateway(tmp_path, sim, shutdown_grace_s=2)
    run_dir = _run_dir(gateway)
    pids = [w["pid"] for w in gateway.workers()["workers"]]
    gateway.proc.kill()
    gateway.proc.wait(5)
    try:
        gateway.wait_for(lambda: not any(_running(pid) for pid in pids), timeout=40)
    finally:
        for pid in pids:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(run_dir, ignore_errors=True)  # the supervisor had no chance to


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # reparented and exited, not yet reaped
