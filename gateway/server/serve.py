"""Run kvgate's listeners (public and admin) in one process and event loop.

Signals are handled here rather than by each uvicorn server, so shutdown is one
sequence for the whole process: on SIGTERM ``/readyz`` turns 503 at once; new
requests are still served for ``shutdown_delay_s`` (load balancers need that
long to take the pod out); then the listeners close, the requests waiting in
the fair queue are answered 503 (``gateway.proxy.admission``), streams in flight
get up to ``shutdown_grace_s`` to finish, and the process exits. A second signal
exits at once.

With ``workers: N`` a supervisor (``gateway.server.workers``) runs N such processes;
each binds its own listening socket to the one port with ``SO_REUSEPORT``
(``reuse_port_socket``), so the kernel spreads connections over them, and
each watches its parent: a worker whose supervisor is gone drains and exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from typing import Any, Callable, Iterator, Literal

import uvicorn

from .protocol import protocol_with_header_deadline

log = logging.getLogger("kvgate.serve")


class _Server(uvicorn.Server):
    sockets: list[socket.socket] | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # Our own handler (below) coordinates every listener of the process.
        yield


def run(main: Any) -> Any:
    """Run a coroutine on uvloop when it is installed (uvicorn[standard] brings it): the
    event loop's own cost is a large share of a proxy's per-request overhead."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.run(main)
    return uvloop.run(main)


def make_server(app: Any, host: str, port: int, *, lifespan: Literal["auto", "on", "off"] = "on",
                header_timeout_s: float = 10.0, grace_s: float = 30.0,
                sock: socket.socket | None = None, **kw: Any) -> uvicorn.Server:
    """A uvicorn server on host:port, or on ``sock`` when given (a worker's SO_REUSEPORT socket)."""
    config = uvicorn.Config(app, host=host, port=port, lifespan=lifespan, log_config=None, access_log=False,
                            timeout_keep_alive=30, http=protocol_with_header_deadline(header_timeout_s),
                            timeout_graceful_shutdown=max(1, int(grace_s)), **kw)
    server = _Server(config)
    server.sockets = [sock] if sock is not None else None
    return server


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound with SO_REUSEPORT. Bound but not listening it only holds the port
    (the supervisor's reservation: it takes no connections); uvicorn calls listen() once
    the worker's start-up is done, so connections reach only workers that can serve them."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


async def run_servers(servers: list[uvicorn.Server], *, on_signal: Callable[[], None] | None = None,
                      on_stop: Callable[[], None] | None = None, delay_s: float = 0.0,
                      parent_pid: int | None = None) -> None:
    """``on_signal`` runs at the first signal, ``on_stop`` as the listeners close (after ``delay_s``)."""
    loop = asyncio.get_running_loop()
    signalled = False

    def stop_all() -> None:
        if on_stop is not None:
            on_stop()
        for s in servers:
            s.should_exit = True

    def handle() -> None:
        nonlocal signalled
        if signalled:  # second signal: no more waiting
            for s in servers:
                s.force_exit = True
            stop_all()
            return
        signalled = True
        log.info("shutting down", extra={"delay_s": delay_s})
        if on_signal is not None:
            on_signal()
        loop.call_later(delay_s, stop_all)

    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, handle)
    if parent_pid is not None:
        watcher = asyncio.create_task(_watch_parent(parent_pid, handle))
    # Start in order, each once the previous is listening: replicas before the
    # gateway whose start-up health check looks for them.
    tasks = []
    for server in servers:
        task = asyncio.create_task(server.serve(sockets=getattr(server, "sockets", None)))
        tasks.append(task)
        while not server.started and not task.done():
            await asyncio.sleep(0.01)
        if task.done():
            stop_all()
            break
    await asyncio.gather(*tasks)
    if parent_pid is not None:
        watcher.cancel()


async def _watch_parent(parent_pid: int, shut_down: Callable[[], None]) -> None:
    """A worker whose supervisor died (SIGKILL, OOM) is reparented: it then shuts down as on
    SIGTERM, rather than serving on unsupervised."""
    while os.getppid() == parent_pid:
        await asyncio.sleep(1.0)
    log.warning("supervisor gone; shutting down", extra={"parent_pid": parent_pid})
    shut_down()
