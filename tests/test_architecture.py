"""The layout's rules, read from the source (docs/layout.md says why each holds).

* ``routing/``, ``semantic_cache/`` and ``policies/`` never import ``gateway``: the
  gateway composes them, never the other way round.
* ``gateway/`` keeps at most 10 top-level modules; the rest lives in role packages,
  each opening with a docstring that says what it holds.
* The hot path (``gateway/proxy/``) serves OpenAI's chat family and nothing else:
  it imports no API package and its endpoint names no other protocol; each API
  subclasses ``ProxyEndpoint`` in ``gateway/apis/``.
* The product never imports the simulator or the benchmarks at module level (the
  ``demo`` and ``sim`` commands import ``vllm_sim`` when they run), and ``bench/``
  is not in the wheel.
* No import cycles among the modules, counting imports inside functions too.
"""

from __future__ import annotations

import ast
import gc
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("gateway", "routing", "semantic_cache", "policies", "vllm_sim")
PRODUCT = ("gateway", "routing", "semantic_cache", "policies")
LIBRARIES = ("routing", "semantic_cache", "policies")
MAX_TOP_LEVEL = 10


def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (its file, whether it is a package's __init__)."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


MODULES = _modules()


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(name: str, *, lazy: bool) -> set[str]:
    """What ``name`` imports when it runs: its module-level imports, and with ``lazy`` those in
    its functions too; never the ones under ``if TYPE_CHECKING``. ``from pkg import mod`` names
    the module; anything outside the project keeps its full dotted name."""
    path, is_pkg = MODULES[name]
    package = name if is_pkg else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and _type_checking(node):
                continue
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    module = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    module = node.module or ""
                for alias in node.names:
                    sub = f"{module}.{alias.name}"
                    found.add(sub if sub in MODULES else module)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if lazy:
                    visit(node.body)
                continue
            for field in ("body", "orelse", "finalbody", "handlers"):
                children = getattr(node, field, None)
                if isinstance(children, list):
                    visit(children)

    visit(_parse(path.read_text()).body)
    found.discard(name)
    return found


def _parse(source: str) -> ast.Module:
    """``ast.parse`` with the collector paused: on CPython 3.11 a collection inside the parse can run
    a leftover task's finalizer whose traceback parses too, and the nested parse fails the outer one
    (docs/gen_reference.py's ``_collector_paused`` says more)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return ast.parse(source)
    finally:
        if enabled:
            gc.enable()


def _root(module: str) -> str:
    return module.split(".", 1)[0]


def test_libraries_never_import_the_gateway() -> None:
    offenders = {name: sorted(m for m in _imports(name, lazy=True) if _root(m) == "gateway")
                 for name in MODULES if _root(name) in LIBRARIES}
    assert not {k: v for k, v in offenders.items() if v}


def test_gateway_keeps_few_top_level_modules_and_documents_each_package() -> None:
    top = sorted(p.name for p in (ROOT / "gateway").glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL, top
    packages = [p for p in (ROOT / "gateway").rglob("__init__.py") if p.parent != ROOT / "gateway"]
    assert {p.parent.name for p in packages} >= {"proxy", "apis", "admin", "observe", "server"}
    for init in packages:
        tree = _parse(init.read_text())
        assert ast.get_docstring(tree), f"{init.relative_to(ROOT)} says nothing about what it holds"


def test_the_hot_path_serves_no_other_protocol() -> None:
    hot = [name for name in MODULES if name.startswith("gateway.proxy")]
    assert "gateway.proxy.endpoint" in hot
    for name in hot:
        reaches = sorted(m for m in _imports(name, lazy=True)
                         if m.startswith(("gateway.apis", "gateway.admin", "gateway.server")))
        assert not reaches, f"{name} imports {reaches}"
    source = MODULES["gateway.proxy.endpoint"][0].read_text().lower()
    for word in ("anthropic", "messages", "count_tokens", "/v1/responses"):
        assert word not in source, f"gateway/proxy/endpoint.py names {word!r}: that branch belongs in gateway/apis"
    for name in ("gateway.middleware", "gateway.proxy.relay"):
        assert not any(m.startswith("gateway.apis") for m in _imports(name, lazy=True)), name


def test_the_product_imports_neither_the_simulator_nor_the_benchmarks_at_module_level() -> None:
    for name in MODULES:
        if _root(name) in PRODUCT:
            dev = sorted(m for m in _imports(name, lazy=False) if _root(m) in ("vllm_sim", "bench"))
            assert not dev, f"{name} imports {dev} at module level"
        if _root(name) == "vllm_sim":
            assert not any(_root(m) == "bench" for m in _imports(name, lazy=True)), name
    # And in a process: the apps and the kvgate command's parser load neither.
    probe = ("import sys, gateway.app, gateway.admin.api, gateway.server.cli as cli; cli.build_parser(); "
             "print(sorted({m.split('.')[0] for m in sys.modules} & {'vllm_sim', 'bench'}))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_bench_is_not_in_the_wheel() -> None:
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    assert not any(pattern.startswith("bench") for pattern in find["include"])


def test_no_import_cycles() -> None:
    graph = {name: {m for m in _imports(name, lazy=True) if m in MODULES} for name in MODULES}
    # Tarjan's strongly connected components: any component of two or more is a cycle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            connect(v)
    assert not cycles, cycles
    assert graph["gateway.app"], "the import graph is empty: the scan is broken"
