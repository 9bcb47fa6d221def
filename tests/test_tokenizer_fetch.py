"""``kvgate tokenizer``: a model's tokenizer files (never its weights) for ``routing.tokenizers``."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from gateway.server.cli import main
from gateway.settings import load_settings
from routing.tokenization import Tokenization
from routing.tokenizer_files import PATTERNS, wanted
from tests.support.fake_hub import build_fake_hub
from tests.support.servers import ServerThread
from vllm_sim.tokenizer_dir import build_tokenizer_dir

WEIGHTS = ("model.safetensors", "model-00001-of-00004.safetensors", "pytorch_model.bin", "consolidated.pth",
           "model.gguf", "original/consolidated.00.pth", "onnx/model.onnx", "README.md", ".gitattributes")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model directory as a replica's volume holds it: tokenizer files, weights, the rest."""
    out = build_tokenizer_dir(tmp_path_factory.mktemp("model") / "m")
    for name in WEIGHTS:
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(b"\0" * 64)
    return out


def test_only_the_tokenizer_files_are_copied_and_they_load(model_dir: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    dest = tmp_path / "tok"
    assert main(["tokenizer", str(model_dir), str(dest), "--model", "sim-model"]) == 0
    copied = sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file())
    assert copied == sorted(p.name for p in model_dir.iterdir() if wanted(p.name))
    assert "tokenizer.json" in copied and "chat_template.jinja" in copied
    assert not any(w in copied for w in WEIGHTS)
    out = capsys.readouterr().out
    assert "chat template renders" in out
    # The snippet it prints is the config kvgate then loads, and routes in process with.
    snippet = yaml.safe_load(out[out.index("routing:"):])
    settings = load_settings(environ={}, overrides={"replicas": [{"name": "r1", "url": "http://127.0.0.1:9"}],
                                                    **snippet})
    tokenization = Tokenization(settings.routing).load()
    try:
        assert tokenization.mode("sim-model") == "in-process" and not tokenization.degraded()
        ids = asyncio.run(tokenization.token_ids("sim-model", "chat", {
            "model": "sim-model", "messages": [{"role": "user", "content": "hi"}]}))
        assert ids and tokenization.exact == {"sim-model": 1}
    finally:
        asyncio.run(tokenization.aclose())


def test_fetching_again_into_the_same_directory_is_harmless(model_dir: Path, tmp_path: Path) -> None:
    dest = tmp_path / "tok"
    assert main(["tokenizer", str(model_dir), str(dest)]) == 0
    before = {p.name: p.read_bytes() for p in dest.iterdir()}
    assert main(["tokenizer", str(model_dir), str(dest)]) == 0  # a restarted init container
    assert {p.name: p.read_bytes() for p in dest.iterdir()} == before


def test_from_the_hub_it_downloads_the_tokenizer_files_and_never_asks_for_the_weights(
        model_dir: Path, tmp_path: Path) -> None:
    files = {p.relative_to(model_dir).as_posix(): p.read_bytes() for p in model_dir.rglob("*") if p.is_file()}
    log: list[tuple[str, str]] = []
    hub = ServerThread(build_fake_hub("acme/chat-1b", files, log)).start()
    dest = tmp_path / "tok"
    try:
        # As the init container runs it: its own process, the Hub named by HF_ENDPOINT, the
        # image's HF_HUB_OFFLINE=1 turned off for this step alone.
        env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0", "HF_HOME": str(tmp_path / "hf")}
        done = subprocess.run([sys.executable, "-m", "gateway.server.cli", "tokenizer", "acme/chat-1b", str(dest)],
                              env=env, capture_output=True, text=True, timeout=120, check=False)
    finally:
        hub.stop()
    assert done.returncode == 0, done.stderr
    assert "chat template renders" in done.stdout
    got = sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file() and ".cache" not in p.parts)
    assert got == sorted(name for name in files if wanted(name))
    fetched = {path.rsplit("/", 1)[-1] for method, path in log if method == "GET" and "/resolve/" in path}
    assert fetched == set(got) and not any(w.rsplit("/", 1)[-1] in fetched for w in WEIGHTS)
    assert not any(w in path for _, path in log for w in WEIGHTS)  # not even a HEAD


def test_a_hub_id_while_offline_says_how_to_fix_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # what kvgate's image sets
    assert main(["tokenizer", "Qwen/Qwen2.5-7B-Instruct", str(tmp_path / "t")]) == 1
    assert "HF_HUB_OFFLINE" in capsys.readouterr().err
    # An init step must not keep the gateway from starting: it warns and exits 0.
    assert main(["tokenizer", "Qwen/Qwen2.5-7B-Instruct", str(tmp_path / "t"), "--optional"]) == 0
    err = capsys.readouterr().err
    assert "warning" in err and "approximately" in err


def test_directories_that_cannot_serve_are_refused_with_the_reason(model_dir: Path, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tokenizer", str(tmp_path / "missing"), str(tmp_path / "a")]) == 1
    assert "no such directory" in capsys.readouterr().err
    weights_only = tmp_path / "weights"
    weights_only.mkdir()
    (weights_only / "model.safetensors").write_bytes(b"\0")
    assert main(["tokenizer", str(weights_only), str(tmp_path / "b")]) == 1
    assert "no tokenizer files" in capsys.readouterr().err
    broken = tmp_path / "broken"
    broken.mkdir()
    for p in model_dir.iterdir():
        if p.is_file() and wanted(p.name):
            (broken / p.name).write_bytes(p.read_bytes())
    (broken / "tokenizer.json").write_text("{not json")
    assert main(["tokenizer", str(broken), str(tmp_path / "c")]) == 1
    assert "do not load as a tokenizer" in capsys.readouterr().err


@given(st.sampled_from(WEIGHTS), st.sampled_from(["", "sub/", "original/"]))
def test_weights_and_docs_are_never_wanted(name: str, folder: str) -> None:
    assert not wanted(folder + name)


def test_every_pattern_names_a_file_it_wants() -> None:
    for pattern in PATTERNS:
        assert wanted(pattern.replace("*", "x"))
