"""Prefill backlog: the prompt work this instance has sent each replica, not yet done.

Time to first token is set by the prefill queue, not by how many requests a
replica is decoding: a replica running twenty short decodes starts a new
prompt sooner than one that was just handed a 4,000-token prompt. Request
counts cannot tell these apart, and the scraped metrics are up
to a second old, so routing on them herds a burst of arrivals onto whichever
replica looked emptiest at the last scrape.

``Backlog`` is a virtual queue per replica: each routed request adds its
estimated uncached prompt tokens, and the queue drains at that replica's own
prefill rate, learned from what it reports (``routing.rates``; the caller
passes it). A replica whose rate is not known yet drains only by its replies:
no evidence, no assumed speed. A reply proves its request's prefill done, and
(prefill is first come, first served) everything sent before it.
It only covers this instance's own traffic; the replicas' reports of their
waiting requests stand in for everyone else's (``routing.prefix_affinity``).
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

__all__ = ["Backlog", "CHARS_PER_TOKEN"]

# Rendered prompt characters per token, where routing has no token ids.
CHARS_PER_TOKEN = 4.0
_MAX_REPLICAS = 4096


class Backlog:
    """Prompt tokens still queued for prefill per replica, each drained at its own rate."""

    __slots__ = ("_clock", "_tokens", "_at", "_sent")

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._tokens: dict[str, float] = {}
        self._at: dict[str, float] = {}
        # Prompt tokens ever sent each replica: a request's mark is this total just after it.
        self._sent: dict[str, float] = {}

    def get(self, name: str, rate: float | None) -> float:
        """Tokens left on ``name`` now (0 when drained or unknown), draining at ``rate`` tokens/s."""
        left = self._tokens.get(name)
        if left is None:
            return 0.0
        if rate is None:
            return left
        return max(0.0, left - (self._clock() - self._at[name]) * rate)

    def queued(self, names: Sequence[str], rates: Sequence[float | None]) -> list[float]:
        """``get`` of each of ``names`` at its rate, read at one instant (one clock read a decision)."""
        now = self._clock()
        tokens, at = self._tokens, self._at
        out = []
        for i in range(len(names)):
            left = tokens.get(names[i])
            rate = rates[i]
            if left is None:
                out.append(0.0)
            elif rate is None:
                out.append(left)
            else:
                out.append(max(0.0, left - (now - at[names[i]]) * rate))
        return out

    def add(self, name: str, tokens: float, rate: float | None) -> float:
        """Queue ``tokens`` on ``name``; returns the request's mark (for ``done``)."""
        if len(self._tokens) >= _MAX_REPLICAS and name not in self._tokens:
            # Replica names churned (DNS pods): keep only what was sent most recently.
            keep = sorted(self._tokens, key=self._at.__getitem__)[-_MAX_REPLICAS // 2:]
            self._tokens = {n: self._tokens[n] for n in keep}
            self._at = {n: self._at[n] for n in keep}
            self._sent = {n: self._sent[n] for n in keep}
        tokens = max(0.0, tokens)
        self._tokens[name] = self.get(name, rate) + tokens
        self._at[name] = self._clock()
        mark = self._sent[name] = self._sent.get(name, 0.0) + tokens
        return mark

    def done(self, name: str, mark: float, rate: float | None) -> None:
        """The request with ``mark`` was answered on ``name``: its prefill is done, and
        (prefill is first come, first served) so is everything sent before it. What
        can still be queued is at most what was sent after it."""
        if name in self._tokens:
            after = self._sent.get(name, 0.0) - mark
            if after < self.get(name, rate):
                self._tokens[name] = max(0.0, after)
                self._at[name] = self._clock()
