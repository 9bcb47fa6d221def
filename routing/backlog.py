"""Prefill backlog: the prompt work this instance has sent each replica, not yet done.

Time to first token is set by the prefill queue, not by how many requests a
replica is decoding: a replica running twenty short decodes starts a new
prompt sooner than one that was just handed a 4,000-token prompt. Request
counts (``load_of``) cannot tell these apart, and the scraped metrics are up
to a second old, so routing on them herds a burst of arrivals onto whichever
replica looked emptiest at the last scrape.

``Backlog`` is a virtual queue per replica: each routed request adds its
estimated uncached prompt tokens, and the queue drains at the replica's
prefill rate (``prefill_tokens_per_s``, a setting: the fleet's rate need not be
known exactly, since only the *order* between replicas is used; too high a
rate makes every queue look empty and the rendezvous order decides, too low a
rate degrades to "least prompt tokens sent recently", still a fair spread).
It only covers this instance's own traffic, so the policy uses it where that is
all the traffic (``SharedLoad.alone``), or where the other instances hear where
each key went (``routing.gossip``), and only for keys not held anywhere.

``Committed`` remembers what the queue forgets: the prompt work of the new keys
placed on each replica, fading over tens of seconds. A new key brings more
requests than its first (a conversation's next turns, a group's next prompts),
so a replica that took many new keys lately has more work coming than its
drained queue shows.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from typing import Callable

__all__ = ["Backlog", "CHARS_PER_TOKEN", "Committed", "LastSent"]

# Rendered prompt characters per token: routing never tokenises.
CHARS_PER_TOKEN = 4.0
_MAX_REPLICAS = 4096
_MAX_KEYS = 4096


class _Fading:
    """Prompt tokens per replica that fade with time; a subclass says how."""

    __slots__ = ("_clock", "_tokens", "_at")

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._tokens: dict[str, float] = {}
        self._at: dict[str, float] = {}

    def _fade(self, tokens: float, dt: float) -> float:
        raise NotImplementedError

    def get(self, name: str) -> float:
        """Tokens left on ``name`` now (0 when faded or unknown)."""
        left = self._tokens.get(name)
        if left is None:
            return 0.0
        return self._fade(left, self._clock() - self._at[name])

    def add(self, name: str, tokens: float) -> None:
        if len(self._tokens) >= _MAX_REPLICAS and name not in self._tokens:
            # Replica names churned (DNS pods): keep only what still weighs.
            self._tokens = {n: t for n, t in self._tokens.items() if self.get(n) >= 1.0}
            self._at = {n: self._at[n] for n in self._tokens}
        self._tokens[name] = self.get(name) + max(0.0, tokens)
        self._at[name] = self._clock()


class Backlog(_Fading):
    """Prompt tokens still queued for prefill per replica, drained at ``tokens_per_s``."""

    __slots__ = ("_rate",)

    def __init__(self, tokens_per_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(clock)
        self._rate = tokens_per_s

    def _fade(self, tokens: float, dt: float) -> float:
        return max(0.0, tokens - dt * self._rate)


class Committed(_Fading):
    """Prompt tokens of the new keys placed on each replica, decaying with time constant ``tau_s``.

    The backlog forgets a placement once its prefill is done, a fraction of a
    second later; a burst of new keys then finds every queue drained and goes
    where the rendezvous order says. At the start of the shared-prefix workload
    that gave one replica 10 of 64 groups and another 7, and the first stayed at
    1.25x the mean load for the whole run (placing by queue plus this: 1.01).
    """

    __slots__ = ("_tau",)

    def __init__(self, tau_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(clock)
        self._tau = tau_s

    def _fade(self, tokens: float, dt: float) -> float:
        return tokens * math.exp(-dt / self._tau)


class LastSent:
    """Where this instance last sent each key (LRU, bounded).

    The index learns that a replica holds a prefix when its answer comes back;
    a long prompt's next requests arrive before that, and must go where the
    first went, not wherever the queue is shortest at that moment. The policy
    keeps two: keys it placed that the index does not know yet, and where each
    request context went last (its home while the load wobbles).
    """

    __slots__ = ("_homes", "_cap")

    def __init__(self, capacity: int = _MAX_KEYS) -> None:
        self._homes: OrderedDict[int, str] = OrderedDict()
        self._cap = capacity

    def __len__(self) -> int:
        return len(self._homes)

    def get(self, key: int) -> str | None:
        return self._homes.get(key)

    def put(self, key: int, name: str) -> None:
        self._homes[key] = name
        self._homes.move_to_end(key)
        if len(self._homes) > self._cap:
            self._homes.popitem(last=False)
