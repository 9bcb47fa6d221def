"""Membership helpers the replica pool uses: DNS discovery and what a change moves.

A Kubernetes headless service resolves to one A/AAAA record per ready pod;
``resolve`` turns that into replica URLs (sorted, deduplicated, IPv6
bracketed). Names derive from the address, not the position in the answer, so
a pod keeps its rendezvous identity however the records are ordered.

``key_movement`` measures the property rendezvous hashing promises: removing
one of N replicas moves only the keys whose first choice it was (about 1/N),
each to its own next choice, and adding it back restores exactly those.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from typing import Iterable, Sequence

from .rendezvous import first_choice

__all__ = ["resolve", "dns_target", "replica_name", "key_movement", "MembershipDiff", "diff"]


def _url(address: str, port: int, scheme: str) -> str:
    try:
        if ipaddress.ip_address(address).version == 6:
            return f"{scheme}://[{address}]:{port}"
    except ValueError:
        pass
    return f"{scheme}://{address}:{port}"


def dns_target(dns_name: str) -> tuple[str, int]:
    """``routing.dns_name`` as (host, port); vLLM's port 8000 when it names none. ValueError if bad."""
    host, _, port = dns_name.rpartition(":")
    return host or dns_name, int(port or 8000)


async def resolve(name: str, port: int, scheme: str = "http") -> list[str]:
    """Replica URLs behind a DNS name; [] when it does not resolve (the pool keeps what it has)."""
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(name, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError, OSError):
        return []
    addresses = {str(info[4][0]).split("%", 1)[0] for info in infos}
    return sorted(_url(a, port, scheme) for a in addresses)


def replica_name(url: str) -> str:
    """A stable replica name for a discovered URL (its host:port)."""
    return url.split("://", 1)[-1].rstrip("/")


class MembershipDiff(tuple):
    """(added, removed) URL lists."""

    @property
    def added(self) -> list[str]:
        return self[0]

    @property
    def removed(self) -> list[str]:
        return self[1]


def diff(current: Iterable[str], discovered: Iterable[str]) -> MembershipDiff:
    """What to add and remove to go from ``current`` to ``discovered``."""
    cur, new = set(current), set(discovered)
    return MembershipDiff((sorted(new - cur), sorted(cur - new)))


def key_movement(keys: Sequence[int], before: Sequence[str], after: Sequence[str]) -> float:
    """Fraction of ``keys`` whose first choice differs between two memberships."""
    if not keys:
        return 0.0
    moved = sum(1 for k in keys if first_choice(k, before) != first_choice(k, after))
    return moved / len(keys)
