"""Run kvgate's listeners (public and admin) in one process and event loop.

Signals are handled here rather than by each uvicorn server, so shutdown is one
sequence for the whole process: on SIGTERM ``/readyz`` turns 503 at once; new
requests are still served for ``shutdown_delay_s`` (load balancers need that
long to take the pod out); then the listeners close, streams in flight get up
to ``shutdown_grace_s`` to finish, and the process exits. A second signal
exits at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from typing import Any, Callable, Iterator, Literal

import uvicorn

from .protocol import protocol_with_header_deadline

log = logging.getLogger("kvgate.serve")


class _Server(uvicorn.Server):
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
                header_timeout_s: float = 10.0,
                grace_s: float = 30.0, **kw: Any) -> uvicorn.Server:
    config = uvicorn.Config(app, host=host, port=port, lifespan=lifespan, log_config=None, access_log=False,
                            timeout_keep_alive=30, http=protocol_with_header_deadline(header_timeout_s),
                            timeout_graceful_shutdown=max(1, int(grace_s)), **kw)
    return _Server(config)


async def run_servers(servers: list[uvicorn.Server], *, on_signal: Callable[[], None] | None = None,
                      delay_s: float = 0.0) -> None:
    loop = asyncio.get_running_loop()
    signalled = False

    def stop_all() -> None:
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
    # Start in order, each once the previous is listening: replicas before the
    # gateway whose start-up health check looks for them.
    tasks = []
    for server in servers:
        task = asyncio.create_task(server.serve())
        tasks.append(task)
        while not server.started and not task.done():
            await asyncio.sleep(0.01)
        if task.done():
            stop_all()
            break
    await asyncio.gather(*tasks)
