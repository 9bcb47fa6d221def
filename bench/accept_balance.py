"""How two uvloop processes split new connections: one shared listening socket, or one
SO_REUSEPORT socket each (what ``kvgate serve --workers`` does).

Two idle processes accept; the client opens ``--connections`` connections one after
another; each process reports how many it accepted. Repeated ``--trials`` times.

    python -m bench.accept_balance
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import socket
import time
from typing import Any

import uvloop


def _listener(mode: str, port: int, shared: socket.socket | None) -> socket.socket:
    if mode == "shared":
        assert shared is not None
        return shared
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(2048)
    return sock


def _serve(mode: str, port: int, shared: socket.socket | None, seconds: float, out: Any) -> None:
    sock = _listener(mode, port, shared)
    accepted = 0

    def on_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal accepted
        accepted += 1

    async def main() -> None:
        await asyncio.start_server(on_connection, sock=sock)
        await asyncio.sleep(seconds)

    uvloop.run(main())
    out.put(accepted)


def trial(mode: str, connections: int) -> list[int]:
    ctx = mp.get_context("fork")  # the shared socket is inherited, as by pre-forked workers
    out = ctx.Queue()
    holder = socket.socket()
    if mode == "reuseport":
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    holder.bind(("127.0.0.1", 0))
    if mode == "shared":
        holder.listen(2048)
    port = holder.getsockname()[1]
    procs = [ctx.Process(target=_serve, args=(mode, port, holder if mode == "shared" else None, 4.0, out))
             for _ in range(2)]
    for p in procs:
        p.start()
    time.sleep(1.5)  # both listening
    conns = [socket.create_connection(("127.0.0.1", port)) for _ in range(connections)]
    counts = sorted(out.get() for _ in procs)
    for p in procs:
        p.join()
    for c in conns:
        c.close()
    holder.close()
    return counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--connections", type=int, default=256)
    p.add_argument("--trials", type=int, default=3)
    args = p.parse_args(argv)
    for mode in ("shared", "reuseport"):
        splits = [trial(mode, args.connections) for _ in range(args.trials)]
        print(f"{mode:<10} " + "  ".join(f"{a}/{b}" for a, b in splits), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
