"""One request's tenant policy, composed: a pure function from (tenant, body) to a decision.

``evaluate`` applies, in order:
  1. the model allow-list (a refusal ends evaluation: nothing else matters);
  2. ``strip_client_fields``: fields no client may set never reach upstream;
  3. ``normalize_tools`` when the tenant opted in (before hygiene, so hygiene
     judges what upstream will actually render);
  4. the tenant's ``cache_salt`` (chat, text completions, responses and the pooling routes:
     the routes whose vLLM request model has the field);
  5. prompt hygiene of the final body (chat, and responses seen as chat; completions
     carry a raw prompt with no message structure to find the boundary in).
It performs no I/O and keeps no state; ``engine.PolicyEngine`` adds the rate
limiter and the cross-request hygiene tracker around it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from .errors import ModelNotAllowed, PolicyError
from .hygiene import PrefixWarning, analyze, warning_kinds
from .normalize import normalize_tools
from .responses_view import as_chat
from .salt import apply_salt, strip_client_fields
from .tenants import Tenant, allows_model

Endpoint = Literal["chat", "completions", "embeddings", "responses", "other"]
PREFIX_WARNING_HEADER = "x-kvgate-prefix-warning"
# vLLM's pooling requests (rerank, score, pooling, classify) take cache_salt too
# (PoolingBasicRequestMixin): a pooling model with prefix caching has the same side channel.
_SALTED: frozenset[str] = frozenset({"chat", "completions", "responses", "rerank", "score", "pooling", "classify"})


@dataclass(frozen=True, slots=True)
class Rejection:
    """What the client gets instead of an answer; every field is safe to show."""

    status: int
    type: str
    code: str
    message: str
    param: str | None = None
    retry_after_s: int | None = None
    headers: tuple[tuple[str, str], ...] = ()

    @classmethod
    def from_error(cls, err: PolicyError, headers: tuple[tuple[str, str], ...] = ()) -> Rejection:
        return cls(err.status, err.type, err.code, err.message, err.param,
                   getattr(err, "retry_after_s", None), headers)

    def body(self) -> dict[str, Any]:
        """OpenAI's error shape."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class PolicyDecision:
    tenant: Tenant | None  # None only when refused before a tenant was known
    body: Mapping[str, Any]  # what to forward upstream (the client's body when rejected)
    # Headers for the client's response, e.g. x-kvgate-prefix-warning, x-ratelimit-*.
    response_headers: tuple[tuple[str, str], ...] = ()
    warnings: tuple[PrefixWarning, ...] = ()
    stripped_fields: tuple[str, ...] = ()  # names only, for metrics
    rejection: Rejection | None = None

    @property
    def allowed(self) -> bool:
        return self.rejection is None


def warning_headers(warnings: tuple[PrefixWarning, ...] | list[PrefixWarning]) -> tuple[tuple[str, str], ...]:
    kinds = warning_kinds(warnings)
    return ((PREFIX_WARNING_HEADER, ",".join(kinds)),) if kinds else ()


def evaluate(tenant: Tenant, body: Mapping[str, Any], *, endpoint: Endpoint = "chat",
             boundary: int | None = None, marker: str | None = None) -> PolicyDecision:
    """The tenant's policy applied to one validated request body. Pure; the input is not modified.

    ``boundary``: index of the first message below the stable prefix (default:
    the final user message). ``marker``: a literal the client may place where
    its stable prefix ends (``RoutingSettings.boundary_marker``).
    """
    model = body.get("model")
    if isinstance(model, str) and not allows_model(tenant, model):
        return PolicyDecision(tenant, body, rejection=Rejection.from_error(ModelNotAllowed(model)))
    out, stripped = strip_client_fields(body)
    if tenant.normalize_tools and endpoint == "chat":
        out = normalize_tools(out, sort_tools=tenant.sort_tools)
    if endpoint in _SALTED:
        out = apply_salt(out, tenant.cache_salt)
    warnings: tuple[PrefixWarning, ...] = ()
    if tenant.prompt_hygiene and endpoint in ("chat", "responses"):
        view = out if endpoint == "chat" else as_chat(out)
        warnings = tuple(analyze(view, boundary=boundary, marker=marker))
    return PolicyDecision(tenant, out, warning_headers(warnings), warnings, stripped)
