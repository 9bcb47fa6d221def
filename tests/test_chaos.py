"""Chaos and soak at small scale, through the same code as ``bench/chaos.py`` and ``bench/soak.py``.

Real processes on loopback: four vllm_sim replicas (or, for the P/D scenarios of
``bench/chaos_pd.py``, 2 prefill and 2 decode replicas), a private Redis and a
kvgate. Each scenario injects one fault under a few seconds of load; every
response is judged against vllm_sim's deterministic answer. Nothing may be
lost or wrong, and each scenario must show that its fault was really hit.
"""

from __future__ import annotations

import asyncio
import shutil
from typing import Iterator

import orjson
import pytest

from bench import chaos_pd, soak
from bench.chaos import BY_NAME, GATEWAY, SIM_FLAGS, Scenario, Tally, run_chaos
from bench.chaos_report import format_details, format_table
from bench.chaos_check import Expected, expected_answer, judge_stream, judge_unary
from bench.chaos_fleet import Fleet, start_fleet

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")

# Scenarios that leave replicas ejected run last, so the settling before the others is short.
FAST = ["baseline", "redis_hung", "redis_restarted", "replica_refused", "replica_killed_midstream",
        "stall_mid_stream", "garbage_sse"]


def _run(fleet: Fleet, scenarios: list[Scenario], duration: float) -> dict[str, Tally]:
    try:
        done = asyncio.run(run_chaos(fleet, scenarios, duration=duration, concurrency=12, seed=7))
    finally:
        fleet.close()
    print("\n" + format_table(done) + "\n" + format_details(done))
    return {t.scenario: t for t in done}


@pytest.fixture(scope="module")
def tallies() -> Iterator[dict[str, Tally]]:
    yield _run(start_fleet(replicas=4, sim_flags=SIM_FLAGS, gateway=GATEWAY), [BY_NAME[n] for n in FAST], 2.5)


@pytest.fixture(scope="module")
def pd_tallies() -> Iterator[dict[str, Tally]]:
    yield _run(chaos_pd.start_pd_fleet(), chaos_pd.SCENARIOS, 2.0)


def _loses_nothing_and_serves_nothing_wrong(t: Tally) -> None:
    report = format_table([t]) + "\n" + format_details([t])
    assert t.sent > 10, report
    assert t.lost == 0, report
    assert t.unexercised is None, f"{t.scenario}: fault not exercised: {t.unexercised}\n{report}"
    assert t.wrong == 0, report


@pytest.mark.parametrize("name", FAST)
def test_chaos_scenario_loses_nothing_and_serves_nothing_wrong(tallies: dict[str, Tally], name: str) -> None:
    _loses_nothing_and_serves_nothing_wrong(tallies[name])


@pytest.mark.parametrize("name", list(chaos_pd.BY_NAME))
def test_pd_chaos_scenario_loses_nothing_and_serves_nothing_wrong(pd_tallies: dict[str, Tally], name: str) -> None:
    _loses_nothing_and_serves_nothing_wrong(pd_tallies[name])


def test_soak_smoke_has_no_errors() -> None:
    fleet = soak.start_soak_fleet(replicas=2, decode_s=0.02, clients=20)
    try:
        report = asyncio.run(soak.soak(fleet, clients=20, duration=5, direct_duration=0, decode_s=0.02,
                                       max_tokens=16, sample_s=0.5, warmup_s=1.0))
    finally:
        fleet.close()
    text = soak.format_report(report, rss_margin=64, fd_margin=64)
    assert report.gateway.requests > 50, text
    assert report.gateway.errors == 0, text
    assert report.gateway.gaps.n > 0 and len(report.samples.points) >= 5, text


# -- the judge itself: a checker that never says "wrong" proves nothing ---------------------------------
BODY = {"model": "sim-model", "messages": [{"role": "user", "content": "judge me"}], "max_tokens": 5}


def _sse(*payloads: object) -> bytes:
    return b"".join(b"data: " + (p if isinstance(p, bytes) else orjson.dumps(p)) + b"\n\n" for p in payloads)


def _chunk(text: str, reason: str | None = None, index: int = 0) -> dict[str, object]:
    return {"choices": [{"index": index, "delta": {"content": text}, "finish_reason": reason}]}


@pytest.fixture
def exp() -> Expected:
    return expected_answer(BODY)


def test_judge_accepts_the_whole_answer(exp: Expected) -> None:
    words = exp.texts[0].split(" ")
    pieces = [words[0]] + [" " + w for w in words[1:]]
    raw = _sse(*[_chunk(p, "length" if i == len(pieces) - 1 else None) for i, p in enumerate(pieces)], b"[DONE]")
    assert judge_stream(exp, 200, "text/event-stream", raw).kind == "ok"
    unary = {"choices": [{"index": 0, "message": {"content": exp.texts[0]}, "finish_reason": "length"}]}
    assert judge_unary(exp, 200, orjson.dumps(unary)).kind == "ok"


def test_judge_counts_a_prefix_then_one_error_event_as_clean(exp: Expected) -> None:
    raw = _sse(_chunk(exp.texts[0][:3]), {"error": {"message": "replica died"}})
    v = judge_stream(exp, 200, "text/event-stream", raw)
    assert (v.kind, v.detail) == ("clean", "stream error event after tokens")
    assert judge_unary(exp, 502, b'{"error": {"message": "bad gateway"}}').kind == "clean"


@pytest.mark.parametrize("raw, detail", [
    (_sse(_chunk("nonsense"), {"error": {"message": "x"}}), "streamed text is not a prefix of the answer"),
    (_sse(_chunk("th"), b"[DONE]"), None),  # [DONE] invented after a partial answer (or a wrong prefix)
    (_sse({"error": {"message": "x"}}, b"[DONE]"), "event after the error event"),
    (_sse({"error": {"message": "x"}}, {"error": {"message": "y"}}), "event after the error event"),
    (b'data: {"choices": [{"delta": \n\n', "malformed event passed through"),
])
def test_judge_flags_wrong_streams(exp: Expected, raw: bytes, detail: str | None) -> None:
    v = judge_stream(exp, 200, "text/event-stream", raw)
    assert v.kind == "wrong"
    assert detail is None or v.detail == detail


def test_judge_flags_invented_finish_reason_and_lost_streams(exp: Expected) -> None:
    cut = _sse(_chunk(exp.texts[0][:2], "stop"))
    assert judge_stream(exp, 200, "text/event-stream", cut).kind == "wrong"
    assert judge_stream(exp, 200, "text/event-stream", _sse(_chunk(exp.texts[0][:2]))).kind == "lost"
    assert judge_stream(exp, 200, "text/event-stream", b"", transport_error="RemoteProtocolError").kind == "lost"
    assert judge_unary(exp, 500, b"<html>oops</html>").kind == "lost"
    assert judge_unary(exp, 200, b"<html>It works!</html>").kind == "wrong"
    assert judge_stream(exp, 200, "text/html", b"<html></html>").kind == "wrong"
