"""Per-tenant counters for the status page and the admin API (bounded: one row per tenant)."""

from __future__ import annotations

from array import array
from dataclasses import asdict, dataclass


@dataclass
class TenantCounters:
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    semantic_hits: int = 0
    semantic_lookups: int = 0
    warnings: int = 0

    @property
    def prefix_hit_rate(self) -> float | None:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None


class TenantStats:
    def __init__(self, max_tenants: int = 10_000) -> None:
        self._rows: dict[str, TenantCounters] = {}
        self._max = max_tenants

    def row(self, tenant: str) -> TenantCounters:
        row = self._rows.get(tenant)
        if row is None:
            if len(self._rows) >= self._max:
                self._rows.pop(next(iter(self._rows)))
            row = self._rows[tenant] = TenantCounters()
        return row

    def rows(self) -> list[dict[str, object]]:
        return [{"name": name, **asdict(c), "prefix_hit_rate": c.prefix_hit_rate}
                for name, c in sorted(self._rows.items())]

    def totals(self) -> dict[str, float | int | None]:
        req = sum(c.requests for c in self._rows.values())
        prompt = sum(c.prompt_tokens for c in self._rows.values())
        cached = sum(c.cached_tokens for c in self._rows.values())
        lookups = sum(c.semantic_lookups for c in self._rows.values())
        hits = sum(c.semantic_hits for c in self._rows.values())
        return {"requests": req, "prefix_hit_rate": cached / prompt if prompt else None,
                "semantic_hit_ratio": hits / lookups if lookups else None}


class DecisionTimes:
    """What routing cost the last ``size`` requests (``prefer`` + ``observe``), for ``GET /admin/routing``.

    Timed inside the gateway, so the figure is the decision's own, free of the
    network and scheduling noise that a latency comparison carries. A ring of
    floats: two clock reads and a store a request.
    """

    __slots__ = ("_ring", "_n")

    def __init__(self, size: int = 1024) -> None:
        self._ring = array("d", bytes(8 * size))
        self._n = 0

    def add(self, seconds: float) -> None:
        self._ring[self._n % len(self._ring)] = seconds
        self._n += 1

    def summary(self) -> dict[str, float | int | None]:
        xs = sorted(self._ring[: min(self._n, len(self._ring))])
        if not xs:
            return {"requests": 0, "p50_us": None, "p99_us": None}
        return {"requests": len(xs), "p50_us": round(xs[len(xs) // 2] * 1e6, 1),
                "p99_us": round(xs[int(0.99 * (len(xs) - 1))] * 1e6, 1)}
