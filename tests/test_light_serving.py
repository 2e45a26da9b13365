"""Serving is light (the design card; issue 12 defect 4): a bundle loads and generates, and the server module
imports, with the export extra's modules unavailable; a command that needs the extra says which, in one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import TINY_RECIPE, compile_bundle

BLOCK_EXPORT = """
import importlib.abc, sys
BLOCKED = {"torch", "onnx_ir", "onnxscript", "onnxsim", "gguf", "safetensors", "transformers", "ml_dtypes"}
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)", name=name)
sys.meta_path.insert(0, Block())
"""


def run_blocked(code: str, cache: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **({"OMFORGE_CACHE_DIR": str(cache)} if cache else {})}
    return subprocess.run([sys.executable, "-c", BLOCK_EXPORT + code], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).parent, env=env)


@pytest.fixture(scope="module")
def tiny_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("light")
    return compile_bundle(TINY_RECIPE, root / "bundle", root / "cache")


def test_bundle_serves_without_the_export_extra(tiny_bundle: Path) -> None:
    r = run_blocked(f"""
import omforge.serve.server, omforge.serve.api
from omforge import LLM, SamplingParams
out = LLM({str(tiny_bundle)!r}).generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
assert len(out[0].token_ids) == 4
assert not BLOCKED & {{m.split(".")[0] for m in sys.modules}}, sorted(BLOCKED & set(sys.modules))
print("ok")
""")
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_compile_without_the_export_extra_names_it(tmp_path: Path) -> None:
    r = run_blocked(f"""
from omforge.cli import main
sys.exit(main(["compile", {str(TINY_RECIPE)!r}, "-o", {str(tmp_path / "b")!r}]))
""", cache=tmp_path / "cache")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-3000:]
    assert "needs the export extra" in lines[0] and "pip install" in lines[0] and "omforge compile" in lines[0]


def test_runtime_and_serve_import_nothing_of_passes_compile_export_or_diff() -> None:
    """The import graph (issue 12): serving reads bundles through omforge.contract; passes, compile and export are
    the compiler's, diff a tool above both. Checked on the sources with ``ast`` (lazy imports inside functions
    included)."""
    import ast

    root = Path(__file__).resolve().parent.parent
    forbidden = ("omforge.passes", "omforge.compile", "omforge.export", "omforge.diff")
    found = []
    for folder in ("runtime", "serve", "contract"):
        for f in sorted((root / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(f.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                found += [f"{f.relative_to(root)}: {n}" for n in names if n.startswith(forbidden)]
    assert not found, found
