"""What an operator asks of a running gateway: status, readiness, replicas, routing, caches, reload.

Functions over the ``Runtime``, which owns the resources and their set-up and
shutdown; the admin API (``api``) calls these, and the public app serves
``readiness`` at /readyz. A change made here reaches only this process: with
several workers, ``fanout`` passes it to the others.
"""

from __future__ import annotations

import asyncio
from typing import Any

from routing import _native as routing_native
from routing.tokenization import Tokenization

from gateway.errors import BadRequest
from gateway.proxy.pool import snapshot
from gateway.runtime import Runtime
from gateway.settings import ConfigError, load_settings

__all__ = ["add_replica", "cache_stats", "hygiene_report", "is_tenant_key", "purge_cache", "readiness",
           "reload_config", "routing_stats", "set_routing", "status", "workers"]


def is_tenant_key(rt: Runtime, key: str) -> bool:
    try:
        return not rt.engine.registry.open_mode and rt.engine.registry.authenticate(key) is not None
    except Exception:
        return False


async def add_replica(rt: Runtime, name: str, url: str, *, weight: float = 1.0,
                      models: list[str] | None = None, scheduling_policy: str = "fcfs",
                      max_in_flight: int | None = None, role: str = "both") -> None:
    replica = rt.pool.add(name, url, weight=weight, models=models or (), source="admin",
                          scheduling_policy=scheduling_policy, max_in_flight=max_in_flight, role=role)
    await rt.pool.check(replica)
    rt.sync_kv_events()


def set_routing(rt: Runtime, *, policy: str | None, epsilon: float | None,
                disaggregation: str | None = None) -> None:
    update: dict[str, Any] = {}
    if policy is not None:
        update["policy"] = "prefix_affinity" if policy == "cost" else policy  # its former name
    if epsilon is not None:
        update["epsilon"] = epsilon
    if update or disaggregation is not None:
        routing = rt.settings.routing.model_copy(
            update={**update, **({"disaggregation": disaggregation} if disaggregation is not None else {})})
        rt.settings = rt.settings.model_copy(update={"routing": routing})
        if update:  # the P/D mode is read per request (gateway.proxy.disagg): the policy keeps what it learned
            rt.use_routing(routing)


def routing_stats(rt: Runtime) -> dict[str, Any]:
    stats = getattr(rt.policy, "stats", None)
    out: dict[str, Any] = {"policy": rt.policy.name, "epsilon": rt.settings.routing.epsilon,
                           "disaggregation": rt.settings.routing.disaggregation,
                           # Whether the decision runs compiled (routing._native): half the cost.
                           "compiled": routing_native.compiled(),
                           # prefer + observe per request, timed inside this process.
                           "decision_cost": rt.decision_times.summary()}
    if callable(stats):
        out.update(stats())
    out.update(rt.routing_counts)
    if rt.prefill_policy is not rt.policy and rt.pool.disaggregated:
        # The P/D prefill pick's own policy (routing.prefill_pick): what it decided and learned.
        prefill_stats = getattr(rt.prefill_policy, "stats", None)
        out["prefill_pick"] = {"policy": rt.prefill_policy.name, **(prefill_stats() if callable(prefill_stats) else {})}
    if rt.kv_events is not None:
        out["kv_events"] = rt.kv_events.stats()
        if getattr(rt.policy, "truth", None) is None:
            # Only the prefix policies read the events; say so instead of claiming precision.
            for row in out["kv_events"]["replicas"].values():
                row["mode"] = "approximate"
            out["kv_events"]["note"] = "precise mode needs routing.policy: prefix_affinity or ttft"
    configured = [m for r in rt.settings.replicas for m in r.models]
    out["tokenization"] = rt.tokenization.stats(configured + rt.pool.models(healthy_only=False))
    if rt.routing_sync is not None and isinstance(out.get("shared_facts"), dict):
        out["shared_facts"]["failing"] = rt.routing_sync.failing
        # Other instances heard on the fleet's stream: none, and this one publishes no facts.
        out["shared_facts"]["instances_heard"] = rt.routing_sync.heard()
    return out


def cache_stats(rt: Runtime) -> dict[str, Any]:
    if rt.cache is None:
        return {"enabled": False}
    return {"enabled": True, **rt.cache.stats()}


async def purge_cache(rt: Runtime, *, tenant: str | None, model: str | None, older_than_s: float | None) -> int:
    if rt.cache is None:
        return 0
    namespace = None
    if tenant is not None:
        t = rt.engine.registry.tenant(tenant)
        namespace = t.namespace if t is not None else tenant
    return await rt.cache.purge(namespace=namespace, model=model, older_than_s=older_than_s)


def hygiene_report(rt: Runtime) -> dict[str, Any]:
    return rt.hygiene.report().to_dict()


async def reload_config(rt: Runtime) -> dict[str, Any]:
    """Re-read the config file: replicas are added/removed, routing and limits replaced."""
    if not rt.config_path:
        raise BadRequest("kvgate was started without a config file; nothing to reload", code="no_config")
    try:
        new = load_settings(rt.config_path)
    except ConfigError as e:
        raise BadRequest(str(e), code="invalid_config") from None
    old_routing = rt.settings.routing
    wanted = {r.name: r for r in new.replicas}
    for name, r in list(rt.pool.replicas.items()):
        if r.source == "config" and name not in wanted:
            rt.pool.remove(name)
    for name, spec in wanted.items():
        if name not in rt.pool.replicas:
            rt.pool.add(name, spec.url, weight=spec.weight, models=spec.models,
                        scheduling_policy=spec.scheduling_policy, max_in_flight=spec.max_in_flight, role=spec.role)
        elif rt.pool.replicas[name].source == "config":
            # What a replica takes and how many may be sent it change without a restart.
            replica = rt.pool.replicas[name]
            replica.scheduling_policy, replica.max_in_flight = spec.scheduling_policy, spec.max_in_flight
            replica.role = spec.role
    rt.settings = rt.settings.model_copy(update={"routing": new.routing, "limits": new.limits,
                                                 "timeouts": new.timeouts})
    rt.use_routing(new.routing)
    old = rt.tokenization
    if (new.routing.tokenizers, new.routing.render_url) != (old_routing.tokenizers, old_routing.render_url):
        # Loads the new directories before the old sources go, so no request sees neither.
        rt.tokenization = await asyncio.to_thread(Tokenization(new.routing).load)
        await old.aclose()
    rt.sync_kv_events()
    rt.admission.pump()  # a raised limit frees slots for whoever waits
    return {"reloaded": True, "replicas": sorted(rt.pool.replicas)}


def status(rt: Runtime) -> dict[str, Any]:
    report = hygiene_report(rt)
    warned = {name: t["requests_with_warnings"] for name, t in report["tenants"].items()}
    tenants = [{**row, "warnings": warned.get(row["name"], 0)} for row in rt.tenant_stats.rows()]
    replicas = snapshot(rt.pool)
    if rt.kv_events is not None:
        for row in replicas:  # precise or approximate, and why (routing.kv_events)
            row["routing"] = rt.kv_events.mode(row["name"])
    return {"replicas": replicas, "tenants": tenants, "totals": rt.tenant_stats.totals(),
            "endpoints": rt.endpoint_stats.rows(),
            "hygiene": report, "cache": cache_stats(rt), "routing": routing_stats(rt),
            "queue": rt.admission.stats(), "disaggregation": rt.disagg.stats(),
            "ready": readiness(rt)[1], "workers": workers(rt)}


def workers(rt: Runtime) -> dict[str, Any]:
    """How many worker processes serve the port. The rest of the status is this worker's
    own view (worker 0, which serves the admin port); /metrics sums over all of them."""
    if rt.worker is None:
        return {"configured": 1, "running": 1, "this_worker": 0}
    return {**rt.worker.state(), "this_worker": rt.worker.id}


def readiness(rt: Runtime) -> tuple[bool, dict[str, Any]]:
    now = rt.pool.clock()
    configured = {m for r in rt.settings.replicas for m in r.models}
    models = configured | set(rt.pool.models(healthy_only=False))
    degraded: list[str] = []
    unserved = sorted(m for m in models if not rt.pool.eligible(m))
    degraded += [f"model {m}: no healthy replica" for m in unserved]
    down = [r.name for r in rt.pool.replicas.values() if not r.available(now)]
    if down:
        degraded.append("replicas unavailable: " + ", ".join(sorted(down)))
    if not rt.pool.replicas:
        degraded.append("no replicas configured")
    for part, state in rt.engine.readiness().items():
        if state != "ok":
            degraded.append(f"{part}: {state}")
    if rt.cache is not None:
        if not rt.cache.healthy:
            degraded.append("semantic cache: store degraded, serving misses")
        degraded += rt.cache.readiness()
    if rt.routing_sync is not None and rt.routing_sync.failing:
        degraded.append("routing facts: Redis unreachable, routing on this instance's knowledge")
    if rt.kv_events is not None:
        degraded += rt.kv_events.degraded()
    degraded += rt.tokenization.degraded()
    if rt.shutting_down:
        degraded.append("shutting down")
    ready = (rt.started and not rt.shutting_down and bool(rt.pool.replicas) and not unserved
             and bool(models))
    return ready, {"ready": ready, "models": sorted(models), "degraded": degraded}
