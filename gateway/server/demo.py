"""``kvgate demo``: kvgate in front of simulated vLLM replicas on loopback.

No Redis, no GPU: three ``vllm_sim`` replicas run in this process, kvgate
routes to them with its default policy, and the base URL, the status page's
URL (with its ``#token=``) and a copy-paste OpenAI SDK snippet are printed.
kvgate listens on the documented ports, 8080 public and 8081 admin; a port
already taken is replaced by a free one, and the banner says so.

``--precise``: the replicas tokenize with a real tokenizer directory (built
from the MiniLM package, ``vllm_sim.tokenizer_dir``) and publish KV events in
vLLM's format; kvgate tokenizes with the same directory and routes with the
prefix affinity on what the replicas report holding (``GET /admin/routing`` shows
each replica's mode).
"""

from __future__ import annotations

import socket
import sys
from typing import Any

from gateway.observe import logs
from gateway.app import build_app
from .serve import make_server, run_servers
from gateway.settings import load_settings

MODEL = "sim-model"
PUBLIC_PORT = 8080  # the ports the README documents
ADMIN_PORT = 8081
ADMIN_TOKEN = "demo-admin-token"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _available(port: int) -> bool:
    # SO_REUSEADDR as uvicorn binds: a port left in TIME_WAIT by the last demo is free.
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def pick_port(wanted: int, what: str, notes: list[str]) -> int:
    """``wanted`` if nothing listens there, else a free port, with a note saying so.

    The probe closes its socket before uvicorn binds: another process could take
    the port in between, which for a demo on a developer's machine is a crash
    with a clear "address in use", not a silent misroute.
    """
    if wanted and _available(wanted):
        return wanted
    port = _free_port()
    if wanted:
        notes.append(f"port {wanted} is taken: {what} on :{port} instead")
    return port


def _demo_tokenizer() -> str:
    """The MiniLM-based tokenizer directory, built once per user (the build is idempotent)."""
    import tempfile
    from pathlib import Path

    from vllm_sim.tokenizer_dir import build_tokenizer_dir

    return str(build_tokenizer_dir(Path(tempfile.gettempdir()) / "kvgate-demo-tokenizer"))


def _banner(port: int, admin_port: int | None, replicas: list[tuple[str, int]], notes: list[str]) -> str:
    lines = ["", *notes] if notes else [""]
    lines += [
        f"kvgate is up: base URL http://127.0.0.1:{port}/v1  (model '{MODEL}', any API key)",
        "replicas: " + ", ".join(f"{n} on :{p}" for n, p in replicas),
    ]
    if admin_port:
        lines.append(f"status page: http://127.0.0.1:{admin_port}/#token={ADMIN_TOKEN}")
        lines.append(f"admin API:   curl -H 'Authorization: Bearer {ADMIN_TOKEN}' "
                     f"http://127.0.0.1:{admin_port}/admin/status")
    lines += [
        "",
        "Try it (pip install openai):",
        "",
        "    from openai import OpenAI",
        f'    client = OpenAI(base_url="http://127.0.0.1:{port}/v1", api_key="demo")',
        "    stream = client.chat.completions.create(",
        f'        model="{MODEL}", stream=True,',
        '        messages=[{"role": "system", "content": "You are a helpful assistant."},',
        '                  {"role": "user", "content": "What is prefix caching?"}])',
        "    for chunk in stream:",
        '        print(chunk.choices[0].delta.content or "", end="", flush=True)',
        "",
        f"metrics: http://127.0.0.1:{port}/metrics   readiness: http://127.0.0.1:{port}/readyz",
        "Ctrl-C stops everything.",
        "",
    ]
    return "\n".join(lines)


async def run_demo(port: int = PUBLIC_PORT, replicas: int = 3, time_scale: float = 0.2,
                   semantic_cache: bool = True, admin_port: int = ADMIN_PORT, precise: bool = False) -> int:
    # The simulator is imported by the commands that run it, never with the gateway.
    from vllm_sim.config import SimConfig
    from vllm_sim.server import build_app as build_sim
    from vllm_sim.timing import TimingModel

    logs.configure("warning")
    notes: list[str] = []
    port = pick_port(port, "kvgate", notes)
    admin_port = pick_port(admin_port, "admin and status page", notes)
    sims: list[tuple[str, int]] = [(f"sim-{i + 1}", _free_port()) for i in range(replicas)]
    servers: list[Any] = []
    tokenizer = _demo_tokenizer() if precise else None
    entries: list[dict[str, Any]] = []
    for name, sim_port in sims:
        pub = f"tcp://127.0.0.1:{_free_port()}" if precise else None
        replay = f"tcp://127.0.0.1:{_free_port()}" if precise else None
        cfg = SimConfig(port=sim_port, model=MODEL, name=name, num_gpu_blocks=4096,
                        timing=TimingModel(time_scale=time_scale), tokenizer=tokenizer, kv_events=pub,
                        kv_events_replay=replay)
        servers.append(make_server(build_sim(cfg), "127.0.0.1", sim_port))
        entries.append({"name": name, "url": f"http://127.0.0.1:{sim_port}", "models": [MODEL],
                        "kv_events": pub, "kv_events_replay": replay})
    routing: dict[str, Any] = {"tokenizers": {MODEL: tokenizer}} if precise else {}
    if precise:
        notes.append(f"precise mode: KV events from every replica, token ids from {tokenizer}")
    settings = load_settings(overrides={
        "listen": {"host": "127.0.0.1", "port": port},
        "admin": {"host": "127.0.0.1", "port": admin_port, "token": ADMIN_TOKEN},
        "replicas": entries,
        "routing": routing,
        "semantic_cache": {"enabled": semantic_cache},
    })
    app = build_app(settings)
    gateway = make_server(app, settings.listen.host, port)
    admin = None
    try:
        from gateway.admin.api import build_admin_app
        admin = make_server(build_admin_app(app.state.runtime), "127.0.0.1", admin_port, lifespan="off")
    except ImportError:
        admin_port = 0
    print(_banner(port, admin_port or None, sims, notes), file=sys.stderr, flush=True)
    # Replicas first: kvgate's start-up health check should find them up.
    await run_servers([*servers, gateway, *([admin] if admin else [])], delay_s=0.0)
    return 0
