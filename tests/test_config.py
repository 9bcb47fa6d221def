"""Configuration: one typed object, env overrides, errors that name the field."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.settings import ConfigError, load_settings

GOOD = """
listen: {host: 127.0.0.1, port: 8080}
admin: {host: 127.0.0.1, port: 8081, token: "s3cret-admin"}
redis_url: redis://127.0.0.1:6379/0
replicas:
  - {name: r1, url: "http://127.0.0.1:9001"}
routing: {policy: least_load}
tenants:
  - {name: acme, api_keys: ["sk-acme-1"]}
semantic_cache: {enabled: false}
"""


def test_issue_example_config_loads(tmp_path: Path) -> None:
    p = tmp_path / "kvgate.yaml"
    p.write_text(GOOD)
    s = load_settings(p, environ={})
    assert s.listen.port == 8080 and s.replicas[0].url == "http://127.0.0.1:9001"
    assert s.tenants[0].api_keys[0].get_secret_value() == "sk-acme-1"
    assert "sk-acme-1" not in repr(s) and "s3cret-admin" not in repr(s)


def test_env_overrides_file(tmp_path: Path) -> None:
    p = tmp_path / "kvgate.yaml"
    p.write_text(GOOD)
    s = load_settings(p, environ={"KVGATE_LISTEN__PORT": "9999", "KVGATE_ROUTING__POLICY": "round_robin"})
    assert s.listen.port == 9999 and s.routing.policy == "round_robin"
    # Not settings: the switch that runs routing from source (routing._native) is no override.
    s = load_settings(p, environ={"KVGATE_INTERPRETED": "1", "KVGATE_LISTEN__PORT": "9998"})
    assert s.listen.port == 9998
    with pytest.raises(ConfigError):
        load_settings(p, environ={"KVGATE_INTERPRETD": "1"})  # a typo is still an unknown setting


@pytest.mark.parametrize("text,field", [
    ("replicas: [{name: r1, url: 'ftp://x'}]", "replicas.0.url"),
    ("listen: {port: 99999}", "listen.port"),
    ("routing: {policy: magic}", "routing.policy"),
    ("semantic_cache: {enabledd: true}", "semantic_cache.enabledd"),
    ("replicas: [{name: a, url: 'http://x'}, {name: a, url: 'http://y'}]", "duplicate"),
])
def test_bad_config_names_the_field(tmp_path: Path, text: str, field: str) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_settings(p, environ={})
    assert field in str(e.value)


def test_cli_refuses_bad_config(tmp_path: Path) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text("listen: {port: -1}\n")
    proc = subprocess.run([sys.executable, "-m", "gateway.server.cli", "serve", "--config", str(p)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2
    assert "listen.port" in proc.stderr


def test_embed_threads_unset_gives_onnx_runtime_the_cores_shared_among_workers() -> None:
    from semantic_cache.settings import cores_available, embedder_threads

    cores = cores_available()
    assert cores == len(os.sched_getaffinity(0))
    # Unset: torch (the spinning fallbacks) keeps one thread, ORT gets the cores.
    assert embedder_threads(None) == (1, cores)
    assert embedder_threads(None, workers=cores) == (1, 1)
    assert embedder_threads(None, workers=cores * 4) == (1, 1)  # never zero
    assert embedder_threads(3, workers=2) == (3, 3)  # a number is taken as it is
    assert load_settings(None, environ={}).semantic_cache.embed_threads is None
