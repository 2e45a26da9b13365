"""The import graph (issue 24): passes/ is a graph library beside runtime/, both on top of contract/; the build
(compile/, which imports nothing of runtime/: issue 61) and the diff tool (diff/) sit above them. Checked on the
sources with ``ast``, so lazy imports inside functions and type-only ones (under ``TYPE_CHECKING``) count as much
as the rest."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SKIP = {"tests", "benchmarks", "scripts", "docs", "build"}


def modules() -> dict[str, Path]:
    """Every omforge module by dotted name (``omforge.passes.manager``; a package by its ``__init__.py``)."""
    found = {}
    for f in sorted(ROOT.rglob("*.py")):
        parts = f.relative_to(ROOT).with_suffix("").parts
        if parts[0] in SKIP or parts[0].startswith(".") or parts[0].endswith(".egg-info"):
            continue
        found[".".join(["omforge", *(parts[:-1] if parts[-1] == "__init__" else parts)])] = f
    return found


def imports(name: str, path: Path) -> Iterator[str]:
    """The absolute names ``path`` imports anywhere in it (``from a import b`` gives ``a`` and ``a.b``)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join([*package[:len(package) - node.level + 1], *([node.module] if node.module else [])]) \
                if node.level else node.module or ""
            yield base
            yield from (f"{base}.{a.name}" for a in node.names)


def package(module: str) -> str:
    """The top-level unit a module belongs to: a folder (``omforge.passes``) or a root module (``omforge.recipe``)."""
    return ".".join(module.split(".")[:2])


def package_graph() -> dict[str, set[str]]:
    mods = modules()
    graph: dict[str, set[str]] = {package(m): set() for m in mods}
    for name, path in mods.items():
        graph[package(name)] |= {package(i) for i in imports(name, path) if i in mods and package(i) != package(name)}
    return graph


def test_passes_import_nothing_of_runtime_serve_compile_or_diff() -> None:
    forbidden = ("omforge.runtime", "omforge.serve", "omforge.compile", "omforge.diff")
    mods = modules()
    found = [f"{path.relative_to(ROOT)}: {i}" for name, path in mods.items() if package(name) == "omforge.passes"
             for i in imports(name, path) if i.startswith(forbidden)]
    assert not found, found


def import_circles(graph: dict[str, set[str]]) -> list[str]:
    """Every back edge a depth-first walk of ``graph`` finds, as the circle it closes (``a → b → a``)."""
    state: dict[str, str] = {}
    circles: list[str] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                circles.append(" → ".join([*path[path.index(nxt):], nxt]))
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return circles


def test_no_import_circle_among_packages() -> None:
    """No package reaches itself through the others (depth-first search for a back edge)."""
    graph = package_graph()
    circles = import_circles(graph)
    assert not circles, circles
    assert "omforge.passes" in graph and "omforge.diff" in graph  # the walk saw the packages it is about


def test_compile_imports_nothing_of_runtime() -> None:
    """The build reads the kernel library's status and ABI from contract/ (issue 61), never the runtime."""
    mods = modules()
    found = [f"{path.relative_to(ROOT)}: {i}" for name, path in mods.items() if package(name) == "omforge.compile"
             for i in imports(name, path) if i.startswith("omforge.runtime")]
    assert not found, found
    assert "omforge.compile.compiler" in mods and "omforge.compile.ort" in mods


def test_no_import_circle_among_modules_of_any_package() -> None:
    """Module by module inside each package (issue 45: the scheduler and its admission mixin imported each other):
    every import counts, type-only and lazy ones included."""
    mods = modules()
    circles = []
    for pkg in sorted({package(m) for m in mods}):
        inside = {m: p for m, p in mods.items() if package(m) == pkg}
        circles += import_circles({m: {i for i in imports(m, p) if i in inside and i != m} for m, p in inside.items()})
    assert not circles, circles
    assert "omforge.runtime.kv_connector" in mods and "omforge.compile.compiler" in mods


def test_every_runtime_module_imports_first() -> None:
    """Each runtime module imported first into a fresh set of omforge modules (one interpreter, the modules purged
    between): an import circle at run time fails here whatever order the static walk saw."""
    import subprocess
    import sys

    names = sorted(m for m in modules() if m.startswith("omforge.runtime"))
    script = ("import importlib, sys\n"
              f"for name in {names!r}:\n"
              "    for m in [m for m in sys.modules if m == 'omforge' or m.startswith('omforge.')]:\n"
              "        del sys.modules[m]\n"
              "    importlib.import_module(name)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
