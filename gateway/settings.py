"""The one typed settings object.

Loaded and validated once at start-up from a YAML file, then overridden by
``KVGATE_*`` environment variables (``KVGATE_LISTEN__PORT=9000`` sets
``listen.port``; a double underscore descends one level). This is the only
module that reads the environment. A bad value fails start-up with a message
naming the field (``replicas.0.url: ...``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, Mapping
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator

from policies.settings import TenantSettings
from routing.settings import RoutingSettings
from semantic_cache.settings import SemanticCacheSettings

ENV_PREFIX = "KVGATE_"
# KVGATE_* variables that are not settings: the config file's path, and the switch that runs
# routing from source rather than compiled (read at import, before any setting: routing._native).
_NOT_SETTINGS = frozenset({"KVGATE_CONFIG", "KVGATE_INTERPRETED"})


class _Section(BaseModel):
    # Unknown keys are a typo, not a silent default.
    model_config = ConfigDict(extra="forbid")


class ListenSettings(_Section):
    # The public listener (the /v1 routes, health, readiness, metrics).
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)


class AdminSettings(_Section):
    # The admin listener (admin API and status page); keep it on a private interface.
    host: str = "127.0.0.1"
    port: int = Field(8081, ge=0, le=65535)
    # The bearer token every admin request must carry.
    token: SecretStr | None = None
    # Off: no admin listener.
    enabled: bool = True
    # The status page's trend lines: one sample per interval, the last N kept (10 s x 90 = 15 min).
    trend_interval_s: float = Field(10.0, gt=0, le=3600)
    trend_samples: int = Field(90, ge=2, le=10_000)
    # The savings shadows (GET /admin/savings; routing.shadow): the most sampled blocks each keeps
    # per replica (about 140 bytes each, two shadows); the sample rate is the largest power of
    # 1/2 that fits the largest pool in it (docs/savings.md). 0: no savings accounting.
    savings_shadow_entries: int = Field(8192, ge=0, le=1 << 24)


class ReplicaSettings(_Section):
    # The replica's name in routing, metrics and the admin API; unique.
    name: str = Field(min_length=1, max_length=64)
    # The replica's base URL (http or https, with a host).
    url: str
    # Discovered from the replica's /v1/models when empty.
    models: list[str] = Field(default_factory=list)
    # Relative weight in routing (rendezvous hashing is weighted).
    weight: float = Field(1.0, gt=0)
    # Sent as a bearer token to a replica started with --api-key; never logged.
    api_key: SecretStr | None = None
    # The replica's KV events (vLLM --kv-events-config endpoint and replay_endpoint, as
    # seen from kvgate): with them and token ids for the request, the cost model routes
    # on what the replica really holds (routing.kv_events).
    kv_events: str | None = None
    kv_events_replay: str | None = None
    # The replica's vLLM --scheduling-policy. Tenants' classes (policies.priority) are sent as
    # `priority` to "priority" replicas only: under fcfs a non-zero value is refused by vLLM's
    # protocol (and by engines that enforce it) and ignored by vLLM 0.33.
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    # Requests in flight and waiting at the replica, fleet-wide, past which kvgate queues them
    # itself (gateway.proxy.admission). Unset: learned from what the replica reports on /metrics.
    # Give vLLM's --max-num-seqs: routing (`ttft`) also reads it as the replica's seats, and
    # prices the wait for one past them (vLLM does not report the number).
    max_in_flight: int | None = Field(None, ge=1)
    # Its part in a disaggregated (P/D) fleet, vLLM started with --kv-transfer-config
    # '{"kv_connector":"NixlConnector","kv_role":"kv_both"}': "prefill" replicas only prefill
    # for others (max_tokens 1, the KV blocks handed on), "decode" replicas pull those blocks
    # and stream, "both" serve whole requests. With no prefill or decode replica, nothing of
    # P/D runs (gateway.proxy.disagg).
    role: Literal["prefill", "decode", "both"] = "both"

    @field_validator("kv_events", "kv_events_replay")
    @classmethod
    def _zmq_endpoint(cls, v: str | None) -> str | None:
        if v is None:
            return v
        parts = urlsplit(v)
        if parts.scheme not in ("tcp", "ipc") or (parts.scheme == "tcp" and not (parts.hostname and parts.port)):
            raise ValueError("must be a ZMQ endpoint to connect to, e.g. tcp://10.0.0.11:5557")
        return v

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        parts = urlsplit(v)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("must be an http(s) URL with a host, e.g. http://127.0.0.1:9001")
        return v.rstrip("/")



class LimitSettings(_Section):
    # Largest request body accepted (413 beyond it), multipart uploads included.
    max_body_bytes: int = Field(10 * 1024 * 1024, ge=1024)
    # Deepest JSON nesting accepted in a body (400 beyond it).
    max_json_depth: int = Field(64, ge=4, le=1000)
    # Largest n (choices per request) accepted.
    max_n: int = Field(16, ge=1)
    # Largest max_tokens (and max_completion_tokens) accepted.
    max_tokens_ceiling: int = Field(1_000_000, ge=1)


class TimeoutSettings(_Section):
    # Connecting to a replica.
    connect_s: float = Field(2.0, gt=0)
    # No response headers / first byte from the replica within this: 504.
    first_byte_s: float = Field(120.0, gt=0)
    # No bytes mid-stream for this long: an error event ends the stream.
    stall_s: float = Field(60.0, gt=0)
    # Whole non-streaming answer.
    non_stream_s: float = Field(600.0, gt=0)
    # A request head must be complete this long after its first byte (slowloris).
    header_receive_s: float = Field(10.0, gt=0)
    # Client must finish sending its body within this.
    body_receive_s: float = Field(30.0, gt=0)


class PoolSettings(_Section):
    # How often each replica's health is checked.
    health_interval_s: float = Field(2.0, gt=0)
    # How often each replica's /metrics is scraped (load, KV usage, prefix-cache counters).
    metrics_interval_s: float = Field(1.0, gt=0)
    # Failures in a row that eject a replica from routing.
    eject_consecutive_failures: int = Field(5, ge=1)
    # An ejection lasts eject_base_s times the replica's ejections so far, at most eject_max_s.
    eject_base_s: float = Field(30.0, gt=0)
    eject_max_s: float = Field(300.0, gt=0)
    # Retry budget, as Envoy's: retries in flight at most max(retry_budget_min, ratio x active requests).
    retry_budget_ratio: float = Field(0.2, ge=0, le=1)
    retry_budget_min: int = Field(3, ge=0)
    # Replicas tried per request, the first included.
    max_attempts: int = Field(3, ge=1, le=10)
    # Connections kept per replica by the shared HTTP client.
    max_connections: int = Field(1024, ge=1)
    # With tenants configured, requests past every replica's admission limit wait in kvgate's
    # per-tenant fair queue (gateway.proxy.admission). Off: they go to the replicas' own queues.
    fair_queue: bool = True
    # With the fair queue: a streamed answer bounded by max_tokens hands its slot on at its last
    # decode step, so the next request waits inside the replica for that step instead of a hop
    # after the stream ends: throughput within 2-3% of first-come in bench/fairness.py, against
    # 5% with the hop (docs/benchmarks/fairness.md). Off: every slot is handed on when its stream ends.
    hand_on_at_last_step: bool = True


class Settings(_Section):
    listen: ListenSettings = Field(default_factory=ListenSettings)
    admin: AdminSettings = Field(default_factory=AdminSettings)
    # Shared state (rate limits, runtime tenants, semantic cache). redis://host:port/db (or
    # rediss://, unix://) is one server; redis+cluster://host:port (rediss+cluster:// for TLS)
    # is a Redis Cluster, any node as the seed. See gateway/redis_client.py. Unset: per process.
    redis_url: SecretStr | None = None
    # Connect and read timeout of the Redis client (rate limits, runtime tenants, the cache's store).
    redis_timeout_s: float = Field(0.25, gt=0)
    replicas: list[ReplicaSettings] = Field(default_factory=list)
    routing: RoutingSettings = Field(default_factory=RoutingSettings)
    tenants: list[TenantSettings] = Field(default_factory=list)
    semantic_cache: SemanticCacheSettings = Field(default_factory=SemanticCacheSettings)
    limits: LimitSettings = Field(default_factory=LimitSettings)
    timeouts: TimeoutSettings = Field(default_factory=TimeoutSettings)
    pool: PoolSettings = Field(default_factory=PoolSettings)
    # Keys HMACs (cache_salt) and key hashes; set it in production so salts survive restarts.
    server_secret: SecretStr = SecretStr("kvgate-dev-secret-change-me")
    # Keys the replica tag in the Responses ids kvgate returns (gateway/apis/responses/ids.py). Unset:
    # derived from server_secret. Every instance of a fleet needs the same value.
    response_id_secret: SecretStr | None = None
    # Level of the JSON logs.
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # Prompt text in logs only when this is explicitly on.
    log_prompts: bool = False
    # OTLP/HTTP endpoint to export one trace span per request to. Unset: no tracing.
    otlp_endpoint: str | None = None
    # On SIGTERM: /readyz turns 503 at once; new requests are still served for
    # shutdown_delay_s (load balancers need that long to notice), then the
    # listeners close and streams in flight get up to shutdown_grace_s to finish.
    shutdown_delay_s: float = Field(5.0, ge=0)
    shutdown_grace_s: float = Field(30.0, ge=0)
    # Worker processes on the one listener (SO_REUSEPORT), each a full kvgate with its own
    # routing state, supervised by a parent that restarts one that dies (gateway/server/workers.py).
    workers: int = Field(1, ge=1, le=64)

    @model_validator(mode="after")
    def _unique_names(self) -> "Settings":
        names = [r.name for r in self.replicas]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"replicas: duplicate name(s) {sorted(dup)}")
        tnames = [t.name for t in self.tenants]
        tdup = {n for n in tnames if tnames.count(n) > 1}
        if tdup:
            raise ValueError(f"tenants: duplicate name(s) {sorted(tdup)}")
        keys = [k.get_secret_value() for t in self.tenants for k in t.api_keys]
        if len(keys) != len(set(keys)):
            raise ValueError("tenants: an api key is listed more than once")
        return self


class ConfigError(Exception):
    """A configuration that cannot start kvgate; the message names the field."""


def _format_validation(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        lines.append(f"{loc}: {e['msg']}")
    return "invalid configuration:\n  " + "\n  ".join(lines)


def _env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """KVGATE_A__B=v -> {"a": {"b": v}}; values are parsed as YAML scalars/lists."""
    out: dict[str, Any] = {}
    for key, raw in environ.items():
        if not key.startswith(ENV_PREFIX) or key in _NOT_SETTINGS:
            continue
        path = key[len(ENV_PREFIX):].lower().split("__")
        try:
            value = yaml.safe_load(raw) if raw != "" else None
        except yaml.YAMLError:
            value = raw
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{key}: conflicts with another KVGATE_ variable")
        node[path[-1]] = value
    return out


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(merged.get(k), dict):
            merged[k] = _deep_merge(merged[k], v)
        else:
            merged[k] = v
    return merged


def load_settings(
    path: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Settings:
    """Read the YAML file (if any), apply KVGATE_* variables, validate."""
    environ = os.environ if environ is None else environ
    data: dict[str, Any] = {}
    path = path or environ.get("KVGATE_CONFIG")
    if path:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ConfigError(f"config file {path}: {e.strerror}") from None
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path}: not valid YAML: {e}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {path}: the top level must be a mapping")
        data = loaded
    data = _deep_merge(data, _env_overrides(environ))
    if overrides:
        data = _deep_merge(data, dict(overrides))
    try:
        return Settings.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation(e)) from None
