"""Deployment artefacts: Dockerfile, .dockerignore, docker-compose.yml, deploy/config, deploy/k8s.

Everything here runs offline in a few seconds, with no container engine and no cluster:
  * Kubernetes manifests against the OpenAPI schemas bundled in ``kubernetes-validate``
    (strict variant: an unknown or misspelt field fails), for the oldest Kubernetes the
    manifests target (1.29: native sidecars) and the newest the package knows;
  * docker-compose.yml against the compose-spec JSON schema that ``check-jsonschema``
    vendors, after Compose-style ``${VAR:-default}`` interpolation;
  * the Dockerfile through BuildKit's own parser (the ``dockerfile`` package);
  * every kvgate configuration (deploy/config/*.yaml, each ConfigMap's kvgate.yaml, with and
    without the environment the manifests give it) through ``gateway.settings.load_settings``.
If ``kubectl`` is on PATH, each kustomization is also rendered and validated.
"""

from __future__ import annotations

import base64
import copy
import importlib.resources
import json
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import dockerfile
import jsonschema
import pytest
import yaml
from kubernetes_validate import utils as kv

from gateway.settings import Settings, load_settings

ROOT = Path(__file__).resolve().parents[1]
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


def _is_kvgate(container: dict[str, Any]) -> bool:
    return "/kvgate:" in container["image"] or container["image"].startswith("kvgate:")


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


# --------------------------------------------------------------------- Kubernetes: schemas

@pytest.mark.parametrize("item", _manifests(), ids=_mid)
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_k8s_manifest_matches_openapi_schema(item: tuple[Path, int, dict[str, Any]], version: str) -> None:
    path, _, doc = item
    try:
        kv.validate(doc, version, strict=True)
    except kv.ValidationError as e:
        where = ".".join(str(p) for p in e.path)
        pytest.fail(f"{path.relative_to(ROOT)}: {doc['kind']} invalid for Kubernetes {version} at {where}: {e.message}")


def test_k8s_schema_validation_is_not_vacuous() -> None:
    """A typo and a wrong type must fail, or the test above proves nothing."""
    _, doc = next((p, d) for p, d in _of_kind("Deployment"))
    typo = copy.deepcopy(doc)
    _pod_spec(typo)["containers"][0]["readinessProbe"] = {"httpGet": {"paht": "/readyz", "port": 8080}}
    wrong_type = copy.deepcopy(doc)
    wrong_type["spec"]["replicas"] = "three"
    for bad in (typo, wrong_type):
        with pytest.raises(kv.ValidationError):
            kv.validate(bad, K8S_VERSIONS[-1], strict=True)


def test_k8s_every_manifest_has_kind_and_name() -> None:
    assert _manifests(), "no manifests found under deploy/k8s"
    for path, _, doc in _manifests():
        assert doc.get("apiVersion") and doc.get("kind"), path
        assert doc.get("metadata", {}).get("name"), path


# ------------------------------------------------------------------ Kubernetes: kustomize

def _kustomizations() -> list[Path]:
    return sorted(K8S.rglob("kustomization.yaml"))


@pytest.mark.parametrize("kfile", _kustomizations(), ids=lambda p: str(p.relative_to(K8S)))
def test_kustomization_lists_existing_resources_and_no_example_secrets(kfile: Path) -> None:
    k = yaml.safe_load(kfile.read_text())
    assert k["kind"] == "Kustomization"
    for res in k.get("resources", []):
        target = kfile.parent / res
        assert target.exists(), f"{kfile.relative_to(ROOT)}: {res} does not exist"
        if target.is_dir():
            assert (target / "kustomization.yaml").exists(), f"{res}: a directory without kustomization.yaml"
        else:
            assert ".example." not in target.name, "placeholder Secrets must never be applied by -k"


def test_every_manifest_is_in_a_kustomization_or_an_example() -> None:
    listed = {(k.parent / r).resolve() for k in _kustomizations()
              for r in yaml.safe_load(k.read_text()).get("resources", [])}
    for path in _manifest_files():
        assert ".example." in path.name or path.resolve() in listed, f"{path.relative_to(ROOT)} is in no kustomization"


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed (optional check)")
@pytest.mark.parametrize("kfile", _kustomizations(), ids=lambda p: str(p.relative_to(K8S)))
def test_kustomize_renders_valid_manifests(kfile: Path) -> None:
    out = subprocess.run(["kubectl", "kustomize", str(kfile.parent)], check=False, capture_output=True,
                         text=True, timeout=60, env={**os.environ, "KUBECONFIG": os.devnull})
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert docs
    for doc in docs:
        kv.validate(doc, K8S_VERSIONS[-1], strict=True)


# --------------------------------------------------------- kvgate configuration everywhere

def _config_sources() -> list[tuple[str, str]]:
    out = [(str(p.relative_to(ROOT)), p.read_text()) for p in sorted(CONFIGS.glob("*.yaml"))]
    for path, doc in _of_kind("ConfigMap"):
        for key, text in (doc.get("data") or {}).items():
            if key.endswith((".yaml", ".yml")):
                out.append((f"{path.relative_to(ROOT)}:{key}", text))
    return out


def test_config_sources_found() -> None:
    names = [n for n, _ in _config_sources()]
    assert any("image.yaml" in n for n in names)
    assert any("compose.yaml" in n for n in names) and any("compose-gpu.yaml" in n for n in names)
    assert sum(":kvgate.yaml" in n for n in names) >= 2, names  # shared + sidecar ConfigMaps


@pytest.mark.parametrize("name,text", _config_sources(), ids=[n for n, _ in _config_sources()])
def test_embedded_kvgate_config_loads(name: str, text: str, tmp_path: Path) -> None:
    s = _load_config_text(text, tmp_path)
    # In a container the public listener must be reachable from outside the loopback.
    assert s.listen.host == "0.0.0.0" and s.listen.port == PUBLIC_PORT, name
    assert s.admin.port == ADMIN_PORT, name


@pytest.mark.parametrize("name,text", _config_sources(), ids=[n for n, _ in _config_sources()])
def test_embedded_config_holds_no_real_secret(name: str, text: str) -> None:
    data = yaml.safe_load(text) or {}
    if ":" in name:  # a ConfigMap: secrets belong in a Secret, not here
        assert "token" not in (data.get("admin") or {}), name
        assert "server_secret" not in data, name
        assert not any(t.get("api_keys") for t in data.get("tenants") or []), name
        assert not any(r.get("api_key") for r in data.get("replicas") or []), name
    redis_url = data.get("redis_url")
    if redis_url:
        assert urlsplit(redis_url).password is None, f"{name}: password inline in redis_url"
    for t in data.get("tenants") or []:
        for k in t.get("api_keys") or []:
            assert "change-me" in k.lower() or PLACEHOLDER in k, f"{name}: tenant {t['name']} has a real-looking key"
    for pat in REAL_LOOKING:
        assert not pat.search(text), f"{name}: matches {pat.pattern}"


@pytest.mark.parametrize("item", _kvgate_workloads(), ids=lambda t: f"{t[0].relative_to(K8S)}:{t[2]['name']}")
def test_k8s_kvgate_config_with_its_environment(item: tuple[Path, dict[str, Any], dict[str, Any]],
                                                tmp_path: Path) -> None:
    """The ConfigMap plus the KVGATE_* variables from the Secrets: what the pod really loads."""
    path, doc, c = item
    pod = _pod_spec(doc)
    env = _container_env(c)
    kvgate_env = {k: v for k, v in env.items() if k.startswith("KVGATE_")}
    assert {"KVGATE_ADMIN__TOKEN", "KVGATE_SERVER_SECRET"} <= set(kvgate_env), path
    s = _load_config_text(_mounted_kvgate_config(pod, c), tmp_path, kvgate_env)
    assert s.admin.host == "127.0.0.1", "admin must stay on the pod's loopback"
    assert s.admin.token is not None
    dev_secret = Settings.model_fields["server_secret"].default.get_secret_value()
    assert s.server_secret.get_secret_value() != dev_secret, "server_secret must come from a Secret"
    declared = [int(p["containerPort"]) for p in c.get("ports", [])]
    assert declared == [s.listen.port], f"{path}: declare exactly the public port, not the admin one"
    keys = [k.get_secret_value() for t in s.tenants for k in t.api_keys]
    assert keys, f"{path}: no tenant keys: the gateway would run in open mode"
    from policies.keys import is_well_formed  # the rule kvgate applies to config keys at start-up

    assert all(is_well_formed(k) for k in keys)
    # The application container's key (sidecar variant) must be one kvgate accepts.
    for other in _containers(pod):
        if other is not c and "OPENAI_API_KEY" in _container_env(other):
            assert _container_env(other)["OPENAI_API_KEY"] in keys
            assert _container_env(other)["OPENAI_BASE_URL"] == f"http://localhost:{s.listen.port}/v1"


# ------------------------------------------------------------ Kubernetes: kvgate pod shape

@pytest.mark.parametrize("item", _kvgate_workloads(), ids=lambda t: f"{t[0].relative_to(K8S)}:{t[2]['name']}")
def test_kvgate_probes(item: tuple[Path, dict[str, Any], dict[str, Any]]) -> None:
    _, _, c = item
    expected = {"livenessProbe": "/healthz", "readinessProbe": "/readyz", "startupProbe": "/healthz"}
    for probe, path in expected.items():
        assert probe in c, f"{c['name']}: no {probe}"
        get = c[probe]["httpGet"]
        assert get["path"] == path, f"{probe} must use {path}"
        assert _port_number(c, get["port"]) == PUBLIC_PORT, f"{probe} must hit the public port"


@pytest.mark.parametrize("item", _kvgate_workloads(), ids=lambda t: f"{t[0].relative_to(K8S)}:{t[2]['name']}")
def test_kvgate_security_and_resources(item: tuple[Path, dict[str, Any], dict[str, Any]]) -> None:
    path, doc, c = item
    pod = _pod_spec(doc)
    psc, sc = pod.get("securityContext", {}), c.get("securityContext", {})
    assert sc.get("runAsNonRoot", psc.get("runAsNonRoot")) is True
    assert sc.get("runAsUser", psc.get("runAsUser", 10001)) != 0
    assert sc.get("readOnlyRootFilesystem") is True
    assert sc.get("allowPrivilegeEscalation") is False
    assert "ALL" in sc.get("capabilities", {}).get("drop", [])
    assert (psc.get("seccompProfile") or sc.get("seccompProfile") or {}).get("type") == "RuntimeDefault"
    assert pod.get("automountServiceAccountToken") is False, "kvgate never talks to the Kubernetes API"
    res = c.get("resources", {})
    assert {"cpu", "memory"} <= set(res.get("requests", {})), path
    assert "memory" in res.get("limits", {}), path
    # HF_HOME is /tmp/...: with a read-only root filesystem /tmp must be a writable volume.
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    tmp = [m for m in c.get("volumeMounts", []) if m["mountPath"] == "/tmp"]
    assert tmp and "emptyDir" in volumes[tmp[0]["name"]], f"{path}: no emptyDir at /tmp"


def test_admin_port_is_never_exposed_by_a_service() -> None:
    workloads = _of_kind("Deployment", "StatefulSet", "DaemonSet")
    services = _of_kind("Service")
    assert services
    for path, svc in services:
        for port in svc["spec"].get("ports", []):
            assert port["port"] != ADMIN_PORT, f"{path}: Service port {ADMIN_PORT}"
            target = port.get("targetPort", port["port"])
            for _, w in workloads:
                pod_labels = w["spec"]["template"]["metadata"]["labels"]
                if not _labels_match(svc["spec"].get("selector", {}), pod_labels):
                    continue
                for c in _containers(_pod_spec(w)):
                    if not _is_kvgate(c):
                        continue
                    if isinstance(target, str) and not any(p.get("name") == target for p in c.get("ports", [])):
                        continue
                    assert _port_number(c, target) == PUBLIC_PORT, f"{path}: exposes kvgate port {target}"
    for path, svc in services:
        assert svc["spec"].get("type", "ClusterIP") in ("ClusterIP",), f"{path}: exposed outside the cluster"


def test_k8s_secrets_are_placeholders_only() -> None:
    secrets = _of_kind("Secret")
    assert secrets
    for path, _ in secrets:
        assert ".example." in path.name, f"{path}: a Secret outside a *.example.yaml template"
    for name, values in _secrets().items():
        for key, value in values.items():
            assert PLACEHOLDER in value, f"Secret {name}.{key} must hold a {PLACEHOLDER} placeholder"


def test_k8s_secret_like_env_comes_from_secrets() -> None:
    for path, doc in _of_kind("Deployment", "StatefulSet", "DaemonSet"):
        for c in _containers(_pod_spec(doc)):
            for e in c.get("env", []):
                if SECRETISH.search(e["name"]):
                    assert "secretKeyRef" in e.get("valueFrom", {}), f"{path}: {c['name']}.{e['name']} inline"


def test_no_real_looking_credentials_anywhere_in_deploy() -> None:
    files = [COMPOSE_FILE, DOCKERFILE, ROOT / ".dockerignore", *sorted(DEPLOY.rglob("*"))]
    for f in files:
        if f.is_file() and f.suffix in ("", ".yaml", ".yml", ".md", ".env", ".json"):
            text = f.read_text()
            for pat in REAL_LOOKING:
                assert not pat.search(text), f"{f.relative_to(ROOT)}: matches {pat.pattern}"


# ------------------------------------------------------------- Kubernetes: shared gateway

def _one(kind: str, under: str) -> tuple[Path, dict[str, Any]]:
    found = [(p, d) for p, d in _of_kind(kind) if p.parent.name == under]
    assert len(found) == 1, f"expected one {kind} in deploy/k8s/{under}, found {len(found)}"
    return found[0]


def _kvgate_of(doc: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in _containers(_pod_spec(doc)) if _is_kvgate(c))


def _settings_of(doc: dict[str, Any], tmp_path: Path) -> Settings:
    c = _kvgate_of(doc)
    env = {k: v for k, v in _container_env(c).items() if k.startswith("KVGATE_")}
    return _load_config_text(_mounted_kvgate_config(_pod_spec(doc), c), tmp_path, env)


def test_shared_deployment_scaling_and_disruption(tmp_path: Path) -> None:
    _, dep = _one("Deployment", "shared")
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["replicas"] == 3
    _, svc = _one("Service", "shared")
    assert _labels_match(svc["spec"]["selector"], labels)
    _, hpa = _one("HorizontalPodAutoscaler", "shared")
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["kind"], ref["name"]) == ("Deployment", dep["metadata"]["name"])
    assert hpa["spec"]["minReplicas"] >= 3 and hpa["spec"]["maxReplicas"] > hpa["spec"]["minReplicas"]
    assert any(m["type"] == "Resource" and m["resource"]["name"] == "cpu" for m in hpa["spec"]["metrics"])
    _, pdb = _one("PodDisruptionBudget", "shared")
    assert _labels_match(pdb["spec"]["selector"]["matchLabels"], labels)
    assert "maxUnavailable" in pdb["spec"] or pdb["spec"]["minAvailable"] < dep["spec"]["replicas"]


def test_shared_deployment_drains_before_it_is_killed(tmp_path: Path) -> None:
    _, dep = _one("Deployment", "shared")
    c = _kvgate_of(dep)
    s = _settings_of(dep, tmp_path)
    sleep = _prestop_sleep_s(c)
    assert sleep > 0, "a preStop sleep lets endpoint removal propagate before SIGTERM"
    grace = _pod_spec(dep)["terminationGracePeriodSeconds"]
    assert grace > sleep + _drain_budget_s(s), "SIGKILL would cut streams kvgate may still finish"
    assert grace > s.shutdown_grace_s


def test_shared_redis_url_comes_from_a_secret(tmp_path: Path) -> None:
    _, dep = _one("Deployment", "shared")
    env = {e["name"]: e for e in _kvgate_of(dep).get("env", [])}
    assert "secretKeyRef" in env["KVGATE_REDIS_URL"]["valueFrom"]
    s = _settings_of(dep, tmp_path)
    assert s.redis_url is not None and s.redis_url.get_secret_value().startswith(("redis://", "rediss://"))
    assert s.semantic_cache.enabled


@pytest.mark.parametrize("variant", ["shared", "sidecar"])
def test_replicas_discovered_through_the_vllm_headless_service(variant: str, tmp_path: Path) -> None:
    _, dep = _one("Deployment", variant)
    s = _settings_of(dep, tmp_path)
    assert s.routing.dns_name, f"{variant}: no routing.dns_name"
    host, _, port = s.routing.dns_name.rpartition(":")
    _, headless = _one("Service", "vllm")
    assert headless["spec"]["clusterIP"] == "None"
    name, ns = headless["metadata"]["name"], headless["metadata"]["namespace"]
    assert host == f"{name}.{ns}.svc.cluster.local"
    assert int(port) in [p["port"] for p in headless["spec"]["ports"]]
    # kustomize must not move the headless Service to another namespace than the DNS name says.
    kust = yaml.safe_load((K8S / "vllm" / "kustomization.yaml").read_text())
    assert kust.get("namespace", ns) == ns


def test_sidecar_is_a_native_sidecar_beside_the_application() -> None:
    _, dep = _one("Deployment", "sidecar")
    pod = _pod_spec(dep)
    side = [c for c in pod.get("initContainers", []) if _is_kvgate(c)]
    assert side and side[0].get("restartPolicy") == "Always"
    apps = [c for c in pod["containers"] if not _is_kvgate(c)]
    assert apps, "the sidecar example needs an application container"


def test_vllm_clients_are_admitted_by_the_vllm_network_policy() -> None:
    _, pol = _one("NetworkPolicy", "vllm")
    peers = [p["podSelector"]["matchLabels"] for rule in pol["spec"]["ingress"] for p in rule["from"]]
    for variant in ("shared", "sidecar"):
        _, dep = _one("Deployment", variant)
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert any(_labels_match(sel, labels) for sel in peers), f"{variant} pods could not reach vLLM"


# ----------------------------------------------------------------------- Kubernetes: vLLM

def _kv_events_config(args: list[str]) -> dict[str, Any]:
    for i, a in enumerate(args):
        if a == "--kv-events-config":
            return json.loads(args[i + 1])
        if a.startswith("--kv-events-config="):
            return json.loads(a.split("=", 1)[1])
    raise AssertionError("no --kv-events-config")


def test_vllm_statefulset_flags_gpu_and_headless_service() -> None:
    _, sts = _one("StatefulSet", "vllm")
    _, headless = _one("Service", "vllm")
    assert sts["spec"]["serviceName"] == headless["metadata"]["name"]
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert _labels_match(headless["spec"]["selector"], labels)
    c = _pod_spec(sts)["containers"][0]
    args = [*c.get("command", []), *c.get("args", [])]
    for flag in VLLM_FLAGS:
        assert any(a == flag or a.startswith(flag + "=") for a in args), flag
    ev = _kv_events_config(args)
    assert ev == {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557"}
    assert c["resources"]["limits"]["nvidia.com/gpu"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["http"] == 8000 and ports["kv-events"] == 5557
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"]["path"] == "/health"
    env = {e["name"]: e for e in c["env"]}
    assert "$(VLLM_MODEL)" in args and env["VLLM_MODEL"]["value"]


# ------------------------------------------------------------------------ docker-compose

_INTERP = re.compile(r"\$(?:(\$)|\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?+])([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")


def _interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's variable substitution, with ``env`` as the shell environment."""
    if isinstance(value, dict):
        return {k: _interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match[str]) -> str:
        if m.group(1):
            return "$"
        name = m.group(2) or m.group(5)
        op, arg = m.group(3), m.group(4) or ""
        cur = env.get(name)
        if op == ":-":
            return cur if cur else arg
        if op == "-":
            return cur if cur is not None else arg
        if op in (":?", "?"):
            if not cur:
                raise AssertionError(f"${name} is required: {arg}")
        if op == ":+":
            return arg if cur else ""
        if op == "+":
            return arg if cur is not None else ""
        return cur or ""

    return _INTERP.sub(sub, value)


def _compose_raw() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def _compose() -> dict[str, Any]:
    return _interpolate(_compose_raw(), {})


def _compose_schema() -> dict[str, Any]:
    ref = importlib.resources.files("check_jsonschema.builtin_schemas.vendor").joinpath("compose-spec.json")
    return json.loads(ref.read_text())


def test_compose_matches_compose_spec_schema() -> None:
    validator = jsonschema.Draft202012Validator(_compose_schema())
    errors = sorted(validator.iter_errors(_compose()), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors)


def test_compose_schema_validation_is_not_vacuous() -> None:
    validator = jsonschema.Draft202012Validator(_compose_schema())
    bad = _compose()
    bad["services"]["kvgate"]["depends_on"]["redis"]["condition"] = "service_happy"
    bad["services"]["redis"]["helthcheck"] = {}
    assert len(list(validator.iter_errors(bad))) >= 2


def _services() -> dict[str, dict[str, Any]]:
    return _compose()["services"]


def _gateway_services() -> list[str]:
    return [n for n, s in _services().items() if s.get("entrypoint") is None and "kvgate" in s.get("image", "")]


def _mounted_compose_config(svc: dict[str, Any]) -> Path:
    for v in svc.get("volumes", []):
        src, dst = v.split(":")[:2]
        if dst == "/etc/kvgate/kvgate.yaml":
            return (ROOT / src).resolve()
    raise AssertionError("no config mounted at /etc/kvgate/kvgate.yaml")


def test_compose_services_and_profiles() -> None:
    svcs = _services()
    assert {"redis", "sim-1", "sim-2", "sim-3", "kvgate"} <= set(svcs)
    assert sorted(_gateway_services()) == ["kvgate", "kvgate-gpu"]
    default = {n for n, s in svcs.items() if not s.get("profiles")}
    gpu = {n for n, s in svcs.items() if "gpu" in (s.get("profiles") or [])}
    assert {"redis", "sim-1", "sim-2", "sim-3", "kvgate"} <= default
    assert "kvgate-gpu" in gpu and sum(s.startswith("vllm") for s in gpu) >= 2
    # Every service of the kvgate image can build it (Compose would otherwise try to pull it).
    for name, s in svcs.items():
        if "kvgate" in s.get("image", ""):
            assert s.get("build"), f"{name}: uses the kvgate image without a build section"


def test_compose_depends_on_healthchecked_services() -> None:
    svcs = _services()
    for name, s in svcs.items():
        deps = s.get("depends_on") or {}
        assert isinstance(deps, dict), f"{name}: use the long depends_on form with conditions"
        for dep, cond in deps.items():
            assert dep in svcs, f"{name} depends on unknown {dep}"
            assert cond["condition"] == "service_healthy", f"{name} -> {dep}"
            assert svcs[dep].get("healthcheck", {}).get("test"), f"{dep} has no healthcheck"
            # A default-profile service must not depend on a profiled one.
            if not s.get("profiles"):
                assert not svcs[dep].get("profiles"), f"{name} depends on profiled {dep}"


def test_compose_redis_without_persistence() -> None:
    r = _services()["redis"]
    assert r["image"].split(":")[1].startswith("7")
    cmd = r["command"]
    assert cmd[cmd.index("--save") + 1] == "" and cmd[cmd.index("--appendonly") + 1] == "no"


@pytest.mark.parametrize("n", [1, 2, 3])
def test_compose_sim_replicas(n: int) -> None:
    s = _services()[f"sim-{n}"]
    assert s["entrypoint"] == ["python", "-m", "vllm_sim"]
    cmd = s["command"]
    opts = dict(zip(cmd[::2], cmd[1::2]))
    assert opts["--host"] == "0.0.0.0" and opts["--port"] == "8000" and opts["--name"] == f"sim-{n}"
    assert "8000/health" in " ".join(s["healthcheck"]["test"])
    assert not s.get("ports"), "replicas are reached only through kvgate"


def test_compose_gpu_replicas() -> None:
    svcs = _services()
    gpus = []
    for name, s in svcs.items():
        if not name.startswith("vllm"):
            continue
        assert s["image"].startswith("vllm/vllm-openai:")
        args = [*s.get("entrypoint", []), *s["command"]]
        for flag in VLLM_FLAGS:
            assert flag in args, f"{name}: {flag}"
        assert _kv_events_config(args)["enable_kv_cache_events"] is True
        devices = s["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
        gpus.append(tuple(devices[0].get("device_ids") or ()))
        assert not s.get("ports"), "replicas are reached only through kvgate"
    assert len(set(gpus)) == len(gpus), "two vLLM replicas would share one GPU"
    # The model comes from the environment.
    raw = _compose_raw()["services"]["vllm-1"]["command"]
    assert any("${VLLM_MODEL" in a for a in raw)


@pytest.mark.parametrize("name", ["kvgate", "kvgate-gpu"])
def test_compose_gateway_config_and_ports(name: str, tmp_path: Path) -> None:
    svcs = _services()
    s = svcs[name]
    cfg = _mounted_compose_config(s)
    assert cfg.is_relative_to(CONFIGS) and cfg.exists()
    env = {k: str(v) for k, v in (s.get("environment") or {}).items()}
    settings = load_settings(cfg, environ=env)
    # Replicas are compose services of the same profile set, on their container port.
    for r in settings.replicas:
        u = urlsplit(r.url)
        assert u.hostname in svcs and u.port == 8000, r.url
        assert set(svcs[u.hostname].get("profiles") or []) <= set(s.get("profiles") or []), r.url
        assert u.hostname in s["depends_on"], f"{name} should wait for {u.hostname}"
    assert settings.redis_url is not None
    assert urlsplit(settings.redis_url.get_secret_value()).hostname == "redis"
    # Admin: published on the host's loopback only, and bound inside the container to all
    # interfaces (or the mapping could not reach it).
    admin_maps = [p for p in s["ports"] if str(p).split(":")[-1] == str(settings.admin.port)]
    assert admin_maps, f"{name}: admin port not published"
    for p in admin_maps:
        assert str(p).startswith("127.0.0.1:"), f"{name}: admin published beyond loopback: {p}"
    assert settings.admin.host == "0.0.0.0"
    assert any(str(p).split(":")[-1] == str(settings.listen.port) for p in s["ports"])
    # Stops gracefully before Docker's SIGKILL.
    grace = s["stop_grace_period"]
    assert grace.endswith("s") and float(grace[:-1]) > _drain_budget_s(settings)


def test_compose_secrets_are_interpolated_placeholders() -> None:
    raw = _compose_raw()["services"]
    for name, s in raw.items():
        for k, v in (s.get("environment") or {}).items():
            if SECRETISH.search(k) or k.startswith("KVGATE_"):
                v = str(v)
                assert v.startswith("${"), f"{name}.{k}: set from the shell or .env, not inline"
                default = _interpolate(v, {})
                assert default == "" or "change-me" in default, f"{name}.{k}: default {default!r}"


# ----------------------------------------------------------------------------- Dockerfile

def _df() -> tuple[dockerfile.Command, ...]:
    return dockerfile.parse_file(str(DOCKERFILE))


def _stages() -> list[list[dockerfile.Command]]:
    stages: list[list[dockerfile.Command]] = []
    for c in _df():
        if c.cmd.upper() == "FROM":
            stages.append([])
        if stages:
            stages[-1].append(c)
    return stages


def _global_args() -> dict[str, str]:
    out = {}
    for c in _df():
        if c.cmd.upper() == "FROM":
            break
        if c.cmd.upper() == "ARG":
            k, _, v = c.value[0].partition("=")
            out[k] = v
    return out


def _stage_args(stage: list[dockerfile.Command]) -> dict[str, str]:
    return dict(c.value[0].partition("=")[::2] for c in stage if c.cmd.upper() == "ARG")


def _resolve(text: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", lambda m: args.get(m.group(1), m.group(0)), text)


def test_dockerfile_multistage_on_python_311_slim() -> None:
    stages = _stages()
    assert len(stages) >= 2, "build tools stay in a build stage"
    args = _global_args()
    for st in stages:
        assert _resolve(st[0].value[0], args) == "python:3.11-slim"


def test_dockerfile_final_stage() -> None:
    final = _stages()[-1]
    by: dict[str, list[dockerfile.Command]] = {}
    for c in final:
        by.setdefault(c.cmd.upper(), []).append(c)
    user = by["USER"][-1].value[0].split(":")[0]
    assert user.isdigit() and int(user) != 0, "a numeric non-root USER (runAsNonRoot can verify it)"
    exposed = {p.split("/")[0] for c in by["EXPOSE"] for p in c.value}
    assert {str(PUBLIC_PORT), str(ADMIN_PORT)} <= exposed
    hc = by["HEALTHCHECK"][-1]
    assert hc.value[0] == "CMD" and "/healthz" in " ".join(hc.value) and f":{PUBLIC_PORT}/" in " ".join(hc.value)
    ep = by["ENTRYPOINT"][-1]
    assert ep.json and list(ep.value) == ENTRYPOINT, "exec form, so kvgate gets SIGTERM as PID 1"
    env = {}
    for c in by["ENV"]:
        env.update(dict(zip(c.value[::2], c.value[1::2])))
    assert env.get("HF_HUB_OFFLINE") == "1"
    assert env.get("HF_HOME", "").startswith("/tmp/"), "the only writable path under a read-only root"
    # Any KVGATE_* variable is read as a setting; a stray one would stop start-up.
    load_settings(None, environ={k: v for k, v in env.items() if k.startswith("KVGATE_")})
    copies = [c for c in final if c.cmd.upper() == "COPY" and not c.flags]
    assert any(c.value[-1] == "/etc/kvgate/kvgate.yaml" and c.value[0] == "deploy/config/image.yaml" for c in copies)


def test_dockerfile_installs_cpu_torch_first_then_the_project() -> None:
    build = _stages()[0]
    runs = [" ".join(c.value) for c in build if c.cmd.upper() == "RUN"]
    torch_i = next(i for i, r in enumerate(runs) if "torch==" in r and "--index-url" in r)
    proj_i = next(i for i, r in enumerate(runs) if re.search(r"pip install \.(\s|$)", r))
    assert torch_i < proj_i
    args = _stage_args(build)
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    assert "${TORCH_INDEX_URL}" in runs[torch_i] and "${TORCH_VERSION}" in runs[torch_i]
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    pins = [d for d in pyproject["project"]["dependencies"] if re.match(r"torch\s*==", d)]
    assert pins, "pyproject.toml no longer pins torch: update the Dockerfile's TORCH_VERSION logic"
    assert pins[0].split("==", 1)[1].strip() == args["TORCH_VERSION"], "TORCH_VERSION != pyproject pin"


def _ignore_patterns() -> list[tuple[bool, re.Pattern[str]]]:
    out = []
    for line in DOCKERIGNORE.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        neg = line.startswith("!")
        pat = line.lstrip("!").strip("/")
        rx = re.escape(pat).replace(r"\*\*/", "(?:.*/)?").replace(r"\*\*", ".*").replace(r"\*", "[^/]*")
        rx = rx.replace(r"\?", "[^/]")
        out.append((neg, re.compile(rf"^{rx}(?:/.*)?$")))
    return out


def _ignored(rel: str) -> bool:
    ignored = False
    for neg, rx in _ignore_patterns():
        if rx.match(rel):
            ignored = not neg
    return ignored


def test_dockerignore_excludes_local_state() -> None:
    for rel in (".venv/bin/python", ".git/HEAD", "bench/out/routing.json", ".pytest_cache/x",
                ".hypothesis/examples/x", "gateway/__pycache__/app.cpython-311.pyc", ".mypy_cache/x",
                ".ruff_cache/x", "tests/test_deploy.py", "kvgate.egg-info/PKG-INFO"):
        assert _ignored(rel), f".dockerignore lets {rel} into the build context"


def test_dockerfile_copies_every_package_and_nothing_ignored() -> None:
    build = _stages()[0]
    sources = [s for c in build if c.cmd.upper() == "COPY" and not c.flags for s in c.value[:-1]]
    sources += [c.value[0] for c in _stages()[-1] if c.cmd.upper() == "COPY" and not c.flags]
    for src in sources:
        assert (ROOT / src).exists(), f"COPY {src}: no such path"
        assert not _ignored(src), f"COPY {src}: excluded by .dockerignore"
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for pattern in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]:
        pkg = pattern.rstrip("*")
        if (ROOT / pkg / "__init__.py").exists():
            assert pkg in sources, f"package {pkg} is not copied into the image"
    readme = pyproject["project"].get("readme")
    if readme:
        assert readme in sources, "pyproject's readme must be in the build context"


# ------------------------------------------------------------------------------- README

def test_deploy_readme_covers_the_artefacts() -> None:
    text = (DEPLOY / "README.md").read_text()
    for needle in ("docker compose up", "--profile gpu", "kubectl apply -k", "sidecar", "shared",
                   "TORCH_INDEX_URL", *VLLM_FLAGS):
        assert needle in text, f"deploy/README.md does not mention {needle}"

