"""The build: kvgate is pure Python; the routing decision's modules are also compiled when they can be.

``routing._native`` says which modules and why. mypyc compiles them from the
same typed source, type-checking them against the installed dependencies, so
it runs in the project's environment once they are there: ``make install``
runs ``python setup.py build_ext --inplace`` after installing the package.
Without mypyc or a C compiler, or with ``KVGATE_INTERPRETED=1``, or if
compiling fails, kvgate runs interpreted (same decisions, about twice the
routing cost) and says so. A wheel built in an isolated environment, which
has no mypyc, is the interpreted package.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def _native():  # routing._native without importing the package (its imports need the dependencies)
    spec = importlib.util.spec_from_file_location("_kvgate_native", ROOT / "routing" / "_native.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _warn(message: str) -> None:
    print(f"kvgate: {message}; routing runs interpreted (same decisions, slower)", file=sys.stderr)


class _OptionalBuildExt(build_ext):
    """A failed compile leaves the interpreted package, never a failed install; a compile that
    succeeded leaves the digest of its sources beside the extensions (``routing._native.fresh``)."""

    def run(self) -> None:
        native = _native()
        built = (ROOT if self.inplace else Path(self.build_lib)) / "routing" / native.BUILT
        built.unlink(missing_ok=True)  # until this compile succeeds, no extension here is trusted
        self._failed = False
        try:
            super().run()
        except Exception as err:  # noqa: BLE001 - any compiler failure means "install interpreted"
            _warn(f"compiling the routing modules failed ({err})")
            return
        if self.extensions and not self._failed:
            built.parent.mkdir(parents=True, exist_ok=True)
            built.write_text(native.sources_digest(ROOT / "routing") + "\n")

    def build_extension(self, ext) -> None:  # type: ignore[no-untyped-def]
        try:
            super().build_extension(ext)
        except Exception as err:  # noqa: BLE001
            self._failed = True
            _warn(f"compiling {ext.name} failed ({err})")


def _extensions() -> list:
    if os.environ.get("KVGATE_INTERPRETED", "") not in ("", "0"):
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:
        return []  # an isolated build (pip's default): the interpreted package
    native = _native()
    paths = [f"routing/{name}.py" for name in native.COMPILED]
    cwd = os.getcwd()
    os.chdir(ROOT)  # mypyc resolves module names from the paths given
    try:
        return mypycify(paths, opt_level="3", group_name=native.GROUP)
    except (Exception, SystemExit) as err:  # noqa: BLE001 - mypy's errors exit: fall back
        _warn(f"mypyc could not compile the routing modules ({err})")
        return []
    finally:
        os.chdir(cwd)


setup(ext_modules=_extensions(), cmdclass={"build_ext": _OptionalBuildExt})
