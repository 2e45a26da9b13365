"""The manifest's ``kv.write`` says how a bundle writes its new KV rows: an in-place ascend bundle's rows are
written inside the OM (ScatterPaKvCache on RefData pools), a gather one's by the executor from ``kv_new``."""

from __future__ import annotations

from pathlib import Path

import pytest

from omforge.compile import compiler
from omforge.recipe import load_recipe

MODEL = "model:\n  name: t\n  source: random\n  config: {vocab_size: 8}\n"


@pytest.mark.parametrize(("compile_section", "inplace"), [
    ("target: ascend\n  weights: float16\n", True),
    ("target: ascend\n  weights: float16\n  paged_attention: gather\n", False),
    ("target: ascend\n  weights: float32\n", False),  # FIA takes no float32: auto keeps gather
    ("target: ascend\n  weights: float16\n  soc_version: Ascend310P3\n", False),  # no ScatterPaKvCache kernel
])
def test_kv_write_names_where_the_rows_are_written(tmp_path: Path, compile_section: str, inplace: bool) -> None:
    path = tmp_path / "r.yaml"
    path.write_text(MODEL + "compile:\n  " + compile_section)
    text = compiler._kv_write(load_recipe(path), "ascend", 128)
    assert ("in place inside the OM" in text and "no kv_new" in text) == inplace
    assert ("the graph returns kv_new" in text) == (not inplace)
    assert compiler._kv_write(load_recipe(path), "ort", 128) == compiler._KV_WRITE["ort"]
