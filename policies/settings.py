"""Tenants section of kvgate's settings (composed into gateway.settings.Settings)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr

__all__ = ["PriorityClass", "TenantSettings"]

# Scheduling classes, most urgent first (``policies.priority`` maps them to vLLM's ``priority``).
PriorityClass = Literal["interactive", "standard", "batch"]


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
    # Scheduling class: sets vLLM's ``priority`` on replicas that schedule by priority, and the band
    # of kvgate's own queue. A request may lower its class (x-kvgate-priority), never raise it.
    priority: PriorityClass = "standard"
    # The tenant's share of the fleet when it is full: queued work (prompt tokens) is served in
    # proportion to weight among tenants of one class (weighted fair queueing, policies.fair_queue).
    weight: float = Field(1.0, gt=0, le=1000)
    # Longest a request waits in kvgate's queue for a free replica slot before a 429 with Retry-After.
    queue_timeout_s: float = Field(30.0, gt=0, le=3600)

    @property
    def cache_namespace(self) -> str:
        return self.namespace or self.name
