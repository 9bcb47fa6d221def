"""A clock tests move by hand: ``clock.t += 1.0``."""

from __future__ import annotations


class Clock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t
