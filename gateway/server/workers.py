"""``kvgate serve --workers N``: a supervisor process and N kvgate workers on one port.

Each worker is a whole kvgate (``kvgate serve`` with a hidden ``--worker-id``):
its own runtime, pool and routing policy. They agree on routing the way
separate kvgate instances do (rendezvous order over the same membership, the
same scraped load, and ``routing.share_index`` through Redis when a ``redis_url`` is set);
nothing is shared between them in memory.

One port, several processes: each worker listens on its own ``SO_REUSEPORT``
socket, and the kernel spreads new connections over the listening ones by a
hash of the connection. A shared pre-forked socket was the alternative; with
an event loop that accepts greedily (uvloop accepts until the backlog is
empty) one worker takes most of a burst of connections. The supervisor only
holds the ports (bound, never listening), so they stay ours while a worker
restarts, and a worker joins the port only when its start-up is done.

The supervisor:
- makes a private run directory (0700) for the Prometheus multiprocess files
  (``PROMETHEUS_MULTIPROC_DIR``), the other workers' admin sockets and
  ``workers.json``, and removes it at exit;
- forwards SIGTERM and SIGINT to every worker (each drains as a single
  process does: ``/readyz`` 503, ``shutdown_delay_s``, then
  ``shutdown_grace_s`` for streams), a second signal forces them; it exits
  once all have, with status 0 when all exited cleanly;
- restarts a worker that dies, at once the first time and after a growing
  pause (up to 30 s) while it keeps dying within seconds of its start.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import multiprocess

from .serve import reuse_port_socket
from gateway.settings import Settings
from .worker_info import metrics_dir, write_state

log = logging.getLogger("kvgate.workers")

# A worker that lived shorter than this is crash-looping: wait before the next start.
_QUICK_DEATH_S = 5.0
_MAX_PAUSE_S = 30.0


@dataclass
class _Slot:
    id: int
    proc: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    restarts: int = 0
    quick_deaths: int = 0
    next_start: float = 0.0
    exit_codes: list[int] = field(default_factory=list)


class Supervisor:
    def __init__(self, settings: Settings, config_path: str | None, workers: int) -> None:
        self.settings = settings
        self.config_path = config_path
        self.count = workers
        self.run_dir = Path(tempfile.mkdtemp(prefix="kvgate-workers-"))  # mode 0700
        metrics_dir(self.run_dir).mkdir()
        self.slots = [_Slot(i) for i in range(workers)]
        self.reserved: list[socket.socket] = []
        self.env: dict[str, str] = {}
        self.signals = 0

    # -- lifecycle ----------------------------------------------------------
    def run(self) -> int:
        try:
            try:
                self._reserve_ports()
            except OSError as e:  # the port is someone else's: nothing to supervise
                log.error("cannot bind the listeners", extra={"error": str(e)})
                return 1
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, self._on_signal)
            for slot in self.slots:
                if not self.signals:
                    self._start(slot)
            self._watch()
            return 0 if all(s.exit_codes[-1] == 0 for s in self.slots if s.exit_codes) else 1
        finally:
            for slot in self.slots:  # only if we got here by an exception
                if slot.proc is not None and slot.proc.poll() is None:
                    slot.proc.kill()
                    slot.proc.wait()
            for sock in self.reserved:
                sock.close()
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def _reserve_ports(self) -> None:
        """Hold the public (and admin) port; a configured port 0 becomes a fixed one here,
        handed to the workers as KVGATE_LISTEN__PORT (the usual override)."""
        s = self.settings
        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir(self.run_dir))}
        listeners = [("LISTEN", s.listen.host, s.listen.port)]
        if s.admin.enabled:
            listeners.append(("ADMIN", s.admin.host, s.admin.port))
        for name, host, port in listeners:
            sock = reuse_port_socket(host, port)
            self.reserved.append(sock)
            env[f"KVGATE_{name}__PORT"] = str(sock.getsockname()[1])
        self.env = env

    def _argv(self, slot: _Slot) -> list[str]:
        argv = [sys.executable, "-m", "gateway.server.cli", "serve", "--workers", str(self.count),
                "--worker-id", str(slot.id), "--run-dir", str(self.run_dir)]
        if self.config_path:
            argv += ["--config", self.config_path]
        return argv

    def _start(self, slot: _Slot) -> None:
        # A session of its own: a terminal's Ctrl-C reaches the supervisor only, which
        # forwards it once (the worker would take a second copy as "force exit").
        slot.proc = subprocess.Popen(self._argv(slot), env=self.env, start_new_session=True)
        slot.started = time.monotonic()
        log.info("worker started", extra={"worker": slot.id, "pid": slot.proc.pid})
        self._publish()

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.signals += 1
        for slot in self.slots:
            if slot.proc is not None and slot.proc.poll() is None:
                slot.proc.send_signal(signal.SIGTERM)

    # -- the loop -------------------------------------------------------------
    def _watch(self) -> None:
        while True:
            now = time.monotonic()
            alive = 0
            for slot in self.slots:
                if slot.proc is not None:
                    code = slot.proc.poll()
                    if code is None:
                        alive += 1
                        continue
                    self._reap(slot, code, now)
                if not self.signals and slot.proc is None and now >= slot.next_start:
                    slot.restarts += 1
                    self._start(slot)
                    alive += 1
            if self.signals and not alive:
                return
            time.sleep(0.05)

    def _reap(self, slot: _Slot, code: int, now: float) -> None:
        assert slot.proc is not None
        pid = slot.proc.pid
        slot.proc = None
        slot.exit_codes.append(code)
        # Its live gauges (in flight) leave the sums; its counters stay in them.
        multiprocess.mark_process_dead(pid, str(metrics_dir(self.run_dir)))
        self._publish()
        if self.signals:
            return
        lived = now - slot.started
        slot.quick_deaths = slot.quick_deaths + 1 if lived < _QUICK_DEATH_S else 0
        pause = min(_MAX_PAUSE_S, 0.5 * 2 ** slot.quick_deaths) if slot.quick_deaths > 1 else 0.0
        slot.next_start = now + pause
        log.warning("worker died; restarting", extra={"worker": slot.id, "pid": pid, "exit_code": code,
                                                       "lived_s": round(lived, 1), "pause_s": pause})

    def _publish(self) -> None:
        running = [s for s in self.slots if s.proc is not None and s.proc.poll() is None]
        write_state(self.run_dir, {
            "configured": self.count, "running": len(running), "supervisor_pid": os.getpid(),
            "workers": [{"id": s.id, "pid": s.proc.pid if s.proc is not None else None,
                         "restarts": s.restarts} for s in self.slots],
        })


def supervise(settings: Settings, config_path: str | None, workers: int) -> int:
    return Supervisor(settings, config_path, workers).run()
