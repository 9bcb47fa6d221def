"""Tenant policy for kvgate: small, mostly pure building blocks the proxy composes.

    tenants / keys / tenant_store   who is calling (constant-time key check, runtime changes)
    salt                            per-namespace cache_salt; body fields clients may not set
    normalize                       deterministic tool JSON (opt-in per tenant)
    hygiene / hygiene_state         volatile content above the cache boundary, per request and across
    memo                            bounded results by input digest (a system prompt scanned once)
    window / breaker / ratelimit    requests and tokens per minute, Redis-shared, local fallback
    decision / engine               the composed policy: ``authenticate`` then ``admit``
    settings                        the ``tenants`` section of kvgate's settings (``TenantSettings``)

Constraints every module keeps: no module-level mutable state, no I/O outside
``tenant_store`` and ``ratelimit`` (each bounded by a deadline), and nothing
here logs or returns key material or prompt text (hygiene excerpts are at most
40 characters, for the admin API).
"""

from .decision import PREFIX_WARNING_HEADER, PolicyDecision, Rejection, evaluate
from .engine import PolicyEngine
from .errors import AdminError, AuthError, PolicyError
from .hygiene import PrefixWarning, analyze, scan_memo
from .hygiene_state import HygieneReport, HygieneTracker
from .keys import CLIENT_AUTH_HEADERS, extract_api_key, query_has_api_key, redact_query
from .ratelimit import RateDecision, RateLimiter
from .salt import apply_salt, cache_salt, strip_client_fields
from .tenant_store import MemoryTenantStore, RedisTenantStore, TenantStore
from .tenants import IssuedKey, Tenant, TenantInfo, TenantRegistry, allows_model

__all__ = [
    "CLIENT_AUTH_HEADERS", "PREFIX_WARNING_HEADER", "AdminError", "AuthError", "HygieneReport",
    "HygieneTracker",
    "IssuedKey", "MemoryTenantStore", "PolicyDecision", "PolicyEngine", "PolicyError", "PrefixWarning",
    "RateDecision", "RateLimiter", "RedisTenantStore", "Rejection", "Tenant", "TenantInfo", "TenantRegistry",
    "TenantStore", "allows_model", "analyze", "apply_salt", "cache_salt", "evaluate", "extract_api_key",
    "query_has_api_key", "redact_query", "scan_memo", "strip_client_fields",
]
