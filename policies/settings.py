"""Tenants section of kvgate's settings (composed into gateway.settings.Settings)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, SecretStr

__all__ = ["TenantSettings"]


class _Section(BaseModel):
    # Unknown keys are a typo, not a silent default.
    model_config = ConfigDict(extra="forbid")


class TenantSettings(_Section):
    # The tenant's name: its label in metrics, logs and the admin API, and its cache namespace by default.
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    # Bearer keys that identify the tenant (kept hashed in memory, never logged).
    api_keys: list[SecretStr] = Field(default_factory=list)
    # Tenants configured into the same namespace share KV and semantic caches.
    namespace: str | None = None
    models: list[str] | None = None  # allowed models; None = all
    semantic_cache: bool = True
    requests_per_minute: int | None = Field(None, ge=1)
    tokens_per_minute: int | None = Field(None, ge=1)
    normalize_tools: bool = False
    # With normalize_tools: also sort the tool list by function name (tool order can matter to a model).
    sort_tools: bool = False
    # Scan prompts for volatile content above the cache boundary; warn in x-kvgate-prefix-warning.
    prompt_hygiene: bool = True

    @property
    def cache_namespace(self) -> str:
        return self.namespace or self.name
