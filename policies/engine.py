"""The two calls the proxy makes: who is this (before the body), and what to do (after it).

    tenant = engine.authenticate(headers, query_string)     # raises AuthError -> 401
    decision = await engine.admit(tenant, endpoint, body)   # refusals come back as decision.rejection
    ... forward decision.body, add decision.response_headers ...
    await engine.record_usage(tenant, tokens)               # after the response, when usage is known

``admit`` runs the pure ``decision.evaluate``, then the rate limiter (a refused
model never spends rate budget), then the cross-request hygiene tracker (only
admitted requests shape the hygiene report). The engine owns no I/O resources;
the registry, limiter, tracker and the memo of hygiene's scans (``scans``: a
system prompt is scanned once, not on every request that sends it) are built in
the gateway's lifespan.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

from .decision import Endpoint, PolicyDecision, Rejection, evaluate, hygiene_body, warning_headers
from .errors import ApiKeyInQuery, RateLimited
from .hygiene import Findings
from .hygiene_state import HygieneTracker
from .keys import extract_api_key, query_has_api_key
from .memo import DigestMemo
from .ratelimit import RateLimiter
from .tenants import Tenant, TenantRegistry


class PolicyEngine:
    def __init__(self, registry: TenantRegistry, limiter: RateLimiter | None = None,
                 tracker: HygieneTracker | None = None, *, boundary_marker: str | None = None,
                 scans: DigestMemo[Findings] | None = None) -> None:
        self.registry = registry
        self.limiter = limiter if limiter is not None else RateLimiter(None)
        self.tracker = tracker
        self.scans = scans
        self._marker = boundary_marker

    def authenticate(self, headers: Mapping[str, str] | Iterable[tuple[str, str]],
                     query_string: str | bytes | None = None) -> Tenant:
        """The calling tenant. Raises MissingApiKey / InvalidApiKey / ApiKeyInQuery (401) or
        TenantsUnavailable (503). Never logs; the caller must not log a refused query string."""
        if query_has_api_key(query_string):
            raise ApiKeyInQuery()
        return self.registry.authenticate(extract_api_key(headers))

    async def admit(self, tenant: Tenant, endpoint: Endpoint, body: Mapping[str, Any], *,
                    boundary: int | None = None, cost_tokens: int = 0) -> PolicyDecision:
        """Tenant policy for one validated body: rewrites, warnings, rate limit, or a rejection."""
        decision = evaluate(tenant, body, endpoint=endpoint, boundary=boundary, marker=self._marker,
                            scans=self.scans)
        if not decision.allowed:
            return decision
        rate = await self.limiter.check(tenant, cost_tokens=cost_tokens)
        if not rate.allowed:
            err = RateLimited(rate.reason or "requests", rate.retry_after_s)
            return replace(decision, rejection=Rejection.from_error(err, tuple(rate.headers())),
                           response_headers=tuple(rate.headers()))
        warnings = decision.warnings
        if self.tracker is not None and endpoint in ("chat", "messages") and tenant.prompt_hygiene:
            warnings = tuple(self.tracker.observe(tenant.name, hygiene_body(endpoint, decision.body),
                                                  decision.warnings, boundary=boundary, marker=self._marker))
        return replace(decision, warnings=warnings,
                       response_headers=warning_headers(warnings) + tuple(rate.headers()))

    async def record_usage(self, tenant: Tenant, tokens: int) -> None:
        """Tokens used by an admitted request (minus any ``cost_tokens`` reserved in ``admit``)."""
        await self.limiter.record_tokens(tenant, tokens)

    def readiness(self) -> dict[str, str]:
        """Human-readable states for /readyz; none of them makes the gateway unready on its own."""
        reg = self.registry
        tenants = "ok" if not reg.degraded else ("store unreachable, serving last loaded tenants"
                                                 if reg.loaded else "not loaded")
        return {"tenants": tenants, "rate_limits": "local fallback" if self.limiter.degraded else "ok"}
