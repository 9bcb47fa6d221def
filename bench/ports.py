"""A port for a process that binds it later (a replica, a kvgate, a router started as a process).

Binding port 0 and closing the socket gives a port in the kernel's ephemeral range, where any
outgoing connection on the machine may be given it as its source port before the process binds
it: with the test suite's workers opening connections all the time, that happened ("address
already in use"). So the port is drawn below the ephemeral range, where no connection is given
a source port, and checked free by binding it; only another explicit pick of the same port, one
in thousands, can still take it first.
"""

from __future__ import annotations

import random
import socket

__all__ = ["free_port"]

_FLOOR = 10000  # below it, the well-known and registered services a machine may run
_rng = random.SystemRandom()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default where the range cannot be read


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on now."""
    low = _ephemeral_low()
    if low - _FLOOR >= 1000:
        for _ in range(64):
            port = _rng.randrange(_FLOOR, low)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
