"""``kvgate check``: each replica of a config checked for what kvgate needs, against real simulated replicas."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from gateway.server.cli import main
from tests.support.kv_sims import EventSim
from tests.support.servers import ServerThread, free_port
from tests.support.stack import MODEL, sim_config
from vllm_sim.server import build_app as build_sim
from vllm_sim.tokenizer_dir import build_tokenizer_dir


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer_dir(tmp_path_factory.mktemp("tok") / "model")


def _run(tmp_path: Path, config: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    path = tmp_path / "kvgate.yaml"
    path.write_text(yaml.safe_dump(config))
    rc = main(["check", "--config", str(path), "--timeout", "3"])
    return rc, capsys.readouterr().out


def _lines(out: str) -> dict[tuple[str, str], str]:
    """(replica, check) -> status."""
    table, replica = {}, ""
    for line in out.splitlines():
        if line.startswith("replica "):
            replica = line.split()[1]
        elif line.startswith("  "):
            status, _, rest = line.strip().partition(" ")
            table[(replica, rest.strip().split(":")[0])] = status
    return table


@pytest.fixture
def agreeing(tokenizer_dir: Path) -> Iterator[list[EventSim]]:
    # Replicas that tokenize as the directory does (as vLLM with the same files would).
    sims = [EventSim(f"r{i}", tokenizer=str(tokenizer_dir)).start() for i in (1, 2)]
    try:
        yield sims
    finally:
        for s in sims:
            s.stop()


def test_a_fleet_configured_as_its_replicas_are_passes_every_check(
        agreeing: list[EventSim], tokenizer_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = _run(tmp_path, {"replicas": [s.replica_settings() for s in agreeing],
                              "routing": {"tokenizers": {MODEL: str(tokenizer_dir)}}}, capsys)
    assert rc == 0, out
    table = _lines(out)
    for s in agreeing:
        for check in ("health", "models", "prefix caching", "block size", "kv events", "kv events replay",
                      f"token ids {MODEL}"):
            assert table[(s.name, check)] == "ok", (check, out)
    assert "every check passed" in out and "FAIL" not in out
    # Seats not told: ttft (the default) cannot price a wait for a slot, and check says what to set.
    assert table[(agreeing[0].name, "seats")] == "skip" and "--max-num-seqs" in out


def test_told_seats_are_reported(agreeing: list[EventSim], tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    replicas = [{**s.replica_settings(), "max_in_flight": 64} for s in agreeing]
    rc, out = _run(tmp_path, {"replicas": replicas}, capsys)
    assert rc == 0, out
    assert all(_lines(out)[(s.name, "seats")] == "ok" for s in agreeing) and "max_in_flight 64" in out


def test_what_precise_routing_would_miss_is_named_per_replica(
        tokenizer_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    own_template = EventSim("stand-in").start()  # renders chat its own way: other token ids
    wide_blocks = ServerThread(build_sim(sim_config("wide", block_size=32, tokenizer=str(tokenizer_dir)))).start()
    gone = f"http://127.0.0.1:{free_port()}"
    try:
        pub, _ = own_template.endpoints
        config = {"replicas": [
            {"name": "stand-in", "url": own_template.url, "kv_events": pub,
             "kv_events_replay": f"tcp://127.0.0.1:{free_port()}"},  # nothing listens there
            {"name": "wide", "url": wide_blocks.url, "kv_events": f"tcp://127.0.0.1:{free_port()}"},
            {"name": "gone", "url": gone},
        ], "routing": {"tokenizers": {MODEL: str(tokenizer_dir)}}}
        rc, out = _run(tmp_path, config, capsys)
    finally:
        own_template.stop()
        wide_blocks.stop()
    assert rc == 1
    table = _lines(out)
    assert table[("stand-in", f"token ids {MODEL}")] == "FAIL" and "kvgate tokenizer MODEL DIR" in out
    assert table[("stand-in", "kv events")] == "ok" and table[("stand-in", "kv events replay")] == "FAIL"
    assert table[("wide", "block size")] == "FAIL" and "32, routing.block_size is 16" in out
    assert table[("wide", "kv events")] == "FAIL" and table[("wide", "kv events replay")] == "skip"
    assert table[("wide", f"token ids {MODEL}")] == "ok"
    assert table[("gone", "health")] == "FAIL" and ("gone", "models") not in table
    assert "kvgate check: 5 failed" in out


def test_a_bad_config_is_refused_with_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "kvgate.yaml"
    path.write_text(yaml.safe_dump({"replicas": [{"name": "r1", "url": "not a url"}]}))
    assert main(["check", "--config", str(path)]) == 2
    assert "replicas.0.url" in capsys.readouterr().err


def test_scheduling_policy_is_reported_and_a_priority_claim_is_probed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.support.capture import Capture

    takes, refuses, fifo = Capture(MODEL), Capture(MODEL, refuse_priority=True), Capture(MODEL, refuse_priority=True)
    servers = {name: ServerThread(c.app(), lifespan="off").start()
               for name, c in (("takes", takes), ("refuses", refuses), ("fifo", fifo))}
    try:
        policies = {"takes": "priority", "refuses": "priority", "fifo": "fcfs"}
        rc, out = _run(tmp_path, {"replicas": [
            {"name": n, "url": s.url, "scheduling_policy": policies[n]} for n, s in servers.items()]}, capsys)
        table = _lines(out)
        assert rc == 1
        assert table[("takes", "scheduling")] == "ok" and "priority (configured)" in out
        assert table[("refuses", "scheduling")] == "FAIL" and "--scheduling-policy priority" in out
        assert table[("fifo", "scheduling")] == "ok" and "fcfs (configured)" in out
        assert [r.body.get("priority") for r in takes.received] == [1] and not fifo.received
    finally:
        for s in servers.values():
            s.stop()
