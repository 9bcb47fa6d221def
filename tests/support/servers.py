"""Run real ASGI apps under uvicorn on ephemeral loopback ports.

Each server gets its own thread and event loop, so synchronous clients (the
OpenAI SDK's sync client) and async tests can both talk to it. ``stop()``
shuts the server down gracefully; ``kill()`` drops every connection at once,
the way a crashed replica would.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Any, Callable

import uvicorn

from bench.ports import free_port  # noqa: F401 - re-exported: the tests import it from here


def _listener() -> socket.socket:
    # proto=IPPROTO_TCP, plus TCP_NODELAY inherited by accepted sockets: without it
    # a response written as headers-then-body waits ~40 ms for a delayed ACK.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def free_socket(host: str = "127.0.0.1") -> socket.socket:
    sock = _listener()
    sock.bind((host, 0))
    return sock




def _wait_started(server: uvicorn.Server, exited: Callable[[], bool], timeout: float) -> None:
    """Until ``server`` has started; raises if ``exited()`` says it ended first, or at ``timeout``."""
    deadline = time.monotonic() + timeout
    while not server.started:
        if exited():
            raise RuntimeError("server exited during start-up")
        if time.monotonic() > deadline:
            raise TimeoutError("server did not start")
        time.sleep(0.01)


class ServerThread:
    """An ASGI app served by uvicorn in a background thread."""

    def __init__(self, app: Any, *, lifespan: str = "on", port: int | None = None, **config: Any) -> None:
        self._sock = free_socket() if port is None else None
        if port is not None:
            self._sock = _listener()
            self._sock.bind(("127.0.0.1", port))
        self.port: int = self._sock.getsockname()[1]
        self.config = uvicorn.Config(
            app, lifespan=lifespan, log_level="warning", access_log=False, loop="asyncio", **config
        )
        self.server = uvicorn.Server(self.config)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"uvicorn-{self.port}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self.server.serve(sockets=[self._sock]))
        finally:
            self._settle(self.loop)
            self.loop.close()

    def _settle(self, loop: asyncio.AbstractEventLoop) -> None:
        """Finish what a kill left running before the loop closes.

        A kill (``force_exit``) makes uvicorn skip the lifespan's shutdown, so its task stays pending;
        a loop closed under it leaves the task to the collector, which destroys it later in whatever
        test runs then and logs a traceback there ('Task was destroyed but it is pending!'). Once,
        that finalizer ran inside the docs generator's ``ast.parse`` and failed CI (see
        docs/gen_reference.py). So: the lifespan's shutdown, as a stop would run it, then cancel the rest."""
        if self.server.force_exit and self.server.started:
            try:
                loop.run_until_complete(asyncio.wait_for(self.server.lifespan.shutdown(), 5))
            except Exception:  # the app's own shutdown failing is not this helper's to report
                pass
        pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self._thread.start()
        _wait_started(self.server, lambda: not self._thread.is_alive(), timeout)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)

    def kill(self) -> None:
        """Abruptly close every connection and the listener, like a crashed process."""
        self.server.force_exit = True
        self.server.should_exit = True
        loop = self.loop
        if loop is not None and loop.is_running():
            def _drop() -> None:
                # The listener first, in the same step as the connections: a crashed process's kernel
                # closes both at once, so a client that reconnects the moment its connection drops is
                # refused (uvicorn would close the listener only at its next tick, up to 0.1 s later).
                for listener in getattr(self.server, "servers", []):
                    listener.close()
                for conn in list(getattr(self.server.server_state, "connections", [])):
                    transport = getattr(conn, "transport", None)
                    if transport is not None:
                        transport.abort()
            loop.call_soon_threadsafe(_drop)
        self._thread.join(5)

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def beside(self, app: Any, **config: Any) -> "ServerBeside":
        """Another listener, for ``app``, on this server's event loop (started, stopped on its own)."""
        return ServerBeside(self, app, **config).start()


class ServerBeside:
    """An ASGI app served by uvicorn on a running ``ServerThread``'s event loop.

    kvgate serves its admin listener on the gateway's own loop (``gateway.server.serve``), and the
    two share objects bound to that loop: the replica pool's kept-alive connections. Served from a
    thread of its own, an admin call that opened one (a health check of a replica added through the
    API) left it to the gateway's loop, whose request then waited on a future that another thread's
    loop resolved, and at shutdown the connection's close was scheduled on a loop already closed."""

    def __init__(self, host: ServerThread, app: Any, **config: Any) -> None:
        self.host = host
        self._sock = free_socket()
        self.port: int = self._sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(
            app, lifespan="off", log_level="warning", access_log=False, loop="asyncio", **config))
        self._served: Any = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> "ServerBeside":
        if self.host.loop is None or not self.host.loop.is_running():
            raise RuntimeError("the host server is not running")
        self._served = asyncio.run_coroutine_threadsafe(self.server.serve(sockets=[self._sock]), self.host.loop)
        _wait_started(self.server, self._served.done, timeout)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        if self._served is not None and self.host.loop is not None and self.host.loop.is_running():
            try:
                self._served.result(timeout)
            except Exception:  # the host's loop stopped under it: nothing left to wait for
                pass
