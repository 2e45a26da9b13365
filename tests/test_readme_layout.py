"""The README's Layout (issue 61): every module of the package is named under its folder, and every folder and
module it names exists — a hand-written layout that drifts by one feature a round fails here instead."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SKIP = {"tests", "benchmarks", "scripts", "docs", "build", "deploy"}


def layout() -> dict[str, str]:
    """The Layout section's entries: folder (``""`` for the root, ``"runtime/ort"``) → its text. An entry starts at an
    unindented line whose first word is the folder (``./`` the root); indented lines continue it."""
    section = (ROOT / "README.md").read_text().split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    block = section.split("```\n", 2)[1]
    entries: dict[str, str] = {}
    key = None
    for line in block.splitlines():
        if line and not line[0].isspace():
            key = line.split()[0].rstrip("/").removeprefix(".")
            entries[key] = line[len(line.split()[0]):]
        elif key is not None:
            entries[key] += " " + line.strip()
    return entries


def defines_something(init: Path) -> bool:
    """An ``__init__.py`` with a function, a class or an assignment of its own (not only a docstring, imports and
    ``__all__``): a module worth naming."""
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            return True
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(not (isinstance(t, ast.Name) and t.id == "__all__") for t in targets):
                return True
    return False


def modules() -> list[Path]:
    """Every module of the package (the tests, benchmarks and scripts are not), relative to the root."""
    found = []
    for f in sorted(ROOT.rglob("*.py")):
        rel = f.relative_to(ROOT)
        if rel.parts[0] in SKIP or rel.parts[0].startswith(".") or rel.parts[0].endswith(".egg-info"):
            continue
        if f.name != "__init__.py" or defines_something(f):
            found.append(rel)
    return found


def entry_of(folder: str, entries: dict[str, str]) -> str | None:
    """The entry naming a module of ``folder``: the folder's own, else its nearest listed parent's."""
    parts = folder.split("/") if folder else []
    while True:
        key = "/".join(parts)
        if key in entries:
            return key
        if not parts:
            return None
        parts.pop()


def named(name: str, text: str) -> bool:
    return re.search(rf"(?<![\w./]){re.escape(name)}(?!\w)", text) is not None


def test_every_module_is_named_under_its_folder() -> None:
    entries = layout()
    missing = []
    for rel in modules():
        folder = "" if rel.parent == Path(".") else rel.parent.as_posix()
        key = entry_of(folder, entries)
        if key is None or not named(rel.name, entries[key]):
            missing.append(f"{rel} (under {key + '/' if key else './'})")
    assert not missing, f"the README's Layout does not name: {', '.join(missing)}"


def test_every_folder_and_module_it_names_exists() -> None:
    stale = []
    for key, text in layout().items():
        folder = ROOT / key
        if not folder.is_dir():
            stale.append(f"{key}/")
            continue
        for name in set(re.findall(r"(?<![\w./])(\w+\.py)\b", text)):
            if not any(folder.rglob(name)):
                stale.append(f"{key}/{name}" if key else name)
    assert not stale, f"the README's Layout names what does not exist: {', '.join(sorted(stale))}"
    assert {"", "contract", "passes", "compile", "runtime", "serve"} <= set(layout())
