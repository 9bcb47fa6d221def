"""Which routing modules are compiled (mypyc), and when the compiled build is not used.

The per-request path of the routing policies (render, hash, key, score, bound)
is plain typed Python. Interpreted, the default policy costs about 140 us a
decision on a 4K-token chat request; compiled by mypyc from the same source,
about 70 us (``bench.routing_prefer``), the difference between meeting the
gateway's overhead budget and not. ``ttft`` and its pool model are compiled
too: in process, with the caches warm, 67 us interpreted against 21 us
compiled (``bench.routing_prefer``, 2026-12-03). So ``setup.py`` compiles
these modules when it can (a C compiler and mypyc are there) and installs them interpreted when it cannot:
the same source either way, so the same decisions (``tests/test_routing_native.py``
compares the two).

A compiled module is an extension next to its source, and Python imports the
extension first. After an edit (a checkout, a local change) the extension
would run stale code, so the compiled build is used only while every source
in ``COMPILED`` is the one it was compiled from (a digest of them, written by
``setup.py`` beside the extensions; file times would not do, since a wheel's
install sets them in any order); otherwise (and always with
``KVGATE_INTERPRETED=1``, for debugging and for the parity test) every one of
them is imported from source. All or none: compiled modules call each other
directly, past their Python modules, so a mix would run stale code too.
``make install`` recompiles.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Sequence

__all__ = ["COMPILED", "FromSource", "compiled", "fresh", "install"]

# The decision's hot path, and only modules whose every import is interpreted-safe.
COMPILED = ("backlog", "block_index", "boundary", "chains", "hashing", "hotness", "keys", "messages_view",
            "pool_model", "prefix_affinity", "rendezvous", "ttft_affinity", "ttft_inputs", "ttft_learned")
# The package's compiled group (mypyc's shared library: routing/native__mypyc.*.so).
GROUP = "routing.native"
# Written beside them by a successful compile: the digest of the sources compiled.
BUILT = "_native_built.txt"

_HERE = Path(__file__).resolve().parent
_state: list[bool] = []


def _extension(here: Path, name: str, suffixes: Sequence[str]) -> Path | None:
    for suffix in suffixes:
        path = here / f"{name}{suffix}"
        if path.exists():
            return path
    return None


def sources_digest(here: Path = _HERE) -> str:
    """What the compiled build was made from: a digest of every ``COMPILED`` source."""
    h = hashlib.sha256()
    for name in COMPILED:
        h.update(name.encode() + b"\0" + (here / f"{name}.py").read_bytes() + b"\0")
    return h.hexdigest()


def fresh(here: Path = _HERE, suffixes: Sequence[str] = tuple(importlib.machinery.EXTENSION_SUFFIXES)) -> bool:
    """Every compiled module there, with the group's library (where their code is), built from
    these very sources (``setup.py`` writes their digest after a compile that succeeded)."""
    library = _extension(here, GROUP.rpartition(".")[2] + "__mypyc", suffixes)
    if library is None or any(_extension(here, name, suffixes) is None for name in COMPILED):
        return False
    try:
        built = (here / BUILT).read_text().strip()
    except OSError:
        return False
    return built == sources_digest(here)


class FromSource:
    """A meta-path finder that imports ``routing.<name>`` for ``COMPILED`` names from their ``.py``."""

    @staticmethod
    def find_spec(fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        package, _, name = fullname.rpartition(".")
        if package != "routing" or name not in COMPILED:
            return None
        return importlib.util.spec_from_file_location(fullname, _HERE / f"{name}.py")


def install() -> bool:
    """Decide, once per process before any compiled module is imported: compiled or from source."""
    if not _state:
        suffixes = importlib.machinery.EXTENSION_SUFFIXES
        asked = os.environ.get("KVGATE_INTERPRETED", "") not in ("", "0")
        use = not asked and fresh()
        if not use and any(_extension(_HERE, n, suffixes) for n in COMPILED):
            if not asked:
                logging.getLogger("kvgate.routing").warning(
                    "routing's compiled modules were built from other sources: running it interpreted "
                    "(same decisions, slower); `make install` recompiles")
            sys.meta_path.insert(0, FromSource())  # type: ignore[arg-type]
        _state.append(use)
    return _state[0]


def compiled() -> bool:
    """Whether this process runs the compiled build (for ``GET /admin/routing`` and the tests)."""
    return install()


if __name__ == "routing._native":  # not when setup.py reads the list
    install()  # on import: ``routing/__init__.py`` imports this module before any other
