"""One request's tenant policy, composed: a pure function from (tenant, body) to a decision.

``evaluate`` applies, in order:
  1. the model allow-list (a refusal ends evaluation: nothing else matters);
  2. ``kv_transfer_params`` refused (400): only the gateway moves KV blocks between
     replicas (gateway.proxy.disagg); ``strip_client_fields``: other fields no client may
     set never reach upstream;
  3. ``normalize_tools`` when the tenant opted in, on chat and messages (before
     hygiene, so hygiene judges what upstream will actually render);
  4. the tenant's ``cache_salt`` (chat, text completions, responses, Anthropic
     messages and the pooling routes: the routes whose vLLM request model has the field);
  5. prompt hygiene of the final body (chat, and responses and messages seen as
     chat; completions carry a raw prompt with no message structure to find the
     boundary in).
It performs no I/O and keeps no state (a memo of hygiene's scans, when given,
changes its cost, not its result); ``engine.PolicyEngine`` adds the rate
limiter, that memo and the cross-request hygiene tracker around it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from routing.messages_view import chat_view

from .errors import ModelNotAllowed, PolicyError, TransferParamsRefused
from .hygiene import Findings, PrefixWarning, analyze, warning_kinds
from .memo import DigestMemo
from .normalize import normalize_tools
from .responses_view import as_chat
from .salt import apply_salt, strip_client_fields
from .tenants import Tenant, allows_model

Endpoint = Literal["chat", "completions", "embeddings", "responses", "messages", "count_tokens", "other"]
PREFIX_WARNING_HEADER = "x-kvgate-prefix-warning"
# vLLM's pooling requests (rerank, score, pooling, classify) take cache_salt too
# (PoolingBasicRequestMixin): a pooling model with prefix caching has the same side channel.
# So does vLLM 0.33's AnthropicMessagesRequest (its count_tokens request does not).
_SALTED: frozenset[str] = frozenset({"chat", "completions", "responses", "messages", "rerank", "score", "pooling",
                                     "classify"})
_HYGIENE: frozenset[str] = frozenset({"chat", "responses", "messages"})  # bodies with a message structure
# Anthropic tools render through vLLM's chat template as chat's do.
_TOOLS_NORMALISED: frozenset[str] = frozenset({"chat", "messages"})


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


def hygiene_body(endpoint: str, body: Mapping[str, Any]) -> Mapping[str, Any]:
    """What hygiene reads: a chat body as it is; a Responses or Messages body as the chat it becomes."""
    if endpoint == "responses":
        return as_chat(body)
    return chat_view(dict(body)) if endpoint == "messages" else body


def evaluate(tenant: Tenant, body: Mapping[str, Any], *, endpoint: Endpoint = "chat",
             boundary: int | None = None, marker: str | None = None,
             scans: DigestMemo[Findings] | None = None) -> PolicyDecision:
    """The tenant's policy applied to one validated request body. Pure; the input is not modified.

    ``boundary``: index of the first message below the stable prefix (default:
    the final user message). ``marker``: a literal the client may place where
    its stable prefix ends (``RoutingSettings.boundary_marker``). ``scans``: a memo
    of hygiene's per-text scans, kept per cache namespace (``hygiene.analyze``).
    """
    model = body.get("model")
    if isinstance(model, str) and not allows_model(tenant, model):
        return PolicyDecision(tenant, body, rejection=Rejection.from_error(ModelNotAllowed(model)))
    if "kv_transfer_params" in body:
        return PolicyDecision(tenant, body, rejection=Rejection.from_error(TransferParamsRefused()))
    out, stripped = strip_client_fields(body)
    if tenant.normalize_tools and endpoint in _TOOLS_NORMALISED:
        out = normalize_tools(out, sort_tools=tenant.sort_tools)
    if endpoint in _SALTED:
        out = apply_salt(out, tenant.cache_salt)
    warnings: tuple[PrefixWarning, ...] = ()
    if tenant.prompt_hygiene and endpoint in _HYGIENE:
        warnings = tuple(analyze(hygiene_body(endpoint, out), boundary=boundary, marker=marker, memo=scans,
                                 scope=tenant.namespace))
    return PolicyDecision(tenant, out, warning_headers(warnings), warnings, stripped)
