"""The simulator as a separate process: CLI flags, start-up wait, and a SIGKILL mid-stream."""

from __future__ import annotations

import argparse
import time

import httpx
import pytest

from tests.support.servers import free_port
from vllm_sim.cli import add_arguments, config_from_args
from vllm_sim.process import sim_flags, start_sim_process


def test_cli_flags_build_the_config() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flags = sim_flags(port=9100, kv_blocks=64, time_scale=0.01, model=["a", "b"], max_num_seqs=4,
                      error_rate=0.25, error_status=503, die_after_tokens=3, garbage=True,
                      html_200=False, name="r1", kv_events_drop=True, kv_events_delay_s=0.25)
    args = parser.parse_args(flags)
    config = config_from_args(args)
    assert (config.port, config.num_gpu_blocks, config.models, config.name) == (9100, 64, ("a", "b"), "r1")
    assert config.timing.time_scale == 0.01 and config.timing.max_num_seqs == 4
    assert config.faults.error_rate == 0.25 and config.faults.error_status == 503
    assert config.faults.die_after_tokens == 3 and config.faults.garbage and not config.faults.html_200
    assert config.faults.kv_events_drop and config.faults.kv_events_delay_s == 0.25
    default = config_from_args(parser.parse_args([]))
    assert default.models == ("sim-model",) and default.faults.die_after_tokens is None


def test_process_serves_then_dies_on_sigkill() -> None:
    port = free_port()
    proc = start_sim_process(port, kv_blocks=128, time_scale=1.0, decode_base_s=0.05, model="m1", name="p1")
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5) as c:
            assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["m1"]
            took = []
            for _ in range(5):
                start = time.perf_counter()
                r = c.post("/v1/completions", json={"model": "m1", "prompt": "x", "max_tokens": 1})
                took.append(time.perf_counter() - start)
                assert r.status_code == 200
            # The process binds its own socket (TCP_NODELAY on): no 40 ms delayed-ACK stalls.
            assert min(took) < 0.03, took
            assert r.headers["x-sim-replica"] == "p1"
            assert 'num_gpu_blocks="128"' in c.get("/metrics").text
            payload = {"model": "m1", "prompt": "x", "max_tokens": 100, "stream": True}
            with pytest.raises(httpx.TransportError):
                with c.stream("POST", "/v1/completions", json=payload) as stream:
                    for i, _ in enumerate(stream.iter_lines()):
                        if i == 4:
                            proc.kill()
    finally:
        proc.kill()
        proc.wait(5)
    assert proc.returncode == -9
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health")


def test_start_failure_reports_the_output() -> None:
    with pytest.raises(RuntimeError, match="exited"):
        start_sim_process(free_port(), kv_blocks=0, startup_timeout=10)
