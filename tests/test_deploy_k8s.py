"""Deployment artefacts, part 1: deploy/k8s and the kvgate configs embedded in it.

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

import copy
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from kubernetes_validate import utils as kv

from gateway.server.cli import build_parser
from gateway.settings import Settings
from tests.support.deploy_files import (
    ADMIN_PORT, COMPOSE_FILE, CONFIGS, DEPLOY, DOCKERFILE, K8S, K8S_VERSIONS, PLACEHOLDER, PUBLIC_PORT,
    REAL_LOOKING, ROOT, SECRETISH, VLLM_FLAGS, _container_env, _containers, _drain_budget_s, _is_kvgate,
    _is_kvgate_image, _kv_events_config, _kvgate_workloads, _labels_match, _load_config_text, _manifest_files,
    _manifests, _mid, _mounted_kvgate_config, _of_kind, _pod_spec, _port_number, _prestop_sleep_s, _secrets,
)

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
    assert s.routing.share_index, "several gateway pods behind one Service share what they learn"


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
    assert ev == {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557",
                  "replay_endpoint": "tcp://*:5558", "topic": "kv-events"}
    assert c["resources"]["limits"]["nvidia.com/gpu"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["http"] == 8000 and ports["kv-events"] == 5557 and ports["kv-replay"] == 5558
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"]["path"] == "/health"
    env = {e["name"]: e for e in c["env"]}
    assert "$(VLLM_MODEL)" in args and env["VLLM_MODEL"]["value"]


def _flag(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_the_shared_gateway_is_wired_for_precise_routing(tmp_path: Path) -> None:
    """What precise mode needs, agreed across the manifests: the vLLM pods' event ports are the
    ones kvgate dials, open in the Service and the NetworkPolicy; the block size is one; the
    tokenizer fetched is the served model's, into the directory the ConfigMap names."""
    _, sts = _one("StatefulSet", "vllm")
    vllm = _pod_spec(sts)["containers"][0]
    args = [*vllm.get("command", []), *vllm.get("args", [])]
    ev = _kv_events_config(args)
    _, dep = _one("Deployment", "shared")
    pod = _pod_spec(dep)
    gateway = _kvgate_of(dep)
    routing = _load_config_text(_mounted_kvgate_config(pod, gateway), tmp_path).routing
    port_names = {p["containerPort"]: p["name"] for p in vllm["ports"]}
    kv = routing.kv_events
    for endpoint, port in ((ev["endpoint"], kv.port), (ev["replay_endpoint"], kv.replay_port)):
        assert endpoint == f"tcp://*:{port}"
        name = port_names[port]
        _, headless = _one("Service", "vllm")
        assert any(p["port"] == port and p["targetPort"] == name for p in headless["spec"]["ports"])
        _, pol = _one("NetworkPolicy", "vllm")
        assert any(p["port"] == name for rule in pol["spec"]["ingress"] for p in rule["ports"])
    assert int(_flag(args, "--block-size")) == routing.block_size
    served = {e["name"]: e.get("value") for e in vllm["env"]}["VLLM_MODEL"]
    assert list(routing.tokenizers) == [served]  # the name clients send: vLLM's served name
    directory = routing.tokenizers[served]
    # The init step fetches that model into that directory, on a volume the gateway reads.
    init = next(c for c in pod["initContainers"] if c["name"] == "tokenizer")
    assert _is_kvgate_image(init) and not _is_kvgate(init)
    env = {e["name"]: e for e in init["env"]}
    command = [a.replace("$(MODEL)", env["MODEL"]["value"]) for a in init["command"]]
    parsed = build_parser().parse_args(command[1:])
    assert (parsed.command, parsed.source, parsed.dir, parsed.optional) == ("tokenizer", served, directory, True)
    assert env["HF_HUB_OFFLINE"]["value"] == "0" and env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]["optional"]
    written = {m["name"] for m in init["volumeMounts"] if m["mountPath"] == directory and not m.get("readOnly")}
    read = {m["name"] for m in gateway["volumeMounts"] if m["mountPath"] == directory}
    assert written and written == read
    assert {v["name"]: v for v in pod["volumes"]}[next(iter(read))].get("emptyDir") is not None
