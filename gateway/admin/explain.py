"""``POST /admin/routing/explain``: why the policy would send a request where it would.

The body is the request as a client would send it (``body``), the route it
would take (``endpoint``) and, where tenants are configured, whose it is
(``tenant``: its namespace keys the prefix, its ``cache_salt`` keys the
blocks, as on the hot path). The answer is every eligible replica's terms from
the policy's ``explain`` (``prefix_affinity``: its cost in prompt tokens and
the bound; ``ttft``: the predicted time to first token, its terms and the
rail), the pick first; on a P/D fleet also ``disaggregation``: remote prefill or
local, with the decision's terms (``routing.disagg``); nothing is learned and nothing is sent to a replica,
so an operator can ask as often as they like.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import orjson
from pydantic import Field

from policies import apply_salt
from routing import RouteRequest

from .bodies import Body
from gateway.errors import BadRequest, NotFound
from gateway.proxy.disagg import DECODE_ROLES, PREFILL_ROLES
from gateway.proxy.validate import validate

if TYPE_CHECKING:
    from gateway.runtime import Runtime

__all__ = ["ExplainIn", "explain"]


class ExplainIn(Body):
    endpoint: Literal["chat", "completions"] = "chat"
    tenant: str | None = Field(None, max_length=64)
    body: dict[str, Any]


async def explain(rt: "Runtime", spec: ExplainIn) -> dict[str, Any]:
    policy = rt.policy
    explainer = getattr(policy, "explain", None)
    if explainer is None:
        raise BadRequest(f"explain needs routing.policy prefix_affinity or ttft (this gateway runs {policy.name})",
                         param="policy")
    limits = rt.settings.limits
    # The hot path's own checks: what it would refuse, explain refuses the same way.
    model = validate(spec.endpoint, spec.body, max_n=limits.max_n, max_tokens=limits.max_tokens_ceiling)
    registry = rt.engine.registry
    tenant = registry.tenant(spec.tenant) if spec.tenant else registry.default_tenant()
    if tenant is None:
        raise NotFound(f"no tenant '{spec.tenant}'" if spec.tenant else "tenants are configured: name one",
                       param="tenant")
    body = apply_salt(dict(spec.body), tenant.cache_salt)
    replicas = rt.pool.eligible(model)
    if not replicas:
        raise NotFound(f"no healthy replica serves model '{model}'", param="body.model")
    route = RouteRequest(spec.endpoint, model, tenant.namespace, body)
    if rt.tokenization.enabled:
        route.token_ids = await rt.tokenization.token_ids(model, spec.endpoint, body)
    pd = rt.pool.disaggregated
    # A P/D fleet: ``replicas`` are the decode pick's candidates, ``prefill_replicas`` the prefill pick's.
    decoders = [r for r in replicas if r.role in DECODE_ROLES] if pd else replicas
    out = {"policy": policy.name, "model": model, "tenant": tenant.name, "token_ids": route.token_ids is not None,
           "replicas": _rows(explainer, route, decoders)}
    if pd:
        # The prefill pick's own policy (routing.prefill_pick): a ttft instance, or the same one.
        prefill_explainer = getattr(rt.prefill_policy, "explain", None) or explainer
        out["prefill_policy"] = rt.prefill_policy.name
        out["prefill_replicas"] = _rows(prefill_explainer, route.leg(),
                                        [r for r in replicas if r.role in PREFILL_ROLES])
        # Remote prefill or local, and the terms that decided it (routing.disagg).
        out["disaggregation"] = rt.disagg.explain(route, len(orjson.dumps(body)))
    return out


def _rows(explainer: Any, route: RouteRequest, replicas: list[Any]) -> list[dict[str, Any]]:
    if not replicas:
        return []
    rows = [r._asdict() if hasattr(r, "_asdict") else dict(r) for r in explainer(route, replicas)]
    return [{**row, "pick": i == 0} for i, row in enumerate(rows)]
