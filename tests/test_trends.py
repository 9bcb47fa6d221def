"""The status page's trend samples: what one interval's sample says, and /admin/trends over a real listener."""

from __future__ import annotations

import math
from typing import Iterator

import httpx
import openai
import pytest

from gateway.observe.metrics import Metrics
from gateway.observe.trends import Trends, quantile
from tests.support.clock import Clock
from tests.support.stack import MODEL, Stack, start_stack

TOKEN = "trends-admin-token"


def test_quantile_is_prometheus_histogram_quantile() -> None:
    inf = math.inf
    # 100 observations: 50 under 10 ms, 40 in (10, 25] ms, 10 in (25, 50] ms.
    buckets = ((0.01, 50.0), (0.025, 90.0), (0.05, 100.0), (inf, 100.0))
    assert quantile(0.5, buckets) == pytest.approx(0.01)
    assert quantile(0.95, buckets) == pytest.approx(0.025 + 0.025 * 0.5)
    assert quantile(0.25, buckets) == pytest.approx(0.005)
    # Past the last finite bound, the bound is all Prometheus (and we) can say.
    assert quantile(0.95, ((0.01, 1.0), (inf, 10.0))) == pytest.approx(0.01)
    assert quantile(0.95, ((0.01, 0.0), (inf, 0.0))) is None and quantile(0.95, ()) is None


def test_each_sample_covers_only_its_own_interval() -> None:
    clock, wall = Clock(), Clock(1_800_000_000.0)
    metrics = Metrics()
    trends = Trends(metrics, interval_s=10, samples=3, clock=clock, wall=wall)
    trends.tick()  # the starting totals
    for _ in range(20):
        metrics.requests.labels("chat", "200", "r1", "acme").inc()
    metrics.tokens.labels("prompt", "r1", "acme").inc(1000)
    metrics.tokens.labels("cached", "r1", "acme").inc(800)
    for v in [0.004] * 18 + [0.2, 0.2]:
        metrics.ttft.labels("chat").observe(v)
    clock.t += 10
    wall.t += 10
    trends.tick()
    first = trends.samples[-1]
    assert first.requests_per_s == pytest.approx(2.0) and first.prefix_hit_rate == pytest.approx(0.8)
    assert 0.1 < first.ttft_p95_s < 0.25  # type: ignore[operator]  # two slow streams in twenty are the p95
    # A quiet interval: no rate, and no hit rate or TTFT at all (a gap, not a zero).
    clock.t += 10
    wall.t += 10
    trends.tick()
    quiet = trends.samples[-1]
    assert (quiet.requests_per_s, quiet.prefix_hit_rate, quiet.ttft_p95_s) == (0.0, None, None)
    # Only fast streams now: the p95 forgets the slow ones of two intervals ago.
    metrics.requests.labels("chat", "200", "r2", "acme").inc(5)
    metrics.tokens.labels("prompt", "r2", "acme").inc(100)
    for _ in range(5):
        metrics.ttft.labels("chat").observe(0.004)
    clock.t += 5
    wall.t += 5
    trends.tick()
    last = trends.samples[-1]
    assert last.requests_per_s == pytest.approx(1.0) and last.prefix_hit_rate == 0.0
    assert last.ttft_p95_s is not None and last.ttft_p95_s <= 0.005
    assert len(trends.samples) == 3 and trends.samples[0] == first  # bounded ring
    clock.t += 10
    wall.t += 10
    trends.tick()
    assert len(trends.samples) == 3 and trends.samples[0] == quiet


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    s = start_stack(2, admin_token=TOKEN, admin={"trend_interval_s": 0.2, "trend_samples": 50})
    yield s
    s.close()


def test_admin_trends_over_a_real_listener(stack: Stack) -> None:
    assert stack.admin is not None
    client = openai.OpenAI(base_url=stack.base_url, api_key="any", max_retries=0)
    prefix = {"role": "system", "content": "A long shared system prompt for the trend test. " * 30}
    for i in range(6):
        for _ in client.chat.completions.create(model=MODEL, max_tokens=2, stream=True,
                                                messages=[prefix, {"role": "user", "content": f"q{i}"}]):
            pass
    url = stack.admin.url + "/admin/trends"
    assert httpx.get(url, timeout=5).status_code == 401
    auth = {"authorization": f"Bearer {TOKEN}"}

    def busy() -> list[dict[str, float]]:
        return [x for x in httpx.get(url, headers=auth, timeout=5).json()["samples"] if x["requests_per_s"] > 0]

    assert stack.wait_for(lambda: bool(busy()), timeout=5)
    # Two samples at least, so that the spacing between them can be checked.
    assert stack.wait_for(lambda: len(httpx.get(url, headers=auth, timeout=5).json()["samples"]) >= 2, timeout=5)
    body = httpx.get(url, headers=auth, timeout=5).json()
    assert body["interval_s"] == 0.2 and body["capacity"] == 50 and len(body["samples"]) <= 50
    ts = [x["t"] for x in body["samples"]]
    assert ts == sorted(ts)
    # The six streams shared a long prefix: the intervals that saw them have TTFTs and cached tokens.
    seen = busy()
    assert any(x["ttft_p95_s"] is not None for x in seen), body
    assert any((x["prefix_hit_rate"] or 0) > 0 for x in seen), body
    # Every sample closes one interval: consecutive ones are about interval_s apart.
    gaps = [b - a for a, b in zip(ts, ts[1:])]
    assert gaps and min(gaps) > 0.1, body
