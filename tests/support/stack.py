"""A real stack for tests: N vllm_sim replicas and a kvgate, each on its own loopback port."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from gateway.admin.api import build_admin_app
from gateway.app import build_app
from gateway.runtime import Runtime
from gateway.settings import Settings, load_settings
from vllm_sim.config import SimConfig
from vllm_sim.server import build_app as build_sim
from vllm_sim.timing import TimingModel

from .minilm import shared_minilm
from .servers import ServerBeside, ServerThread

MODEL = "sim-model"


def sim_config(name: str, *, time_scale: float = 0.0, **kw: Any) -> SimConfig:
    timing = kw.pop("timing", None) or TimingModel(time_scale=time_scale)
    return SimConfig(name=name, model=MODEL, timing=timing, **kw)


class GatewayAt:
    """Where a test's kvgate listens, and its runtime (a ``gateway`` ServerThread attribute)."""

    gateway: ServerThread

    @property
    def url(self) -> str:
        return self.gateway.url

    @property
    def base_url(self) -> str:
        return self.gateway.url + "/v1"

    @property
    def runtime(self) -> Runtime:
        return self.gateway.config.app.state.runtime  # type: ignore[no-any-return]


@dataclass
class Stack(GatewayAt):
    sims: dict[str, ServerThread]
    gateway: ServerThread
    settings: Settings
    extra: list[ServerThread] = field(default_factory=list)
    admin: ServerBeside | None = None

    def sim_url(self, name: str) -> str:
        return self.sims[name].url

    def faults(self, name: str, **faults: Any) -> None:
        httpx.post(self.sim_url(name) + "/sim/faults", json=faults, timeout=5).raise_for_status()

    def sim_stats(self, name: str) -> dict[str, Any]:
        return httpx.get(self.sim_url(name) + "/sim/stats", timeout=5).json()  # type: ignore[no-any-return]

    def wait_for(self, predicate: Any, timeout: float = 5.0, interval: float = 0.02) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(interval)
        return bool(predicate())

    def close(self) -> None:
        if self.admin is not None:
            self.admin.stop()
        self.gateway.stop()
        for s in [*self.sims.values(), *self.extra]:
            s.stop()


def start_stack(n: int = 2, *, sim: dict[str, Any] | None = None, per_sim: dict[str, dict[str, Any]] | None = None,
                admin_token: str | None = None, span_exporter: Any = None, embedding_loader: Any = None,
                roles: dict[str, str] | None = None, **overrides: Any) -> Stack:
    """Start ``n`` simulated replicas r1..rN and a kvgate routing to them, with kvgate's default
    routing policy (ttft) unless ``routing`` says otherwise.

    ``embedding_loader`` replaces the semantic cache's model loader (see ``Runtime``); by default
    the run's one loaded MiniLM (``tests.support.minilm``). ``roles``: the P/D role of named
    replicas in kvgate's config (``ReplicaSettings.role``; the others are ``both``)."""
    sims: dict[str, ServerThread] = {}
    for i in range(n):
        name = f"r{i + 1}"
        kw = {**(sim or {}), **((per_sim or {}).get(name, {}))}
        sims[name] = ServerThread(build_sim(sim_config(name, **kw))).start()
    base: dict[str, Any] = {
        "replicas": [{"name": k, "url": v.url, **({"role": roles[k]} if roles and k in roles else {})}
                     for k, v in sims.items()],
        "pool": {"health_interval_s": 60, "metrics_interval_s": 60},
    }
    if admin_token is not None:
        base["admin"] = {"token": admin_token}
    settings = load_settings(environ={}, overrides=_merge(base, overrides))
    app = build_app(settings, runtime=Runtime(settings, span_exporter=span_exporter,
                                              embedding_loader=embedding_loader or shared_minilm))
    gateway = ServerThread(app).start()
    admin_server = None
    if admin_token is not None:
        admin_server = gateway.beside(build_admin_app(app.state.runtime))
    return Stack(sims, gateway, settings, admin=admin_server)


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out
