"""Policy errors: one small tree, each carrying exactly what a client may see.

    PolicyError                         status, type, code, message, param
    ├── AuthError                 401   (the gateway maps all of these to 401)
    │   ├── MissingApiKey               "missing_api_key"
    │   ├── InvalidApiKey               "invalid_api_key": malformed OR unknown, on purpose
    │   └── ApiKeyInQuery               "api_key_in_query"
    ├── TenantsUnavailable        503   tenants live in a store that has never loaded
    ├── ModelNotAllowed           404   "model_not_found": indistinguishable from a missing model
    ├── InvalidPriority           400   "invalid_priority": x-kvgate-priority names no class, or
    │                                   one above the tenant's
    ├── TransferParamsRefused     400   "kv_transfer_params_refused": only the gateway moves KV blocks
    └── RateLimited               429   "rate_limit_exceeded" + retry_after_s

    AdminError                          raised by the runtime tenant API only
    ├── TenantNotFound            404
    ├── KeyNotFound               404
    ├── TenantExists              409
    ├── TenantManagedByConfig     409   config-file tenants are changed in the config file
    ├── InvalidTenantSpec         400
    └── StoreUnavailable          503   the tenant store (Redis) refused or timed out

Messages are fixed strings written here: they never contain a key, a prompt or
a store's raw error, so the gateway may show them as they are. The reason an
API key failed (``InvalidApiKey.reason``) is for metrics only; clients learn
nothing beyond "invalid", which keeps malformed and unknown keys alike.
"""

from __future__ import annotations

from typing import Literal


class PolicyError(Exception):
    status = 400
    type = "invalid_request_error"
    code = "policy_error"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class AuthError(PolicyError):
    status = 401
    type = "authentication_error"


class MissingApiKey(AuthError):
    code = "missing_api_key"

    def __init__(self) -> None:
        super().__init__("Missing API key: send 'Authorization: Bearer <key>'.")


class InvalidApiKey(AuthError):
    code = "invalid_api_key"

    def __init__(self, reason: Literal["malformed", "unknown"] = "unknown") -> None:
        super().__init__("Invalid API key.")
        self.reason = reason


class ApiKeyInQuery(AuthError):
    code = "api_key_in_query"

    def __init__(self) -> None:
        # URLs end up in access logs and browser history: the key is refused, never used.
        super().__init__("API keys are not accepted in the URL; send 'Authorization: Bearer <key>'.")


class TenantsUnavailable(PolicyError):
    status = 503
    type = "service_unavailable"
    code = "tenants_unavailable"

    def __init__(self) -> None:
        super().__init__("Tenant configuration is not loaded yet; retry shortly.")


class ModelNotAllowed(PolicyError):
    status = 404
    code = "model_not_found"

    def __init__(self, model: str) -> None:
        # Same words as an unknown model, so a tenant cannot probe which models exist.
        shown = model if len(model) <= 64 else model[:61] + "..."
        super().__init__(f"The model '{shown}' does not exist or you do not have access to it.",
                         param="model")


class InvalidPriority(PolicyError):
    code = "invalid_priority"

    def __init__(self, message: str) -> None:
        super().__init__(message, param="x-kvgate-priority")


class TransferParamsRefused(PolicyError):
    """A client sent ``kv_transfer_params``: it could name KV blocks computed for another tenant
    (vLLM's NixlConnector pulls whatever the params name), so it is refused, not stripped."""

    code = "kv_transfer_params_refused"

    def __init__(self) -> None:
        super().__init__("kv_transfer_params is set by the gateway only (disaggregated prefill); remove it",
                         param="kv_transfer_params")


class RateLimited(PolicyError):
    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"

    def __init__(self, kind: str, retry_after_s: int) -> None:
        super().__init__(f"Rate limit reached for {kind} per minute; retry after {retry_after_s} s.")
        self.retry_after_s = retry_after_s


class AdminError(Exception):
    status = 400
    code = "admin_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class TenantNotFound(AdminError):
    status = 404
    code = "tenant_not_found"

    def __init__(self, name: str) -> None:
        super().__init__(f"tenant '{name}' does not exist")


class KeyNotFound(AdminError):
    status = 404
    code = "key_not_found"

    def __init__(self, key_id: str) -> None:
        super().__init__(f"key '{key_id}' does not exist for this tenant")


class TenantExists(AdminError):
    status = 409
    code = "tenant_exists"

    def __init__(self, name: str) -> None:
        super().__init__(f"tenant '{name}' already exists")


class TenantManagedByConfig(AdminError):
    status = 409
    code = "tenant_managed_by_config"

    def __init__(self, name: str) -> None:
        super().__init__(f"tenant '{name}' is defined in the configuration file; change it there")


class InvalidTenantSpec(AdminError):
    status = 400
    code = "invalid_tenant"


class StoreUnavailable(AdminError):
    status = 503
    code = "tenant_store_unavailable"

    def __init__(self) -> None:
        super().__init__("the tenant store is unavailable; retry shortly")
