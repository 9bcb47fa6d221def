"""``kvgate demo`` as a real process: the documented ports unless taken, and a status-page URL that works."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest

from gateway.server.cli import build_parser
from gateway.settings import AdminSettings, ListenSettings
from tests.support.procs import ROOT
from tests.support.servers import free_port

_URL = re.compile(r"status page: (http://127\.0\.0\.1:(\d+)/#token=(\S+))")
_BASE = re.compile(r"base URL (http://127\.0\.0\.1:(\d+)/v1)")


def _start_demo(tmp: Path, *args: str, timeout: float = 30) -> tuple[subprocess.Popen[bytes], str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    log = tmp / "demo.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "gateway.server.cli", "demo", "--no-semantic-cache",
                                 "--replicas", "2", "--time-scale", "0", *args],
                                env=env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while not _URL.search(log.read_text()):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"kvgate demo printed no status page URL: {log.read_text()[-2000:]}")
        time.sleep(0.05)
    return proc, log.read_text()


@pytest.fixture
def demo_proc() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        p.terminate()
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()


def _ready(base: str) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(base.removesuffix("/v1") + "/readyz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "demo never became ready"
        time.sleep(0.05)


def _check_serving(banner: str) -> int:
    """The printed URLs work: the SDK through the base URL, the admin API with the URL's token."""
    page, admin_port, token = _URL.search(banner).groups()  # type: ignore[union-attr]
    base = _BASE.search(banner).group(1)  # type: ignore[union-attr]
    _ready(base)
    sdk = openai.OpenAI(base_url=base, api_key="demo", max_retries=0)
    assert sdk.chat.completions.create(model="sim-model", max_tokens=2,
                                       messages=[{"role": "user", "content": "hi"}]).choices
    admin = page.split("#", 1)[0]
    assert "<title>kvgate status</title>" in httpx.get(admin, timeout=5).text
    assert httpx.get(admin + "admin/status", timeout=5).status_code == 401
    status = httpx.get(admin + "admin/status", headers={"authorization": f"Bearer {token}"}, timeout=5)
    assert status.status_code == 200 and status.json()["totals"]["requests"] == 1
    return int(admin_port)


def test_the_documented_ports_are_the_defaults() -> None:
    args = build_parser().parse_args(["demo"])
    assert (args.port, args.admin_port) == (8080, 8081)
    assert (ListenSettings().port, AdminSettings().port) == (8080, 8081)
    readme = (ROOT / "README.md").read_text()
    assert "127.0.0.1:8081/#token=" in readme and "127.0.0.1:8080/v1" in readme


def test_demo_listens_where_asked_and_prints_the_status_page_with_its_token(
        tmp_path: Path, demo_proc: list[subprocess.Popen[bytes]]) -> None:
    port, admin_port = free_port(), free_port()
    proc, banner = _start_demo(tmp_path, "--port", str(port), "--admin-port", str(admin_port))
    demo_proc.append(proc)
    assert "taken" not in banner
    assert f"status page: http://127.0.0.1:{admin_port}/#token=demo-admin-token" in banner
    assert f"base URL http://127.0.0.1:{port}/v1" in banner
    assert _check_serving(banner) == admin_port


def test_demo_moves_off_taken_ports_and_says_so(tmp_path: Path, demo_proc: list[subprocess.Popen[bytes]]) -> None:
    held = []
    for _ in range(2):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen()
        held.append(s)
    port, admin_port = (s.getsockname()[1] for s in held)
    try:
        proc, banner = _start_demo(tmp_path, "--port", str(port), "--admin-port", str(admin_port))
        demo_proc.append(proc)
        assert re.search(rf"port {port} is taken: kvgate on :\d+ instead", banner), banner
        assert re.search(rf"port {admin_port} is taken: admin and status page on :\d+ instead", banner), banner
        moved = _check_serving(banner)
        assert moved != admin_port
    finally:
        for s in held:
            s.close()


def test_demo_precise_routes_on_the_replicas_kv_events(tmp_path: Path,
                                                        demo_proc: list[subprocess.Popen[bytes]]) -> None:
    proc, banner = _start_demo(tmp_path, "--port", str(free_port()), "--admin-port", str(free_port()),
                               "--precise", timeout=180)  # three tokenizers load first (transformers)
    demo_proc.append(proc)
    assert "precise mode: KV events from every replica" in banner
    page, _, token = _URL.search(banner).groups()  # type: ignore[union-attr]
    base = _BASE.search(banner).group(1)  # type: ignore[union-attr]
    _ready(base)
    admin = page.split("#", 1)[0] + "admin/routing"
    auth = {"authorization": f"Bearer {token}"}
    deadline = time.monotonic() + 30
    while not all(r["mode"] == "precise" for r in httpx.get(admin, headers=auth, timeout=5).json()
                  ["kv_events"]["replicas"].values()):
        assert time.monotonic() < deadline, "the replicas' event streams never went live"
        time.sleep(0.1)
    sdk = openai.OpenAI(base_url=base, api_key="demo", max_retries=0)
    system = {"role": "system", "content": "You answer questions about caching. " * 40}
    served = []
    for question in ("What is prefix caching?", "What is a KV block?", "Why route by prefix?"):
        raw = sdk.chat.completions.with_raw_response.create(
            model="sim-model", max_tokens=2, messages=[system, {"role": "user", "content": question}])
        raw.parse()
        served.append(raw.headers["x-kvgate-replica"])
        time.sleep(0.3)  # the replica's events for the shared system prompt arrive
    assert len(set(served)) == 1  # every request follows the blocks the first one cached
    stats = httpx.get(admin, headers=auth, timeout=5).json()
    assert stats["policy"] == "ttft" and stats["precise_decisions"] >= 2
    assert stats["tokenization"]["models"]["sim-model"]["mode"] == "in-process"
