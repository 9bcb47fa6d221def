"""The README's status-page screenshot, taken for real: kvgate over vllm_sim, minutes of traffic, headless Chromium.

Three simulated replicas (the demo's timing model) behind one kvgate with the
semantic cache, three tenants and trend samples every 2 s (90 of them: a
3-minute window, so the picture fills in minutes rather than 15), each in its
own process; the load comes from this one. The traffic has phases an operator
would want to see in the trend lines:

1. steady: each tenant's users ask questions under a stable system prompt;
2. a burst: three times the clients;
3. a regression: one tenant starts putting the time in its system prompt, so
   its prefix no longer caches (hit rate drops, TTFT rises, hygiene warns);
4. recovery, half the questions asked again (semantic-cache hits).

    python -m bench.status_screenshot --out docs/status.png     # about 3.5 minutes
    python -m bench.status_screenshot --phase-s 10 --out /tmp/status.png   # quicker, sparser lines
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import yaml

from vllm_sim.process import start_sim_process

MODEL = "sim-model"
TOKEN = "screenshot-admin-token"
TENANTS = {"acme": "sk-acme-demo", "globex": "sk-globex-demo", "initech": "sk-initech-demo"}
SYSTEM = {
    "acme": "You are Acme's support assistant for routers and mesh Wi-Fi. Answer briefly and cite the manual. " * 8,
    "globex": "You are Globex's internal HR assistant. Policies: leave, travel, expenses, benefits. " * 8,
    "initech": "You are Initech's coding assistant for the TPS report service (Python, Postgres). " * 8,
}
QUESTIONS = ["How do I reset the device?", "What does the blinking orange light mean?", "How do I file expenses?",
             "How many vacation days do I get?", "Why does the report job time out?", "How do I add a user?",
             "Where are the logs?", "How do I upgrade the firmware?", "What is the travel policy for flights?"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _user(client: openai.AsyncOpenAI, tenant: str, until: float, clock: dict[str, Any]) -> None:
    rng = random.Random(f"{tenant}-{id(client)}")
    while time.monotonic() < until:
        system = SYSTEM[tenant]
        if clock["timestamp"] == tenant:
            system = f"Current time: {time.strftime('%Y-%m-%dT%H:%M:%S')}. " + system
        question = rng.choice(QUESTIONS)
        if rng.random() >= clock["repeat"]:  # the share of questions asked again as they were
            question += f" (ticket {rng.randrange(10**6)})"
        try:
            stream = await client.chat.completions.create(
                model=MODEL, stream=True,  # no max_tokens: a cut-off answer is never cached
                messages=[{"role": "system", "content": system}, {"role": "user", "content": question}])
            async for _ in stream:
                pass
        except openai.APIError:
            pass
        await asyncio.sleep(rng.uniform(0.2, 0.6))


async def _phase(name: str, seconds: float, users: int, clock: dict[str, Any], base_url: str) -> None:
    print(f"phase {name}: {users} users per tenant for {seconds:.0f} s", file=sys.stderr, flush=True)
    until = time.monotonic() + seconds
    clients = {t: openai.AsyncOpenAI(base_url=base_url, api_key=k, max_retries=0) for t, k in TENANTS.items()}
    await asyncio.gather(*(_user(clients[t], t, until, clock) for t in TENANTS for _ in range(users)))
    for c in clients.values():
        await c.close()


async def _shoot(url: str, out: Path, width: int, height: int) -> None:
    exe = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if exe is None:
        raise SystemExit("Chromium is not installed (apt-get install chromium)")
    profile = tempfile.mkdtemp(prefix="kvgate-chromium-")
    proc = await asyncio.create_subprocess_exec(
        exe, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--hide-scrollbars", f"--user-data-dir={profile}",
        "--virtual-time-budget=4000", f"--window-size={width},{height}", f"--screenshot={out}", url,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    await asyncio.wait_for(proc.wait(), 120)
    shutil.rmtree(profile, ignore_errors=True)


def _start_kvgate(config: dict[str, Any], tmp: Path) -> subprocess.Popen[bytes]:
    path = tmp / "kvgate.yaml"
    path.write_text(yaml.safe_dump(config))
    log = open(tmp / "kvgate.log", "wb")  # noqa: SIM115 - lives as long as the process
    proc = subprocess.Popen([sys.executable, "-m", "gateway.server.cli", "serve", "--config", str(path)],
                            stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    url = f"http://127.0.0.1:{config['listen']['port']}/readyz"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"kvgate did not become ready: {(tmp / 'kvgate.log').read_text()[-2000:]}")


async def main(args: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="kvgate-screenshot-"))
    sims = [(f"sim-{i + 1}", _free_port()) for i in range(3)]
    port, admin_port = _free_port(), _free_port()
    procs = [start_sim_process(p, name=n, model=MODEL, kv_blocks=4096, time_scale=0.2) for n, p in sims]
    try:
        procs.append(_start_kvgate({
            "listen": {"host": "127.0.0.1", "port": port},
            "admin": {"host": "127.0.0.1", "port": admin_port, "token": TOKEN,
                      "trend_interval_s": args.interval_s, "trend_samples": 90},
            "replicas": [{"name": n, "url": f"http://127.0.0.1:{p}", "models": [MODEL]} for n, p in sims],
            "tenants": [{"name": t, "api_keys": [k]} for t, k in TENANTS.items()],
            "semantic_cache": {"enabled": True},
            "log_level": "warning", "shutdown_delay_s": 0, "shutdown_grace_s": 1,
        }, tmp))
        # The embedding model loads in the background after /readyz: give it its few seconds.
        await asyncio.sleep(8)
        await _traffic(args, f"http://127.0.0.1:{port}/v1", admin_port)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(15)
        shutil.rmtree(tmp, ignore_errors=True)


async def _traffic(args: argparse.Namespace, base_url: str, admin_port: int) -> None:
    clock: dict[str, Any] = {"timestamp": None, "repeat": 0.0}
    await _phase("steady", args.phase_s, 2, clock, base_url)
    await _phase("burst", args.phase_s / 2, 6, clock, base_url)
    await _phase("steady", args.phase_s / 2, 2, clock, base_url)
    clock["timestamp"] = "globex"
    await _phase("globex puts the time in its system prompt", args.phase_s, 2, clock, base_url)
    clock.update(timestamp=None, repeat=0.5)
    last = asyncio.create_task(_phase("recovery, questions asked again", args.phase_s, 2, clock, base_url))
    await asyncio.sleep(args.phase_s - 5)  # the picture while traffic still flows
    await _shoot(f"http://127.0.0.1:{admin_port}/#token={TOKEN}", args.out.resolve(), args.width, args.height)
    await last
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("docs/status.png"))
    parser.add_argument("--phase-s", type=float, default=45.0, help="length of the steady/regression/recovery phases")
    parser.add_argument("--interval-s", type=float, default=2.0, help="admin.trend_interval_s for the run")
    parser.add_argument("--width", type=int, default=1400)
    parser.add_argument("--height", type=int, default=1150)
    asyncio.run(main(parser.parse_args()))
