"""Shared fixtures: anyio on asyncio, a real Redis (REDIS_URL or a private one), a Redis Cluster, vLLM."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator

import pytest
from hypothesis import settings as hypothesis_settings

# Property tests check invariants, not speed: a busy 2-core CI machine must not
# turn a slow example into a failure (speed lives in bench/).
hypothesis_settings.register_profile("kvgate", deadline=None)
hypothesis_settings.load_profile("kvgate")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tests.support.minilm import shared_minilm  # noqa: E402
from tests.support.redis_cluster import PrivateRedisCluster  # noqa: E402
from tests.support.redis_server import PrivateRedis, redis_url_from_env  # noqa: E402
from tests.support.vllm_env import BACKGROUND_NICE, VLLM, RenderServer, VllmWorker, need_vllm  # noqa: E402


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def redis_service() -> Iterator[str]:
    """A Redis URL for the session. Tests flush only keys under their own prefix/db."""
    url = redis_url_from_env()
    if url:
        yield url
        return
    server = PrivateRedis().start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def private_redis() -> Iterator[PrivateRedis]:
    """A Redis this test may kill or pause (never the shared one)."""
    server = PrivateRedis().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[PrivateRedisCluster]:
    """A private 3-primary Redis Cluster for the session (``.url`` is ``redis+cluster://…``).
    Tests keep to their own key prefixes; nothing else uses it."""
    cluster = PrivateRedisCluster().start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def minilm() -> Any:
    """all-MiniLM-L6-v2, loaded once per run (offline: it raises if it would need the network);
    stacks built with ``start_stack`` share the same model."""
    return shared_minilm()


# The test files that use vLLM's own code (its interpreter or its render server), and those that
# start processes of their own (a kvgate, a fleet, a CLI): seconds each, however few their tests.
_TEST_TEXTS = {f"tests/{p.name}": p.read_text(encoding="utf-8") for p in Path(__file__).parent.glob("test_*.py")}
_VLLM_FILES = frozenset(f for f, text in _TEST_TEXTS.items()
                        if any(name in text for name in ("vllm_worker", "vllm_render", "vllm_tokdir")))
_PROCESS_FILES = frozenset(f for f, text in _TEST_TEXTS.items()
                           if any(call in text for call in ("start_kvgate(", "start_fleet(", "subprocess.", "Popen")))


try:
    from xdist.scheduler import LoadFileScheduling
except ImportError:  # pragma: no cover - the test extra installs xdist
    pass
else:
    class _VllmTogether(LoadFileScheduling):
        """Whole test files to each worker, as ``--dist loadfile`` does, except that the files using
        vLLM go to one worker together: starting vLLM's interpreter and render server costs about 30
        CPU-seconds, paid once rather than once per worker."""

        _ordered = False

        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "vllm" if path in _VLLM_FILES else path

        def _assign_work_unit(self, node: Any) -> None:
            # Longest first, so no long file starts last while the other worker idles: vLLM's
            # files and those that start processes, then the rest by their number of tests.
            if not self._ordered:
                self._ordered = True
                units = sorted(self.workqueue.items(),
                               key=lambda unit: (unit[0] != "vllm", unit[0] not in _PROCESS_FILES, -len(unit[1])))
                self.workqueue.clear()
                self.workqueue.update(units)
            super()._assign_work_unit(node)

    def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
        if config.getoption("dist") == "loadfile":
            return _VllmTogether(config, log)
        return None


# What of vLLM the collected tests use: (its interpreter, its render server).
_USED = [False, False]


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start vLLM's worker and render server in the background if the collected tests use them.
    Under xdist every worker collects every test: there only the worker that runs them starts
    vLLM, both parts at once, when a test first asks for either (``_start_vllm``)."""
    used = {name for item in session.items for name in getattr(item, "fixturenames", ())}
    _USED[:] = ["vllm_worker" in used, bool({"vllm_render", "vllm_tokdir"} & used)]
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if any(_USED):
        try:
            python = need_vllm()
        except pytest.skip.Exception:
            return  # the tests that need vLLM skip, saying why
        VLLM.start(python, worker=_USED[0], render=_USED[1], nice=BACKGROUND_NICE)


def _start_vllm() -> str:
    """vLLM's Python, with whatever of vLLM this run uses started (or starting)."""
    python = need_vllm()
    VLLM.start(python, worker=_USED[0], render=_USED[1])
    return python


def pytest_sessionfinish(session: pytest.Session) -> None:
    VLLM.close()


@pytest.fixture(scope="session")
def vllm_worker() -> VllmWorker:
    """vLLM's own Python, shared by every parity test (skips where vLLM is missing)."""
    return VLLM.worker(_start_vllm())


@pytest.fixture(scope="session")
def vllm_tokdir() -> Path:
    """The tokenizer directory (built from the MiniLM package) the render server serves."""
    VLLM.start(_start_vllm(), worker=False)
    assert VLLM.tokdir is not None
    return VLLM.tokdir


@pytest.fixture(scope="session")
def vllm_render() -> RenderServer:
    """vLLM's render server on ``vllm_tokdir``, serving the model ``parity-model``, for the whole run."""
    return VLLM.render(_start_vllm())
