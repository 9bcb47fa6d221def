"""The official OpenAI Node SDK (from the npm registry) against kvgate: chat and responses, streaming.

``tests/node`` pins the SDK (package.json + package-lock.json); ``npm ci`` installs
it into a cache directory outside the repository, keyed by the lock file's hash,
so it is fetched once per lock. The script prints what the SDK parsed and this
test judges it. Skips (saying why) only when node or npm is not installed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

from tests.support.stack import MODEL, Stack, start_stack

NODE_DIR = Path(__file__).parent / "node"
_FILES = ("package.json", "package-lock.json", "sdk_check.mjs")


def _sdk_dir() -> Path:
    """A directory with the pinned SDK installed and the script beside it."""
    lock = (NODE_DIR / "package-lock.json").read_bytes()
    root = Path(os.environ.get("KVGATE_NODE_CACHE") or Path.home() / ".cache" / "kvgate" / "node")
    target = root / hashlib.sha256(lock).hexdigest()[:16]
    target.mkdir(parents=True, exist_ok=True)
    for name in _FILES:
        shutil.copyfile(NODE_DIR / name, target / name)
    if not (target / "node_modules" / "openai" / "package.json").is_file():
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error"], cwd=target, check=True,
                       capture_output=True, timeout=300)
    return target


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    s = start_stack(2, tenants=[{"name": "acme", "api_keys": ["sk-acme"]}])
    yield s
    s.close()


def test_node_sdk_chat_and_responses(stack: Stack) -> None:
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node and npm are needed for the Node SDK check")
    cwd = _sdk_dir()
    done = subprocess.run(["node", "sdk_check.mjs", stack.base_url, MODEL, "sk-acme"], cwd=cwd,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["chat"]["content"] and out["chat"]["finish"] == "length" and out["chat"]["completion_tokens"] == 5
    assert out["chat_stream"]["chunks"] == 6 and out["chat_stream"]["finish"] == "length"
    assert out["responses"]["id"].startswith("resp_kg1.") and out["responses"]["status"] == "incomplete"
    assert out["responses"]["text"] and out["responses"]["output_tokens"] == 6
    rs = out["responses_stream"]
    assert rs["types"][0] == "response.created" and rs["types"][-1] == "response.completed"
    assert rs["types"].count("response.output_text.delta") >= 1 and rs["text"] == rs["output_text"]
    assert rs["previous_response_id"] == out["responses"]["id"] and rs["id"].startswith("resp_kg1.")
    assert rs["cached_tokens"] > 0, "the continuation went to the replica holding the conversation"
    assert out["retrieved"] == {"id": rs["id"], "status": "completed"}
    assert out["forged"]["status"] == 404 and out["forged"]["code"] == "response_not_found"
    assert out["forged"]["name"] == "NotFoundError"
