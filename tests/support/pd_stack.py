"""A kvgate in front of simulated replicas in P/D roles (tests.support.pd_sims), on loopback.

Each sim is a ``PDSim`` (its side channel on its own HTTP port, KV events on); kvgate's
config gives each replica the same role as its sim. ``PDStack`` starts and stops them
together and reads what the sims did.
"""

from __future__ import annotations

from typing import Any

import httpx

from gateway.admin.api import build_admin_app
from gateway.app import build_app
from gateway.runtime import Runtime
from gateway.settings import load_settings

from .minilm import shared_minilm
from .pd_sims import PDSim
from .servers import ServerThread
from .stack import GatewayAt, _merge

__all__ = ["PDStack"]

ADMIN_TOKEN = "pd-admin-token"


class PDStack(GatewayAt):
    def __init__(self, roles: dict[str, str], *, sim: dict[str, Any] | None = None,
                 per_sim: dict[str, dict[str, Any]] | None = None, events: bool = False, **overrides: Any) -> None:
        """``events``: kvgate subscribes to every sim's KV events (precise mode, with a tokenizer)."""
        self.sims = {name: PDSim(name, role, **{**(sim or {}), **((per_sim or {}).get(name, {}))})
                     for name, role in roles.items()}
        for s in self.sims.values():
            s.__enter__()
        base: dict[str, Any] = {
            "replicas": [{"name": n, "url": s.url, "role": roles[n],
                          **({"kv_events": f"tcp://127.0.0.1:{s.pub}", "kv_events_replay": f"tcp://127.0.0.1:{s.replay}"}
                             if events else {})} for n, s in self.sims.items()],
            "pool": {"health_interval_s": 60, "metrics_interval_s": 60}, "admin": {"token": ADMIN_TOKEN},
        }
        self.settings = load_settings(environ={}, overrides=_merge(base, overrides))
        app = build_app(self.settings, runtime=Runtime(self.settings, embedding_loader=shared_minilm))
        self.gateway = ServerThread(app).start()
        self.admin = self.gateway.beside(build_admin_app(app.state.runtime))

    def admin_get(self, path: str) -> Any:
        r = httpx.get(self.admin.url + path, headers={"authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=5)
        r.raise_for_status()
        return r.json()

    def admin_post(self, path: str, body: Any) -> httpx.Response:
        return httpx.post(self.admin.url + path, json=body, headers={"authorization": f"Bearer {ADMIN_TOKEN}"},
                          timeout=5)

    def pd(self, name: str) -> dict[str, int]:
        """The sim's P/D counters (vllm_sim.pd.PDStats)."""
        return dict(self.sims[name].replica.pd.stats.as_dict())

    def requests(self, name: str) -> int:
        return int(self.sims[name].stats()["requests"])

    def faults(self, name: str, **faults: Any) -> None:
        httpx.post(self.sims[name].url + "/sim/faults", json=faults, timeout=5).raise_for_status()

    def close(self) -> None:
        self.admin.stop()
        self.gateway.stop()
        for s in self.sims.values():
            s.__exit__(None, None, None)
