"""The status page renders in headless Chromium, with live data, and a screenshot is taken."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

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
    stack = start_stack(2, admin_token=TOKEN, tenants=[{"name": "acme", "api_keys": ["sk-acme-1"]}])
    try:
        client = openai.OpenAI(base_url=stack.base_url, api_key="sk-acme-1", max_retries=0)
        for i in range(3):
            client.chat.completions.create(model=MODEL, max_tokens=2, messages=[
                {"role": "system", "content": f"Now is 2026-11-30T08:{10 + i}:00Z. You are helpful."},
                {"role": "user", "content": "hello"}])
        assert stack.admin is not None
        shot = tmp_path / "status.png"
        profile = tempfile.mkdtemp(prefix="kvgate-chromium-")
        common = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  f"--user-data-dir={profile}", "--virtual-time-budget=4000", "--window-size=1400,1000"]
        url = f"{stack.admin.url}/#token={TOKEN}"
        dom = subprocess.run([*common, "--dump-dom", url], capture_output=True, text=True, timeout=90, check=False)
        subprocess.run([*common, f"--screenshot={shot}", url], capture_output=True, timeout=90, check=False)
        assert "r1" in dom.stdout and "r2" in dom.stdout, dom.stdout[-2000:]
        assert "acme" in dom.stdout and "timestamp" in dom.stdout  # the hygiene warning shows
        assert shot.exists() and shot.stat().st_size > 10_000
        out = os.environ.get("KVGATE_SCREENSHOT")
        if out:
            shutil.copy(shot, out)
        shutil.rmtree(profile, ignore_errors=True)
    finally:
        stack.close()
