"""The compiled routing modules (``routing._native``): the same decisions as the source, never stale."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from routing import _native

ROOT = Path(__file__).resolve().parent.parent


def _decisions(seed: int, interpreted: bool, policy: str) -> str:
    env = {**os.environ, "KVGATE_INTERPRETED": "1" if interpreted else ""}
    probe = ("import sys, routing._native as n; from tests.support.decisions import run; "
             f"print(n.compiled()); print('\\n'.join(run({seed}, 4000, {policy!r})))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    mode, _, decisions = out.partition("\n")
    assert mode == str(not interpreted), "the process did not run the build it was asked for"
    return decisions


@pytest.mark.skipif(not _native.compiled(), reason="routing is not compiled here (no mypyc or C compiler)")
@pytest.mark.parametrize("policy", ["prefix_affinity", "ttft"])
@pytest.mark.parametrize("seed", [1, 2])
def test_compiled_and_interpreted_routing_decide_alike(seed: int, policy: str) -> None:
    compiled, interpreted = _decisions(seed, False, policy), _decisions(seed, True, policy)
    assert compiled.count("\n") > 1500  # thousands of decisions, over every replica
    assert len({line.split()[1] for line in compiled.splitlines()}) == 5
    assert compiled == interpreted


def test_a_source_changed_since_the_compile_means_no_module_runs_compiled(tmp_path: Path) -> None:
    suffix = ".cpython-311-x86_64-linux-gnu.so"
    for name in _native.COMPILED:
        (tmp_path / f"{name}.py").write_text(f"# {name}\n")
        (tmp_path / f"{name}{suffix}").write_text("")
    library = tmp_path / f"native__mypyc{suffix}"
    library.write_text("")
    assert not _native.fresh(tmp_path, (suffix,))  # no digest: no compile known to have succeeded
    (tmp_path / _native.BUILT).write_text(_native.sources_digest(tmp_path) + "\n")
    assert _native.fresh(tmp_path, (suffix,))
    (tmp_path / "keys.py").write_text("# keys, edited after the build\n")  # a checkout, an edit
    assert not _native.fresh(tmp_path, (suffix,))
    (tmp_path / "keys.py").write_text("# keys\n")
    assert _native.fresh(tmp_path, (suffix,))
    (tmp_path / f"hotness{suffix}").unlink()  # a module the build could not compile
    assert not _native.fresh(tmp_path, (suffix,))
    (tmp_path / f"hotness{suffix}").write_text("")
    library.unlink()
    assert not _native.fresh(tmp_path, (suffix,))


def test_from_source_the_compiled_names_load_their_py() -> None:
    spec = _native.FromSource.find_spec("routing.keys")
    assert spec is not None and spec.origin == str(ROOT / "routing" / "keys.py")
    assert _native.FromSource.find_spec("routing.settings") is None  # never compiled: the usual import
    assert _native.FromSource.find_spec("gateway.keys") is None
