"""Deployment artefacts, part 2: docker-compose.yml, the Dockerfile, .dockerignore and deploy/README.md.

Offline, like part 1 (tests/test_deploy_k8s.py): compose against the compose-spec schema
vendored by ``check-jsonschema``, the Dockerfile through BuildKit's own parser.
"""

from __future__ import annotations

import importlib.resources
import json
import re
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import dockerfile
import jsonschema
import pytest
import yaml

from gateway.settings import load_settings
from tests.support.deploy_files import (
    ADMIN_PORT, COMPOSE_FILE, CONFIGS, DEPLOY, DOCKERFILE, DOCKERIGNORE, ENTRYPOINT, PUBLIC_PORT, ROOT,
    SECRETISH, VLLM_FLAGS, _drain_budget_s, _kv_events_config,
)

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
            if cond["condition"] == "service_completed_successfully":
                # A one-shot step (the tokenizer fetch): it runs once and exits.
                assert svcs[dep].get("restart") == "no", f"{dep} is waited for to exit but restarts"
                assert svcs[dep].get("healthcheck", {}).get("disable") is True, f"{dep}: a one-shot with a healthcheck"
                continue
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
                ".ruff_cache/x", "tests/test_deploy.py", "kvgate.egg-info/PKG-INFO",
                "routing/native__mypyc.cpython-311-x86_64-linux-gnu.so", "routing/_native_built.txt"):
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
    assert "setup.py" in sources, "setup.py compiles the routing modules: the image build needs it"


# ------------------------------------------------------------------------------- README

def test_deploy_readme_covers_the_artefacts() -> None:
    text = (DEPLOY / "README.md").read_text()
    for needle in ("docker compose up", "--profile gpu", "kubectl apply -k", "sidecar", "shared",
                   "TORCH_INDEX_URL", *VLLM_FLAGS):
        assert needle in text, f"deploy/README.md does not mention {needle}"


def test_compose_gpu_profile_is_wired_for_precise_routing() -> None:
    """kvgate-gpu dials each vLLM replica's event and replay ports, keys blocks as vLLM sizes
    them, and loads the tokenizer the one-shot step fetches for the default model."""
    svcs = _services()
    gw = svcs["kvgate-gpu"]
    settings = load_settings(_mounted_compose_config(gw), environ={})
    for r in settings.replicas:
        host = urlsplit(r.url).hostname
        args = [*svcs[host].get("entrypoint", []), *svcs[host]["command"]]
        ev = _kv_events_config(args)
        assert r.kv_events == ev["endpoint"].replace("*", host)
        assert r.kv_events_replay == ev["replay_endpoint"].replace("*", host)
        assert int(args[args.index("--block-size") + 1]) == settings.routing.block_size
    fetch = svcs["tokenizer"]
    served = svcs["vllm-1"]["command"][0]  # the model id, also the name clients send
    assert fetch["entrypoint"][:3] == ["kvgate", "tokenizer", "--optional"] and fetch["entrypoint"][3] == served
    directory = fetch["entrypoint"][4]
    assert settings.routing.tokenizers == {served: directory}
    assert f"tokenizer:{directory}" in fetch["volumes"] and f"tokenizer:{directory}:ro" in gw["volumes"]
    assert fetch["environment"]["HF_HUB_OFFLINE"] == "0"
