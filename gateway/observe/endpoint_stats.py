"""Requests per endpoint for the status page (Prometheus has the same by its ``endpoint`` label).

In memory and per worker, like the tenant rows: a count, the errors split by who
caused them, and running means of latency and time to first token. Cheap enough
to update on every request (a dict lookup and a few additions).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["EndpointStats"]


@dataclass(slots=True)
class _Row:
    requests: int = 0
    client_errors: int = 0  # 4xx, and 499 for a client that went away
    server_errors: int = 0  # 5xx: kvgate's or a replica's fault
    latency_sum_s: float = 0.0
    ttft_sum_s: float = 0.0
    ttft_count: int = 0


class EndpointStats:
    def __init__(self) -> None:
        self._rows: dict[str, _Row] = {}

    def record(self, endpoint: str, status: int, elapsed_s: float, ttft_s: float | None) -> None:
        row = self._rows.get(endpoint)
        if row is None:
            row = self._rows[endpoint] = _Row()
        row.requests += 1
        if status >= 500:
            row.server_errors += 1
        elif status >= 400:
            row.client_errors += 1
        row.latency_sum_s += elapsed_s
        if ttft_s is not None:
            row.ttft_sum_s += ttft_s
            row.ttft_count += 1

    def rows(self) -> list[dict[str, Any]]:
        """Busiest first."""
        out = []
        for name, r in sorted(self._rows.items(), key=lambda kv: (-kv[1].requests, kv[0])):
            out.append({"endpoint": name, "requests": r.requests, "client_errors": r.client_errors,
                        "server_errors": r.server_errors,
                        "mean_latency_s": r.latency_sum_s / r.requests if r.requests else None,
                        "mean_ttft_s": r.ttft_sum_s / r.ttft_count if r.ttft_count else None})
        return out
