"""Prefill backlog: the prompt work this instance has sent each replica, not yet done.

Time to first token is set by the prefill queue, not by how many requests a
replica is decoding: a replica running twenty short decodes starts a new
prompt sooner than one that was just handed a 4,000-token prompt. Request
counts cannot tell these apart, and the scraped metrics are up
to a second old, so routing on them herds a burst of arrivals onto whichever
replica looked emptiest at the last scrape.

``Backlog`` is a virtual queue per replica: each routed request adds its
estimated uncached prompt tokens, and the queue drains at the replica's
prefill rate (``prefill_tokens_per_s``, a setting: the fleet's rate need not be
known exactly, since only the *order* between replicas is used; too high a
rate makes every queue look empty and the rendezvous order decides, too low a
rate degrades to "least prompt tokens sent recently", still a fair spread).
It only covers this instance's own traffic; the replicas' reports of their
waiting requests stand in for everyone else's (``routing.prefix_affinity``).
"""

from __future__ import annotations

import time
from typing import Callable, Iterable

__all__ = ["Backlog", "CHARS_PER_TOKEN"]

# Rendered prompt characters per token: routing never tokenises.
CHARS_PER_TOKEN = 4.0
_MAX_REPLICAS = 4096


class Backlog:
    """Prompt tokens still queued for prefill per replica, drained at ``tokens_per_s``."""

    __slots__ = ("_clock", "_rate", "_tokens", "_at", "_sent")

    def __init__(self, tokens_per_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._rate = tokens_per_s
        self._tokens: dict[str, float] = {}
        self._at: dict[str, float] = {}
        # Prompt tokens ever sent each replica: a request's mark is this total just after it.
        self._sent: dict[str, float] = {}

    def get(self, name: str) -> float:
        """Tokens left on ``name`` now (0 when drained or unknown)."""
        left = self._tokens.get(name)
        if left is None:
            return 0.0
        return max(0.0, left - (self._clock() - self._at[name]) * self._rate)

    def queued(self, names: Iterable[str]) -> list[float]:
        """``get`` of each of ``names``, read at one instant (one clock read a decision)."""
        now, rate = self._clock(), self._rate
        tokens, at = self._tokens, self._at
        out = []
        for name in names:
            left = tokens.get(name)
            out.append(0.0 if left is None else max(0.0, left - (now - at[name]) * rate))
        return out

    def add(self, name: str, tokens: float) -> float:
        """Queue ``tokens`` on ``name``; returns the request's mark (for ``done``)."""
        if len(self._tokens) >= _MAX_REPLICAS and name not in self._tokens:
            # Replica names churned (DNS pods): keep only what still weighs.
            self._tokens = {n: t for n, t in self._tokens.items() if self.get(n) >= 1.0}
            self._at = {n: self._at[n] for n in self._tokens}
            self._sent = {n: self._sent[n] for n in self._tokens}
        tokens = max(0.0, tokens)
        self._tokens[name] = self.get(name) + tokens
        self._at[name] = self._clock()
        mark = self._sent[name] = self._sent.get(name, 0.0) + tokens
        return mark

    def done(self, name: str, mark: float) -> None:
        """The request with ``mark`` was answered on ``name``: its prefill is done, and
        (prefill is first come, first served) so is everything sent before it. What
        can still be queued is at most what was sent after it."""
        if name in self._tokens:
            after = self._sent.get(name, 0.0) - mark
            if after < self.get(name):
                self._tokens[name] = max(0.0, after)
                self._at[name] = self._clock()
