"""The admin API's OpenAPI 3.0 document, written as data so it stays next to nothing else.

It mirrors ``gateway.admin.api`` and ``gateway.admin.tenants``; ``tests/test_admin.py``
runs schemathesis against it to keep the two honest.
"""

from __future__ import annotations

from typing import Any

_ERROR = {"$ref": "#/components/schemas/Error"}
_NAME = {"type": "string", "pattern": "^[A-Za-z0-9_.-]+$", "minLength": 1, "maxLength": 64}
# A tenant's class and share in the fair queue (policies.priority, gateway.proxy.admission).
_QUEUE_FIELDS: dict[str, Any] = {
    "priority": {"type": "string", "enum": ["interactive", "standard", "batch"]},
    "weight": {"type": "number", "exclusiveMinimum": True, "minimum": 0, "maximum": 1000},
    "queue_timeout_s": {"type": "number", "exclusiveMinimum": True, "minimum": 0, "maximum": 3600}}


def _resp(code: str, desc: str, schema: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"description": desc}
    if schema is not None:
        out["content"] = {"application/json": {"schema": schema}}
    return out


def _errors(*codes: str) -> dict[str, Any]:
    base = {"401": _resp("401", "missing or invalid admin token", _ERROR),
            "403": _resp("403", "a tenant key, or the admin API is disabled", _ERROR)}
    for c in codes:
        base[c] = _resp(c, {"400": "invalid body", "404": "not found", "409": "conflict",
                            "503": "store unavailable"}[c], _ERROR)
    return base


def _op(summary: str, ok: str, *, schema: dict[str, Any] | None = None, body: str | None = None,
        errors: tuple[str, ...] = (), params: list[str] = ()) -> dict[str, Any]:  # type: ignore[assignment]
    op: dict[str, Any] = {"summary": summary, "security": [{"bearer": []}],
                          "responses": {ok: _resp(ok, "ok", schema if ok != "204" else None), **_errors(*errors)}}
    if body:
        op["requestBody"] = {"required": False, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{body}"}}}}
    if params:
        op["parameters"] = [{"name": p, "in": "path", "required": True, "schema": _NAME} for p in params]
    return op


_OBJ = {"type": "object"}

_SCHEMAS: dict[str, Any] = {
    "Error": {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                                         "param": {"type": "string", "nullable": True},
                                         "code": {"type": "string", "nullable": True}}}}},
    "ReplicaIn": {"type": "object", "additionalProperties": False, "required": ["name", "url"], "properties": {
        "name": _NAME, "url": {"type": "string", "example": "http://127.0.0.1:9001"},
        "weight": {"type": "number", "exclusiveMinimum": True, "minimum": 0, "maximum": 1000},
        "models": {"type": "array", "items": {"type": "string"}, "maxItems": 64},
        "scheduling_policy": {"type": "string", "enum": ["fcfs", "priority"],
                              "description": "the replica's vLLM --scheduling-policy"},
        "max_in_flight": {"type": "integer", "minimum": 1, "nullable": True,
                          "description": "admission limit; unset: learned from the replica's /metrics"},
        "role": {"type": "string", "enum": ["prefill", "decode", "both"],
                 "description": "its part in a P/D fleet (vLLM's NixlConnector on both sides)"}}},
    "PurgeIn": {"type": "object", "additionalProperties": False, "properties": {
        "tenant": {"type": "string", "maxLength": 64, "nullable": True},
        "model": {"type": "string", "maxLength": 256, "nullable": True},
        "older_than_s": {"type": "number", "minimum": 0, "nullable": True}}},
    "RoutingIn": {"type": "object", "additionalProperties": False, "properties": {
        "policy": {"type": "string", "nullable": True,
                   "enum": ["prefix_affinity", "ttft", "least_load", "round_robin", "consistent_hash", "cost"],
                   "description": "cost: the former name of prefix_affinity"},
        "epsilon": {"type": "number", "minimum": 0, "maximum": 10, "nullable": True},
        "disaggregation": {"type": "string", "enum": ["selective", "always"], "nullable": True,
                           "description": "P/D fleets: remote prefill when it pays, or always"}}},
    "ExplainIn": {"type": "object", "additionalProperties": False, "required": ["body"], "properties": {
        "endpoint": {"type": "string", "enum": ["chat", "completions"]},
        "tenant": {**_NAME, "nullable": True},
        "body": {"type": "object", "description": "the request as a client would send it"}}},
    "TenantIn": {"type": "object", "additionalProperties": False, "required": ["name"], "properties": {
        "name": _NAME, "namespace": {**_NAME, "nullable": True},
        "models": {"type": "array", "items": {"type": "string"}, "nullable": True},
        "semantic_cache": {"type": "boolean"},
        "requests_per_minute": {"type": "integer", "minimum": 1, "nullable": True},
        "tokens_per_minute": {"type": "integer", "minimum": 1, "nullable": True},
        "normalize_tools": {"type": "boolean"}, "sort_tools": {"type": "boolean"},
        "prompt_hygiene": {"type": "boolean"}, **_QUEUE_FIELDS, "issue_key": {"type": "boolean"}}},
    "TenantPatch": {"type": "object", "additionalProperties": False, "properties": {
        "namespace": {**_NAME, "nullable": True},
        "models": {"type": "array", "items": {"type": "string"}, "nullable": True},
        "semantic_cache": {"type": "boolean", "nullable": True},
        "requests_per_minute": {"type": "integer", "minimum": 1, "nullable": True},
        "tokens_per_minute": {"type": "integer", "minimum": 1, "nullable": True},
        "normalize_tools": {"type": "boolean", "nullable": True},
        "sort_tools": {"type": "boolean", "nullable": True},
        "prompt_hygiene": {"type": "boolean", "nullable": True},
        **{k: {**v, "nullable": True} for k, v in _QUEUE_FIELDS.items()}}},
    "Trends": {"type": "object", "required": ["interval_s", "capacity", "samples"], "properties": {
        "interval_s": {"type": "number"}, "capacity": {"type": "integer"},
        "samples": {"type": "array", "items": {"type": "object", "required": ["t", "requests_per_s"], "properties": {
            "t": {"type": "number", "description": "end of the interval, unix seconds"},
            "requests_per_s": {"type": "number"},
            "prefix_hit_rate": {"type": "number", "nullable": True},
            "ttft_p95_s": {"type": "number", "nullable": True},
            "prefill_saved_share": {"type": "number", "nullable": True,
                                    "description": "1 - prefill computed / round robin's estimate"}}}}}},
    "KeyIn": {"type": "object", "additionalProperties": False, "properties": {
        "rotate": {"type": "boolean"}, "key_id": {"type": "string", "maxLength": 64, "nullable": True}}},
}


def openapi_document() -> dict[str, Any]:
    r, t = ("name",), ("name",)
    paths = {
        "/admin/replicas": {
            "get": _op("List replicas with live load and prefix hit rate", "200", schema=_OBJ),
            "post": _op("Add a replica", "201", schema=_OBJ, body="ReplicaIn", errors=("400", "409"))},
        "/admin/replicas/{name}": {
            "get": _op("One replica", "200", schema=_OBJ, errors=("404",), params=list(r)),
            "delete": _op("Remove a replica (its keys move to their next choice)", "204", errors=("404",),
                          params=list(r))},
        "/admin/replicas/{name}/drain": {"post": _op("Drain: no new requests", "200", schema=_OBJ,
                                                     errors=("404",), params=list(r))},
        "/admin/replicas/{name}/undrain": {"post": _op("Undrain", "200", schema=_OBJ, errors=("404",),
                                                       params=list(r))},
        "/admin/routing": {"get": _op("Routing policy and affinity statistics", "200", schema=_OBJ),
                           "patch": _op("Change policy, epsilon or the P/D mode", "200", schema=_OBJ, body="RoutingIn",
                                        errors=("400",))},
        "/admin/routing/explain": {"post": _op("Every replica's predicted time to first token for a request, "
                                               "its terms and rails, the pick first; on a P/D fleet, remote "
                                               "prefill or local and the decision's terms (nothing learned)", "200",
                                               schema=_OBJ, body="ExplainIn", errors=("400", "404"))},
        "/admin/cache": {"get": _op("Semantic-cache statistics", "200", schema=_OBJ)},
        "/admin/cache/purge": {"post": _op("Purge by tenant, model or age", "200", schema=_OBJ, body="PurgeIn",
                                           errors=("400",))},
        "/admin/hygiene": {"get": _op("Prompt-hygiene report", "200", schema=_OBJ)},
        "/admin/config/reload": {"post": _op("Reload the configuration file", "200", schema=_OBJ,
                                             errors=("400",))},
        "/admin/status": {"get": _op("Everything the status page shows", "200", schema=_OBJ)},
        "/admin/savings": {"get": _op("Prefill computed against round robin's estimate (tokens, GPU-seconds) "
                                      "and the semantic cache's savings, per tenant and per replica, with the "
                                      "shadow's memory and CPU", "200", schema=_OBJ, errors=("404",))},
        "/admin/trends": {"get": _op("Per-interval samples (request rate, fleet prefix-cache hit rate, "
                                     "TTFT p95, prefill saved against round robin) for the last 15 minutes",
                                     "200",
                                     schema={"$ref": "#/components/schemas/Trends"})},
        "/admin/tenants": {
            "get": _op("List tenants (never key material)", "200", schema=_OBJ),
            "post": _op("Create a tenant; returns its first key once", "201", schema=_OBJ, body="TenantIn",
                        errors=("400", "409", "503"))},
        "/admin/tenants/{name}": {
            "get": _op("One tenant", "200", schema=_OBJ, errors=("404",), params=list(t)),
            "patch": _op("Update a tenant", "200", schema=_OBJ, body="TenantPatch",
                         errors=("400", "404", "409", "503"), params=list(t)),
            "delete": _op("Delete a tenant", "204", errors=("404", "409", "503"), params=list(t))},
        "/admin/tenants/{name}/keys": {
            "post": _op("Add or rotate a key; returns it once", "201", schema=_OBJ, body="KeyIn",
                        errors=("400", "404", "409", "503"), params=list(t))},
        "/admin/tenants/{name}/keys/{kid}": {
            "delete": {**_op("Revoke a key", "204", errors=("404", "409", "503")),
                       "parameters": [{"name": "name", "in": "path", "required": True, "schema": _NAME},
                                      {"name": "kid", "in": "path", "required": True,
                                       "schema": {"type": "string", "maxLength": 64}}]}},
    }
    return {
        "openapi": "3.0.3",
        "info": {"title": "kvgate admin API", "version": "1"},
        "paths": paths,
        "components": {"schemas": _SCHEMAS,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }
