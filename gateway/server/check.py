"""``kvgate check``: a config's replicas, checked for what each part of kvgate needs from them.

kvgate degrades rather than fails when a replica lacks something (no prefix
caching, no KV events, a tokenizer that is not the replica's), so at run time
those show only as fewer cache hits and a line in ``/readyz``. This says so
before traffic does, per replica, each check ``ok``, ``FAIL`` with what to do,
or ``skip`` when the config does not ask for it:

* **health**: ``GET /health`` answers 200;
* **models**: ``/v1/models`` serves the models the config lists for it (or any);
* **prefix caching**: ``vllm:cache_config_info`` says ``enable_prefix_caching``:
  without it, sending a prefix where it was cached saves nothing;
* **block size**: where the replica publishes KV events, its block size equals
  ``routing.block_size`` (precise routing keys token ids by it);
* **kv events**: its PUB and replay endpoints accept a connection;
* **seats**: its ``max_in_flight`` (vLLM's --max-num-seqs, which vLLM does not
  report): admission's capacity, and what ``ttft`` needs to price a wait for a
  sequence slot (``skip`` with the advice where it is not configured);
* **role**: its part in a P/D fleet (``role``: prefill, decode or both), as
  configured: vLLM's ``/metrics`` does not say which KV connector runs;
* **scheduling**: the replica's ``scheduling_policy`` as configured (vLLM's
  ``/metrics`` does not say which policy runs); where that is ``priority``, a
  one-token completion sent with ``priority`` 1 must not be refused. vLLM's
  protocol says a non-zero priority is an error without priority scheduling, and
  engines that enforce it answer 400, which would refuse every request of a
  non-standard tenant class there; vLLM 0.33 accepts and ignores it, so there
  an answer of 200 shows only that nothing is refused;
* **token ids**: for each model with a ``routing.tokenizers`` directory, the ids
  kvgate computes for a probe chat equal the ones the replica's ``/tokenize``
  gives (a different tokenizer or chat template would make every precise lookup
  miss; ``routing.kv_events`` finds that out too, after 16 requests).

The exit status is 1 if any check failed. Nothing here is on the request path.
"""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass
from typing import Any, Callable
from urllib.parse import urlsplit

import httpx
from prometheus_client.parser import text_string_to_metric_families

from gateway.settings import ReplicaSettings, Settings

__all__ = ["Check", "check_fleet", "format_report"]

PROBE = [{"role": "system", "content": "You are kvgate's probe. Answer in one word."},
         {"role": "user", "content": "Which cache does a prefix hit land in?"}]


@dataclass(frozen=True, slots=True)
class Check:
    replica: str
    name: str
    status: str  # "ok" | "FAIL" | "skip"
    detail: str = ""


def _replicas(settings: Settings) -> list[ReplicaSettings]:
    """The configured replicas, else those the routing DNS name resolves to now."""
    if settings.replicas or not settings.routing.dns_name:
        return list(settings.replicas)
    from routing.membership import dns_target, replica_name, resolve

    out = []
    for url in asyncio.run(resolve(*dns_target(settings.routing.dns_name))):
        found = settings.routing.kv_events.endpoints_at(urlsplit(url).hostname or "")
        pub, replay = found or (None, None)
        out.append(ReplicaSettings(name=replica_name(url), url=url, kv_events=pub, kv_events_replay=replay))
    return out


def _connects(endpoint: str, timeout: float) -> str | None:
    """None if a TCP connection to the ZMQ endpoint opens, else why not."""
    parts = urlsplit(endpoint)
    if parts.scheme != "tcp":
        return None  # ipc: nothing to dial from here
    try:
        with socket.create_connection((parts.hostname or "", parts.port or 0), timeout=timeout):
            return None
    except OSError as e:
        return e.strerror or type(e).__name__


def _cache_config(metrics: str) -> dict[str, str]:
    for family in text_string_to_metric_families(metrics):
        if family.name == "vllm:cache_config_info":
            for sample in family.samples:
                return dict(sample.labels)
    return {}


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


_ROLES = {
    "both": "both (configured): serves whole requests",
    "prefill": "prefill (configured): takes P/D prefill legs (max_tokens 1), its KV blocks pulled by a decode "
               "replica; needs vLLM's --kv-transfer-config with NixlConnector",
    "decode": "decode (configured): pulls the KV blocks of a prefill replica and streams; needs vLLM's "
              "--kv-transfer-config with NixlConnector",
}


def check_replica(r: ReplicaSettings, settings: Settings, client: httpx.Client,
                  tokenizer: Callable[[str], Any]) -> list[Check]:
    out: list[Check] = []

    def add(name: str, status: str, detail: str = "") -> None:
        out.append(Check(r.name, name, status, detail))

    headers = {"authorization": f"Bearer {r.api_key.get_secret_value()}"} if r.api_key else {}
    try:
        health = client.get(r.url + "/health", headers=headers)
    except httpx.HTTPError as e:
        add("health", "FAIL", f"{r.url} unreachable ({type(e).__name__}); the rest is skipped")
        return out
    add("health", "ok" if health.status_code == 200 else "FAIL", f"GET /health: {health.status_code}")
    served: set[str] = set()
    try:
        data = client.get(r.url + "/v1/models", headers=headers).json().get("data", [])
        served = {m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)}
    except (httpx.HTTPError, ValueError, AttributeError):
        pass
    missing = sorted(set(r.models) - served)
    if not served:
        add("models", "FAIL", "GET /v1/models lists no model")
    elif missing:
        add("models", "FAIL", f"not served: {', '.join(missing)} (served: {', '.join(sorted(served))})")
    else:
        add("models", "ok", ", ".join(sorted(served)))
    try:
        info = _cache_config(client.get(r.url + "/metrics", headers=headers).text)
    except (httpx.HTTPError, ValueError):
        info = {}
    if not info:
        add("prefix caching", "FAIL", "no vllm:cache_config_info in /metrics: is this vLLM?")
    else:
        on = info.get("enable_prefix_caching", "").lower() == "true"
        add("prefix caching", "ok" if on else "FAIL",
            "enabled" if on else "off: start vLLM with --enable-prefix-caching, or routing by prefix saves nothing")
        size = info.get("block_size")
        want = settings.routing.block_size
        if size is None:
            add("block size", "skip", "not reported")
        elif r.kv_events is None:
            add("block size", "skip", f"{size} (it matters only with kv_events: precise routing)")
        else:
            same = size == str(want)
            add("block size", "ok" if same else "FAIL", size if same else
                f"{size}, routing.block_size is {want}: set one to the other (vLLM's --block-size), "
                "or precise routing finds nothing")
    for name, endpoint in (("kv events", r.kv_events), ("kv events replay", r.kv_events_replay)):
        if endpoint is None:
            add(name, "skip", "not configured")
            continue
        why = _connects(endpoint, 3.0)
        add(name, "ok" if why is None else "FAIL", endpoint if why is None else
            f"{endpoint}: {why} (vLLM's --kv-events-config endpoint/replay_endpoint, and the network path)")
    add("role", "ok", _ROLES[r.role])
    add_seats(add, r)
    add_scheduling(add, r, sorted(served), client, headers)
    for model in sorted(m for m in settings.routing.tokenizers if m in served):
        add_tokens(add, model, client, r.url, headers, tokenizer)
    return out


def add_seats(add: Callable[..., None], r: ReplicaSettings) -> None:
    """Whether the replica's seats are told (``max_in_flight``: vLLM's --max-num-seqs, which its
    ``/metrics`` does not carry). Admission takes them as its capacity (else it learns them from
    the replica's queues), and ``ttft`` prices a wait for a sequence slot only with them: without,
    requests queued for a slot are priced as prefill, and a replica whose pool is warm for a shared
    prompt can gather a queue (docs/benchmarks/routing-ttft.md: precise mode's tail on
    conversations). Advice, not a failure: nothing is wrong until its seats run out."""
    if r.max_in_flight is not None:
        add("seats", "ok", f"max_in_flight {r.max_in_flight} (configured)")
    else:
        add("seats", "skip", "max_in_flight not configured: set it to the replica's --max-num-seqs, so that "
            "admission need not learn the seats from its queues and ttft prices the wait for one")


def add_scheduling(add: Callable[..., None], r: ReplicaSettings, served: list[str], client: httpx.Client,
                   headers: dict[str, str]) -> None:
    if r.scheduling_policy == "fcfs":
        add("scheduling", "ok", "fcfs (configured): tenants' classes order kvgate's queue only; no priority sent")
        return
    if not served:
        add("scheduling", "skip", "priority (configured): no model to probe")
        return
    try:
        resp = client.post(r.url + "/v1/completions", headers=headers, json={
            "model": served[0], "prompt": "ok", "max_tokens": 1, "priority": 1})
        status: int | None = resp.status_code
    except httpx.HTTPError:
        status = None
    if status == 200:
        add("scheduling", "ok", "priority (configured): a request with priority 1 was accepted (an fcfs vLLM "
                                "0.33 accepts it too and ignores it: its /metrics cannot tell which runs)")
    elif status == 400:
        add("scheduling", "FAIL", "priority (configured), but the replica refuses a non-zero priority: start "
                                  "vLLM with --scheduling-policy priority, or set scheduling_policy: fcfs")
    else:
        add("scheduling", "skip", f"priority (configured): the probe got {status or 'no answer'}")


def add_tokens(add: Callable[..., None], model: str, client: httpx.Client, url: str, headers: dict[str, str],
               tokenizer: Callable[[str], Any]) -> None:
    name = f"token ids {model}"
    try:
        source = tokenizer(model)
    except Exception as e:
        add(name, "FAIL", f"routing.tokenizers[{model!r}] does not load ({type(e).__name__}: {e})"[:300])
        return
    ours = source.ids("chat", {"model": model, "messages": PROBE})
    try:
        resp = client.post(url + "/tokenize", headers=headers,
                           json={"model": model, "messages": PROBE, "add_generation_prompt": True})
        theirs = resp.json().get("tokens") if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        theirs = None
    if ours is None or not isinstance(theirs, list):
        add(name, "skip", "the probe chat could not be tokenized on both sides")
    elif ours == theirs:
        add(name, "ok", f"a probe chat is {len(ours)} tokens on both sides")
    else:
        at = _first_difference(ours, theirs)
        add(name, "FAIL", f"kvgate's ids differ from the replica's /tokenize from token {at} ({len(ours)} vs "
                          f"{len(theirs)} tokens): routing.tokenizers[{model!r}] is not the served model's "
                          "tokenizer or chat template (`kvgate tokenizer MODEL DIR` fetches it)")


def check_fleet(settings: Settings, timeout_s: float = 5.0) -> list[Check]:
    from routing.tokens import HFTokenSource

    sources: dict[str, Any] = {}

    def tokenizer(model: str) -> Any:
        if model not in sources:
            sources[model] = HFTokenSource(settings.routing.tokenizers[model])
        return sources[model]

    replicas = _replicas(settings)
    if not replicas:
        return [Check("-", "replicas", "FAIL", "none configured, and routing.dns_name resolves to none")]
    try:
        with httpx.Client(timeout=timeout_s) as client:
            return [c for r in replicas for c in check_replica(r, settings, client, tokenizer)]
    finally:
        for source in sources.values():
            source.close()


def format_report(checks: list[Check]) -> str:
    lines: list[str] = []
    last = None
    for c in checks:
        if c.replica != last:
            lines.append(f"replica {c.replica}")
            last = c.replica
        lines.append(f"  {c.status:<5} {c.name}" + (f": {c.detail}" if c.detail else ""))
    failed = sum(c.status == "FAIL" for c in checks)
    lines.append(f"kvgate check: {failed} failed" if failed else "kvgate check: every check passed")
    return "\n".join(lines)
