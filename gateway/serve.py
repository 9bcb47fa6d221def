"""Run kvgate's listeners (public and admin) in one process and event loop.

Signals are handled here rather than by each uvicorn server, so SIGTERM turns
readiness off at once and then stops every listener together.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from typing import Any, Iterator

import uvicorn


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


def make_server(app: Any, host: str, port: int, *, lifespan: str = "on", **kw: Any) -> uvicorn.Server:
    config = uvicorn.Config(app, host=host, port=port, lifespan=lifespan, log_config=None, access_log=False,
                            timeout_keep_alive=30, h11_max_incomplete_event_size=64 * 1024, **kw)
    return _Server(config)


async def run_servers(servers: list[uvicorn.Server], *, on_signal: Any = None) -> None:
    loop = asyncio.get_running_loop()

    def _stop() -> None:
        if on_signal is not None:
            on_signal()
        for s in servers:
            s.should_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, _stop)
    # Start in order, each once the previous is listening: replicas before the
    # gateway whose start-up health check looks for them.
    tasks = []
    for server in servers:
        task = asyncio.create_task(server.serve())
        tasks.append(task)
        while not server.started and not task.done():
            await asyncio.sleep(0.01)
        if task.done():
            _stop()
            break
    await asyncio.gather(*tasks)
