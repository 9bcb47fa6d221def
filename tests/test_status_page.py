"""The status page renders in headless Chromium, with live data and trend lines, and a screenshot is taken."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.stack import MODEL, start_stack

TOKEN = "status-page-token"


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def test_status_page_renders_in_headless_chromium(tmp_path: Path) -> None:
    exe = _chromium()
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("Chromium is required in CI (.ci/run installs it)")
        pytest.skip("Chromium is not installed (apt-get install chromium)")
    stack = start_stack(2, admin_token=TOKEN, tenants=[{"name": "acme", "api_keys": ["sk-acme-1"]}],
                        admin={"trend_interval_s": 0.2})
    try:
        client = openai.OpenAI(base_url=stack.base_url, api_key="sk-acme-1", max_retries=0)
        for i in range(3):
            client.chat.completions.create(model=MODEL, max_tokens=2, messages=[
                {"role": "system", "content": f"Now is 2026-11-30T08:{10 + i}:00Z. You are helpful."},
                {"role": "user", "content": "hello"}])
        # Traffic over several trend intervals: streams (TTFT) that share a long prefix (cached tokens).
        system = {"role": "system", "content": "You are a support assistant for a router product. " * 20}
        for i in range(12):
            for _ in client.chat.completions.create(model=MODEL, max_tokens=2, stream=True, messages=[
                    system, {"role": "user", "content": f"question {i}"}]):
                pass
            time.sleep(0.05)
        samples = stack.runtime.trends.samples
        assert stack.wait_for(lambda: len(samples) >= 4 and any(s.ttft_p95_s is not None for s in samples)
                              and any(s.prefix_hit_rate for s in samples))
        assert stack.admin is not None
        status = httpx.get(f"{stack.admin.url}/admin/status", headers={"authorization": f"Bearer {TOKEN}"},
                           timeout=10).json()
        chat = next(e for e in status["endpoints"] if e["endpoint"] == "chat")
        assert chat["requests"] == 15 and chat["server_errors"] == 0 and chat["mean_ttft_s"] > 0, status["endpoints"]
        shot = tmp_path / "status.png"
        profile = tempfile.mkdtemp(prefix="kvgate-chromium-")
        common = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  f"--user-data-dir={profile}", "--virtual-time-budget=4000", "--window-size=1400,1000"]
        url = f"{stack.admin.url}/#token={TOKEN}"
        dom = subprocess.run([*common, "--dump-dom", url], capture_output=True, text=True, timeout=90, check=False)
        subprocess.run([*common, f"--screenshot={shot}", url], capture_output=True, timeout=90, check=False)
        assert "r1" in dom.stdout and "r2" in dom.stdout, dom.stdout[-2000:]
        assert "<th>routed</th>" in dom.stdout  # replicas without KV events: approximate
        assert re.search(r'<tbody id="savings"><tr><td><b>acme</b></td>', dom.stdout), dom.stdout[-3000:]
        assert "acme" in dom.stdout and "timestamp" in dom.stdout  # the hygiene warning shows
        assert re.search(r"<code>chat</code></td>\s*<td>15</td>", dom.stdout), dom.stdout[-3000:]  # the endpoints table
        # Four trend lines, each drawn from at least one sample, as an SVG path.
        lines = re.findall(r'<svg class="spark" data-key="(\w+)" data-points="(\d+)".*?<path class="line" d="([^"]*)"',
                           dom.stdout)
        assert {k for k, _, _ in lines} == {"requests_per_s", "prefix_hit_rate", "ttft_p95_s",
                                            "prefill_saved_share"}, dom.stdout[-3000:]
        for key, points, path in lines:
            assert int(points) >= 1 and path.startswith("M"), (key, points, path)
        assert int(dict((k, n) for k, n, _ in lines)["requests_per_s"]) >= 4
        assert shot.exists() and shot.stat().st_size > 10_000
        out = os.environ.get("KVGATE_SCREENSHOT")
        if out:
            shutil.copy(shot, out)
        shutil.rmtree(profile, ignore_errors=True)
    finally:
        stack.close()
