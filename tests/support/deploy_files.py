"""Shared paths, constants and readers for the deployment tests (tests/test_deploy_*.py)."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from typing import Any

import yaml
from kubernetes_validate import utils as kv

from gateway.settings import Settings, load_settings

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
CONFIGS = DEPLOY / "config"
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"

PUBLIC_PORT = 8080
ADMIN_PORT = 8081
ENTRYPOINT = ["kvgate", "serve", "--config", "/etc/kvgate/kvgate.yaml"]
# Kubernetes versions the manifests must be valid for: native sidecars need 1.29.
K8S_VERSIONS = ("1.29.0", kv.latest_version())
VLLM_FLAGS = ("--enable-prefix-caching", "--enable-prompt-tokens-details", "--kv-events-config")
PLACEHOLDER = "REPLACE_ME"
SECRETISH = re.compile(r"TOKEN|SECRET|PASSWORD|API_KEY|APIKEY|TENANTS|REDIS_URL", re.I)
# Shapes of real credentials that must never be committed.
REAL_LOOKING = [
    re.compile(r"sk-(?:proj-|kvg-)?[A-Za-z0-9_-]{24,}"),
    re.compile(r"hf_[A-Za-z0-9]{30,}"),
    re.compile(r"AKIA[0-9A-Z]{16}"),
    re.compile(r"gh[pousr]_[A-Za-z0-9]{30,}"),
    re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
    re.compile(r"eyJ[A-Za-z0-9_-]{20,}\.[A-Za-z0-9_-]{20,}"),  # a JWT
]


# ------------------------------------------------------------------------------- helpers

def _load_yaml_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _manifest_files() -> list[Path]:
    return sorted(p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml")


def _manifests() -> list[tuple[Path, int, dict[str, Any]]]:
    return [(p, i, d) for p in _manifest_files() for i, d in enumerate(_load_yaml_docs(p))]


def _mid(item: tuple[Path, int, dict[str, Any]]) -> str:
    path, i, doc = item
    return f"{path.relative_to(K8S)}#{i}:{doc.get('kind')}"


def _of_kind(*kinds: str) -> list[tuple[Path, dict[str, Any]]]:
    return [(p, d) for p, _, d in _manifests() if d.get("kind") in kinds]


def _pod_spec(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["spec"]["template"]["spec"]


def _containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return list(pod.get("initContainers", [])) + list(pod.get("containers", []))


def _is_kvgate_image(container: dict[str, Any]) -> bool:
    return "/kvgate:" in container["image"] or container["image"].startswith("kvgate:")


def _is_kvgate(container: dict[str, Any]) -> bool:
    """A container that runs the gateway: kvgate's image with its own entrypoint (``kvgate serve``).
    The same image with another command (the tokenizer init step) is not one."""
    command = container.get("command")
    return _is_kvgate_image(container) and (not command or command[:2] == ["kvgate", "serve"])


def _kvgate_workloads() -> list[tuple[Path, dict[str, Any], dict[str, Any]]]:
    """(file, workload, kvgate container) for every workload that runs kvgate."""
    out = []
    for path, doc in _of_kind("Deployment", "StatefulSet", "DaemonSet"):
        for c in _containers(_pod_spec(doc)):
            if _is_kvgate(c):
                out.append((path, doc, c))
    return out


def _secrets() -> dict[str, dict[str, str]]:
    """Every Secret under deploy/k8s (templates included), decoded, by name."""
    out: dict[str, dict[str, str]] = {}
    for _, doc in _of_kind("Secret"):
        values = dict(doc.get("stringData") or {})
        for k, v in (doc.get("data") or {}).items():
            values[k] = base64.b64decode(v).decode()
        out[doc["metadata"]["name"]] = values
    return out


def _configmaps() -> dict[str, dict[str, str]]:
    return {d["metadata"]["name"]: d.get("data") or {} for _, d in _of_kind("ConfigMap")}


def _container_env(container: dict[str, Any]) -> dict[str, str]:
    """The container's environment, with Secret and ConfigMap references resolved."""
    secrets, cms = _secrets(), _configmaps()
    env: dict[str, str] = {}
    for ref in container.get("envFrom", []):
        if "secretRef" in ref:
            env.update(secrets[ref["secretRef"]["name"]])
        if "configMapRef" in ref:
            env.update(cms[ref["configMapRef"]["name"]])
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = str(e["value"])
            continue
        src = e["valueFrom"]
        if "secretKeyRef" in src:
            ref, store = src["secretKeyRef"], secrets
        elif "configMapKeyRef" in src:
            ref, store = src["configMapKeyRef"], cms
        else:
            continue
        if ref["name"] not in store and ref.get("optional"):
            continue
        env[e["name"]] = store[ref["name"]][ref["key"]]
    return env


def _mounted_kvgate_config(pod: dict[str, Any], container: dict[str, Any]) -> str:
    """The text of the kvgate.yaml that ``container`` sees at /etc/kvgate/kvgate.yaml."""
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    for m in container.get("volumeMounts", []):
        if m["mountPath"] == "/etc/kvgate":
            cm = volumes[m["name"]]["configMap"]
            key = next((i["key"] for i in cm.get("items", []) if i["path"] == "kvgate.yaml"), "kvgate.yaml")
            return _configmaps()[cm["name"]][key]
        if m["mountPath"] == "/etc/kvgate/kvgate.yaml":
            cm = volumes[m["name"]]["configMap"]
            return _configmaps()[cm["name"]][m.get("subPath", "kvgate.yaml")]
    raise AssertionError(f"{container['name']}: no ConfigMap mounted at /etc/kvgate")


def _load_config_text(text: str, tmp_path: Path, environ: dict[str, str] | None = None) -> Settings:
    p = tmp_path / "kvgate.yaml"
    p.write_text(text)
    return load_settings(p, environ=environ or {})


def _port_number(container: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    for p in container.get("ports", []):
        if p.get("name") == port:
            return int(p["containerPort"])
    raise AssertionError(f"{container['name']}: no port named {port!r}")


def _prestop_sleep_s(container: dict[str, Any]) -> float:
    pre = container.get("lifecycle", {}).get("preStop", {})
    if "sleep" in pre:
        return float(pre["sleep"]["seconds"])
    cmd = pre.get("exec", {}).get("command", [])
    if cmd and cmd[0].rsplit("/", 1)[-1] == "sleep":
        return float(cmd[1])
    return 0.0


def _drain_budget_s(s: Settings) -> float:
    # shutdown_delay_s: serve on after SIGTERM while load balancers notice (if this build has it).
    return float(getattr(s, "shutdown_delay_s", 0.0)) + s.shutdown_grace_s


def _labels_match(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _kv_events_config(args: list[str]) -> dict[str, Any]:
    for i, a in enumerate(args):
        if a == "--kv-events-config":
            return json.loads(args[i + 1])
        if a.startswith("--kv-events-config="):
            return json.loads(a.split("=", 1)[1])
    raise AssertionError("no --kv-events-config")
