"""What a worker process knows of its siblings: its number, how many there are, and the
private run directory the supervisor (``gateway.server.workers``) made for them.

The run directory holds the Prometheus multiprocess files (``metrics/``), the
admin sockets of workers 1..N-1 (``admin-<i>.sock``) and the supervisor's
``workers.json`` (which workers run, with their pids and restarts). Both the
supervisor and the workers import this module; it imports nothing of kvgate's.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STATE_FILE = "workers.json"


@dataclass(frozen=True)
class WorkerInfo:
    id: int
    count: int
    run_dir: Path

    @property
    def metrics_dir(self) -> Path:
        return metrics_dir(self.run_dir)

    def admin_socket(self, worker: int) -> Path:
        return admin_socket(self.run_dir, worker)

    def peer_admin_sockets(self) -> list[Path]:
        """The admin sockets of the other workers (worker 0 serves the admin port itself)."""
        return [self.admin_socket(i) for i in range(1, self.count) if i != self.id]

    def state(self) -> dict[str, Any]:
        """The supervisor's view: configured and running workers, pids, restarts."""
        try:
            return dict(json.loads((self.run_dir / STATE_FILE).read_text()))
        except (OSError, ValueError):
            return {"configured": self.count, "running": None}


def metrics_dir(run_dir: Path) -> Path:
    return run_dir / "metrics"


def admin_socket(run_dir: Path, worker: int) -> Path:
    return run_dir / f"admin-{worker}.sock"


def write_state(run_dir: Path, state: dict[str, Any]) -> None:
    """Atomically: a worker reading it mid-write sees the old state or the new one."""
    tmp = run_dir / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, run_dir / STATE_FILE)
