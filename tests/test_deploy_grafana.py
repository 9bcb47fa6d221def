"""The monitoring profile: Prometheus + Grafana in docker-compose.yml, and the kvgate dashboard.

Offline, like the other deployment tests: the compose wiring, prometheus.yml, the Grafana
provisioning files and the dashboard's structure are read as files. Then a real kvgate over
vllm_sim serves a mix of traffic and every metric the dashboard's PromQL names is looked up
in its ``/metrics``, so a renamed metric or a typo in a query fails here, not on a blank panel.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gateway.app import build_app
from gateway.settings import load_settings
from tests.support.deploy_files import COMPOSE_FILE, DEPLOY, PUBLIC_PORT, ROOT
from tests.support.servers import ServerThread, free_port
from tests.support.stack import MODEL, Stack, start_stack

GRAFANA = DEPLOY / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "kvgate.json"
PROMETHEUS = DEPLOY / "prometheus" / "prometheus.yml"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"

# ------------------------------------------------------------------------------- PromQL

_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "offset",
             "bool", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (Grafana's $variables allowed)."""
    m = re.fullmatch(r"\s*label_values\(\s*([A-Za-z_:][\w:]*)\s*,\s*\w+\s*\)\s*", expr)
    if m:
        return {m.group(1)}
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # range and subquery durations
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\$\{?\w+\}?", " ", text)
    names = set()
    for m in re.finditer(r"(?<![\w:.])([A-Za-z_:][\w:]*)(\s*\()?", text):
        if m.group(2) is None and m.group(1) not in _KEYWORDS:
            names.add(m.group(1))
    return names


def test_metric_names_reads_promql() -> None:
    expr = ('histogram_quantile(0.95, sum by (le) (rate(kvgate_time_to_first_token_seconds_bucket'
            '{endpoint="chat",tenant=~"$tenant"}[$__rate_interval]))) / on (x) group_left (y) '
            'max without (replica) (kvgate_replica_up offset 5m) > bool 0.5 unless sum(foo:bar_total{a="b(c)"})')
    assert metric_names(expr) == {"kvgate_time_to_first_token_seconds_bucket", "kvgate_replica_up", "foo:bar_total"}
    assert metric_names("label_values(kvgate_requests_total, tenant)") == {"kvgate_requests_total"}
    assert metric_names('sum(rate(kvgat_requests_total{status=~"5.."}[5m]))') == {"kvgat_requests_total"}


# ---------------------------------------------------------------------------- dashboard

def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _panels() -> list[dict[str, Any]]:
    out = []
    for p in _dashboard()["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))  # collapsed rows carry theirs
    return out


def _queries() -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable."""
    out = [(p["title"], t["expr"]) for p in _panels() if p["type"] != "row" for t in p["targets"]]
    for v in _dashboard()["templating"]["list"]:
        if v["type"] == "query":
            q = v["query"]
            out.append((f"${v['name']}", q["query"] if isinstance(q, dict) else q))
    return out


def _datasource_uid() -> str:
    doc = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yaml").read_text())
    (ds,) = doc["datasources"]
    assert ds["type"] == "prometheus"
    return str(ds["uid"])


def test_dashboard_structure() -> None:
    d = _dashboard()
    assert d["uid"] and d["title"] and isinstance(d["schemaVersion"], int)
    ids = [p["id"] for p in _panels()]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells: dict[tuple[int, int], str] = {}
    for p in _panels():
        g = p["gridPos"]
        assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = p["title"]
    variables = {v["name"]: v for v in d["templating"]["list"]}
    # Every query goes through the $datasource variable, whose default is the provisioned Prometheus.
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["datasource"]["current"]["value"] == _datasource_uid()
    for p in _panels():
        if p["type"] == "row":
            continue
        assert p["targets"], p["title"]
        for t in [p, *p["targets"]]:
            assert t["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
    for where, expr in _queries():
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), (where, expr)
        assert metric_names(expr), (where, expr)
        for var in re.findall(r"\$\{?(\w+)\}?", expr):
            assert var in variables or var.startswith("__"), (where, var)


def test_dashboard_has_the_panels_an_operator_reaches_for() -> None:
    titles = " | ".join(p["title"].lower() for p in _panels() if p["type"] != "row")
    for wanted in ("fleet prefix-cache hit rate", "prefix-cache hit rate by replica", "prefix-cache hit rate by tenant",
                   "time to first token", "requests by status", "errors", "semantic cache: results",
                   "verifier rejections by reason", "prompt-hygiene warnings by kind", "routing decisions",
                   "replica load", "kv-cache usage", "replicas routed on their kv events", "token-id checks",
                   "p/d legs by role", "p/d decisions", "p/d prefill-side hit ratio"):
        assert wanted in titles, f"no panel {wanted!r}"
    ttft = next(t["expr"] for p in _panels() if p["title"] == "Time to first token" for t in p["targets"]
                if "0.95" in t["expr"])
    assert "histogram_quantile(0.95" in ttft


# ---------------------------------------------------------------------- compose wiring

def _compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def _mounts(svc: dict[str, Any]) -> dict[str, Path]:
    """Container path -> host path, for the bind mounts of a service."""
    out = {}
    for v in svc.get("volumes", []):
        src, dst = v.split(":")[:2]
        if src.startswith("."):
            out[dst] = (ROOT / src).resolve()
    return out


def test_monitoring_profile_services() -> None:
    svcs = _compose()["services"]
    for name in ("prometheus", "grafana"):
        s = svcs[name]
        assert s.get("profiles") == ["monitoring"], f"{name} runs only with --profile monitoring"
        for p in s["ports"]:
            assert str(p).startswith("127.0.0.1:"), f"{name} published beyond loopback: {p}"
    assert svcs["grafana"]["depends_on"]["prometheus"]["condition"] == "service_healthy"
    assert "/-/ready" in " ".join(svcs["prometheus"]["healthcheck"]["test"])


def test_prometheus_scrapes_kvgate_metrics() -> None:
    svcs = _compose()["services"]
    assert _mounts(svcs["prometheus"])["/etc/prometheus/prometheus.yml"] == PROMETHEUS.resolve()
    assert "--config.file=/etc/prometheus/prometheus.yml" in svcs["prometheus"]["command"]
    cfg = yaml.safe_load(PROMETHEUS.read_text())
    (job,) = [j for j in cfg["scrape_configs"] if j["job_name"] == "kvgate"]
    assert job.get("metrics_path", "/metrics") == "/metrics" and job.get("scheme", "http") == "http"
    targets = [t for sc in job["static_configs"] for t in sc["targets"]]
    assert targets
    for t in targets:
        host, port = t.rsplit(":", 1)
        assert host in svcs and "kvgate" in svcs[host]["image"], t
        # The public port (where /metrics is), never the admin one.
        assert int(port) == PUBLIC_PORT, t
    interval = cfg["global"]["scrape_interval"]
    ds = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yaml").read_text())["datasources"][0]
    assert ds["jsonData"]["timeInterval"] == interval, "Grafana's $__rate_interval must know the scrape interval"


def test_grafana_provisions_the_datasource_and_dashboard() -> None:
    svcs = _compose()["services"]
    mounts = _mounts(svcs["grafana"])
    assert mounts["/etc/grafana/provisioning"] == (GRAFANA / "provisioning").resolve()
    ds = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yaml").read_text())["datasources"][0]
    url = httpx.URL(ds["url"])
    assert url.host == "prometheus" and url.port == 9090 and "prometheus" in svcs
    assert any(str(p).endswith(":9090") for p in svcs["prometheus"]["ports"])
    provider = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "kvgate.yaml").read_text())["providers"][0]
    assert provider["type"] == "file"
    path = provider["options"]["path"]
    assert mounts[path] == DASHBOARD.parent.resolve() and DASHBOARD.exists()
    home = svcs["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{path}/{DASHBOARD.name}"


# ------------------------------------------------------------------------------- alerts

def _alerts() -> list[dict[str, Any]]:
    return [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]


def test_alert_rules_are_loaded_and_say_what_to_do() -> None:
    svcs = _compose()["services"]
    cfg = yaml.safe_load(PROMETHEUS.read_text())
    (rule_file,) = cfg["rule_files"]
    assert _mounts(svcs["prometheus"])[rule_file] == ALERTS.resolve()
    rules = _alerts()
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names)) and all(re.fullmatch(r"Kvgate[A-Z]\w+", n) for n in names), names
    for r in rules:
        assert r["labels"]["severity"] in {"critical", "warning", "info"}, r["alert"]
        assert re.fullmatch(r"\d+[smh]", str(r["for"])), r["alert"]
        assert r["annotations"]["summary"] and len(r["annotations"]["description"]) > 40, r["alert"]
        expr = r["expr"]
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), r["alert"]
        assert "$labels." not in expr, r["alert"]  # templates belong in annotations
        # A template names only labels the expression keeps: all of a series' own, or, where it
        # aggregates, those it aggregates by.
        kept = {lab.strip() for m in re.finditer(r"\b(?:sum|max|min|avg|count)\s+by\s*\(([^)]*)\)", expr)
                for lab in m.group(1).split(",")}
        used = set(re.findall(r"\$labels\.(\w+)", " ".join(r["annotations"].values())))
        assert not kept or used <= kept, (r["alert"], used, kept)
    assert {"KvgateNoReplicaAvailable", "KvgatePreciseRoutingLost", "KvgateTokenIdsDisagree"} <= set(names)


# --------------------------------------------------------- every metric named is exported

@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    s = start_stack(
        2, routing={"policy": "prefix_affinity"}, pool={"metrics_interval_s": 0.2},
        semantic_cache={"enabled": True, "embedder": "hash", "threshold": 0.3,
                        "key_prefix": f"kvgate:test:{uuid.uuid4().hex[:8]}:"},
        tenants=[{"name": "acme", "api_keys": ["sk-acme"]},
                 {"name": "tiny", "api_keys": ["sk-tiny"], "requests_per_minute": 1}])
    yield s
    s.close()


def _traffic(stack: Stack) -> None:
    acme = openai.OpenAI(base_url=stack.base_url, api_key="sk-acme", max_retries=0)
    system = {"role": "system", "content": "You answer questions about installing software. " * 10}
    for i in range(4):  # streams sharing a prefix: TTFT, cached tokens
        for _ in acme.chat.completions.create(model=MODEL, max_tokens=2, stream=True, messages=[
                system, {"role": "user", "content": f"How do I install tool number {i}?"}]):
            pass
    # A timestamp above the cache boundary: a hygiene warning.
    acme.chat.completions.create(model=MODEL, max_tokens=2, messages=[
        {"role": "system", "content": "Now is 2026-12-01T08:00:00Z. You are helpful."},
        {"role": "user", "content": "hello"}])
    # A whole answer stored (the cut-off ones above were refused), then a near trap the verifier
    # rejects (a different number).
    question = [system, {"role": "user", "content": "How do I install packages in Python 3?"}]
    acme.chat.completions.create(model=MODEL, messages=question)
    assert stack.wait_for(lambda: acme.chat.completions.with_raw_response.create(
        model=MODEL, messages=question).headers["x-kvgate-cache"] == "hit", timeout=5)
    acme.chat.completions.create(model=MODEL, messages=[
        system, {"role": "user", "content": "How do I install packages in Python 2?"}])
    # A tenant over its limit: 429.
    tiny = openai.OpenAI(base_url=stack.base_url, api_key="sk-tiny", max_retries=0)
    tiny.chat.completions.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "one"}])
    with pytest.raises(openai.RateLimitError):
        tiny.chat.completions.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "two"}])
    # Both replicas answering 503 before any byte: an upstream error on each (the request is
    # retried on the other), and a 5xx for the client.
    for name in ("r1", "r2"):
        stack.faults(name, error_rate=1.0, error_status=503)
    with pytest.raises(openai.APIStatusError) as failed:
        acme.chat.completions.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "fail"}])
    assert failed.value.status_code >= 500
    for name in ("r1", "r2"):
        stack.faults(name, error_rate=0.0)
    time.sleep(0.5)  # a pool metrics scrape: running, waiting, KV usage, prefix-cache counters


def _exposition(stack: Stack) -> tuple[set[str], set[str], dict[tuple[str, frozenset[Any]], float]]:
    """(every sample name a family of this type can have, the sample names present, their values),
    this stack's kvgate and a second one's whose replica is configured with a KV-event stream
    (to nowhere: the precise-routing families exist only where events are configured)."""
    settings = load_settings(environ={}, overrides={
        "replicas": [{"name": "r1", "url": stack.sim_url("r1"), "kv_events": f"tcp://127.0.0.1:{free_port()}"}],
        "pool": {"health_interval_s": 60, "metrics_interval_s": 60}})
    with_events = ServerThread(build_app(settings)).start()
    try:
        text = httpx.get(stack.url + "/metrics", timeout=5).text
        text += httpx.get(with_events.url + "/metrics", timeout=5).text
    finally:
        with_events.stop()
    declared, present, values = set(), set(), {}
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",),
                "summary": ("", "_count", "_sum"), "untyped": ("",)}
    for family in text_string_to_metric_families(text):
        declared.update(family.name + s for s in suffixes.get(family.type, ("",)))
        present.update(s.name for s in family.samples)
        values.update({(s.name, frozenset(s.labels.items())): s.value for s in family.samples})
    return declared, present, values


# Named by the dashboard, but only counted on events the traffic above does not cause.
_EVENTS_ONLY = {
    "kvgate_client_disconnects_total",  # a client gone mid-answer
    "kvgate_ejections_total",  # five failures in a row
    "kvgate_semantic_cache_bypasses_total",  # e.g. a request that is not cacheable
    # A P/D fleet's (replicas with role prefill or decode); tests/test_pd_gateway.py sees them counted.
    "kvgate_pd_legs_total", "kvgate_pd_decisions_total", "kvgate_pd_prefill_tokens_total",
    "kvgate_pd_transfer_tokens_total", "kvgate_pd_fallbacks_total",
}


def test_every_metric_the_dashboard_names_is_exported(stack: Stack) -> None:
    _traffic(stack)
    declared, present, values = _exposition(stack)
    named = {name: where for where, expr in _queries() for name in metric_names(expr)}
    unknown = {n: w for n, w in named.items() if n not in declared}
    assert not unknown, f"the dashboard queries metrics kvgate does not export: {unknown}"
    silent = {n: w for n, w in named.items() if n not in present and n not in _EVENTS_ONLY}
    assert not silent, f"exported, but no sample after the traffic: {silent}"
    assert _EVENTS_ONLY <= set(named), "keep _EVENTS_ONLY to names the dashboard uses"
    # The new families count what happened: one verifier rejection (a number), one 503 per replica.
    assert values[("kvgate_semantic_cache_rejections_total", frozenset({("reason", "number")}))] == 1
    for name in ("r1", "r2"):
        assert values[("kvgate_upstream_errors_total", frozenset({("replica", name), ("kind", "http_503")}))] >= 1
    assert values[("kvgate_semantic_cache_refusals_total", frozenset({("reason", "finish_reason:length")}))] >= 4


def test_every_metric_the_alerts_name_is_exported(stack: Stack) -> None:
    declared, _, _ = _exposition(stack)
    named = {name: r["alert"] for r in _alerts() for name in metric_names(r["expr"])}
    named.pop("up")  # Prometheus's own, per scrape target
    unknown = {n: a for n, a in named.items() if n not in declared}
    assert not unknown, f"the alerts query metrics kvgate does not export: {unknown}"
    assert {"kvgate_kv_events_precise", "kvgate_kv_events_token_checks_total"} <= set(named)


def test_readmes_explain_the_monitoring_profile() -> None:
    for path in (DEPLOY / "README.md", ROOT / "README.md"):
        text = path.read_text()
        for needle in ("--profile monitoring", "deploy/grafana/", "127.0.0.1:3000"):
            assert needle in text, f"{path.relative_to(ROOT)} does not mention {needle}"
