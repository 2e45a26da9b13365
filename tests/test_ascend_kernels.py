"""Issue 44 item 3: the Ascend lowering emits a fused CANN op only where its kernel ships for ``soc_version``.

Before: ``NPURotaryPositionEmbedding`` (and RmsNorm / AddRmsNorm / SwiGlu) were emitted for every SoC, so ATC
would fail at op selection on Atlas 300I/310P (no RotaryPositionEmbedding kernel) and 200I/500 A2 (310B: none of
them); the table is passes/ascend/kernels.py, read from CANN's ops repositories.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest

from helpers import TINY_RECIPE
from omforge.cli import main
from omforge.export.onnx_export import export_recipe
from omforge.passes import manager
from omforge.passes.ascend import kernels as ascend_kernels
from omforge.passes.ascend import lower as lower_ascend
from omforge.passes.paged_kv import insert_paged_kv
from omforge.recipe import load_recipe

FUSED = {"OmRmsNorm", "OmAddRmsNorm", "OmRotaryPositionEmbedding", "SwiGlu"}
EXPECTED = {  # soc_version → the fused op types its step graph holds
    "Ascend910B3": FUSED,
    "Ascend910_9392": FUSED,
    "Ascend310P3": FUSED - {"OmRotaryPositionEmbedding"},
    "Ascend310B1": set(),
}


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("kernels") / "export"
    export_recipe(load_recipe(TINY_RECIPE), out, quiet=True)
    return out


def lowered(export_dir: Path, soc: str, plain: bool = False) -> tuple[ir.Model, lower_ascend.AscendLowering]:
    model = ir.load(export_dir / "model.onnx")
    manager.run_fusions(model)
    insert_paged_kv(model, 16)
    result = lower_ascend.lower(model, soc_version=soc, plain=plain, num_slots=64)
    manager.cleanup(model)
    return model, result


@pytest.mark.parametrize("soc", sorted(EXPECTED))
def test_fused_ops_follow_the_socs_kernels(export_dir: Path, soc: str) -> None:
    model, result = lowered(export_dir, soc)
    emitted = {n.op_type for n in model.graph} & (FUSED | set(lower_ascend.SPECS))
    assert emitted == EXPECTED[soc]
    assert set(result.custom_ops) == EXPECTED[soc]
    assert result.options["soc_version"] == soc
    fell_back = {"RMSNorm": "OmRmsNorm", "AddRMSNorm": "OmAddRmsNorm", "Rotary": "OmRotaryPositionEmbedding",
                 "SwiGLU": "SwiGlu"}
    assert {fell_back[op] for op in result.kernel_fallbacks} == FUSED - EXPECTED[soc]
    for op, why in result.kernel_fallbacks.items():  # one line naming the kernel, the chip and the source
        assert soc in why and "hicann/ops-" in why and "\n" not in why, (op, why)


def test_all_plain_lowering_on_310b_computes_what_the_plain_twin_does(export_dir: Path, tmp_path: Path) -> None:
    """The 310B graph (no fused kernel) is standard ONNX: it runs on ORT and equals ``plain=True``."""
    graphs = {}
    for name, plain in (("soc", False), ("twin", True)):
        model, _ = lowered(export_dir, "Ascend310B1", plain=plain)
        ir.save(model, tmp_path / f"{name}.onnx", external_data=f"{name}.onnx.data")
        graphs[name] = ort.InferenceSession(str(tmp_path / f"{name}.onnx"), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    feeds = {}
    for value in graphs["twin"].get_inputs():
        if value.name == "input_ids":
            feeds[value.name] = rng.integers(0, 256, (1, 5), dtype=np.int64)
        elif value.name == "kv_cache":
            feeds[value.name] = rng.standard_normal((64, *value.shape[1:]), dtype=np.float32)
    assert set(feeds) == {"input_ids", "kv_cache"}
    feeds |= {"position_ids": np.arange(5, dtype=np.int64)[None], "block_tables": np.array([[0]], np.int32),
              "query_index": np.arange(5, dtype=np.int64)[None], "token_index": np.arange(5, dtype=np.int64),
              "logits_indices": np.array([4], np.int64)}
    feeds = {i.name: feeds[i.name].astype({"tensor(int32)": np.int32, "tensor(int64)": np.int64,
                                           "tensor(float)": np.float32}[i.type]) for i in graphs["twin"].get_inputs()}
    a, b = (graphs[k].run(None, feeds) for k in ("soc", "twin"))
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-6)


def test_soc_family_names() -> None:
    assert [ascend_kernels.soc_family(s) for s in ("Ascend910B3", "Ascend910B4-1", "Ascend910_9392", "Ascend310P3",
                                                    "Ascend310B1", "Ascend910ProB", "Ascend610")] == \
        ["ascend910b", "ascend910b", "ascend910_93", "ascend310p", "ascend310b", "ascend910", None]
    for row in ascend_kernels.KERNELS.values():
        assert row.families <= set(ascend_kernels.FAMILIES)  # a CANN ops repo, or a named mirror at a commit
        assert row.source.startswith(("hicann/ops-", "libochao-huawei/ops-transformer 5778144", "ONNX Gather"))


def test_compile_for_310p_emits_no_rotary_kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bundle itself: --soc_version Ascend310P3 in the ATC command, no RotaryPositionEmbedding node."""
    monkeypatch.setenv("OMFORGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(TINY_RECIPE.read_text() + "  target: ascend\n  soc_version: Ascend310P3\n")
    assert main(["compile", str(recipe), "-o", str(tmp_path / "b")]) == 3
    step = onnx.load(str(tmp_path / "b" / "ascend" / "step.onnx"), load_external_data=False)
    ops = {n.op_type for n in step.graph.node}
    assert "OmRotaryPositionEmbedding" not in ops and {"OmRmsNorm", "SwiGlu"} <= ops
    assert "--soc_version=Ascend310P3" in (tmp_path / "b" / "ascend" / "atc_commands.txt").read_text()
