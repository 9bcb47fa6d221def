"""The test servers themselves: a killed server leaves nothing behind for the collector.

A task left pending on a closed loop is destroyed by the garbage collector later, inside whatever
test runs then, and logs a traceback there; CI once failed that way in an unrelated test
(``tests/support/servers.py``'s ``_settle`` says how).
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from tests.support.servers import ServerThread


def _app() -> Starlette:
    return Starlette(routes=[Route("/", lambda request: PlainTextResponse("up"))])


@pytest.mark.parametrize("end", ["kill", "stop"])
def test_an_ended_server_leaves_no_pending_task(end: str) -> None:
    server = ServerThread(_app()).start()
    assert httpx.get(server.url).text == "up"
    getattr(server, end)()
    assert server.loop is not None and server.loop.is_closed()
    assert [t for t in asyncio.all_tasks(server.loop) if not t.done()] == []
