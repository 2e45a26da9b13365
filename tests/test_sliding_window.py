"""Sliding-window attention (Mistral): the export masks keys that fell out of the window (against transformers in
test_export), the attention fusion carries the window, and every paged lowering — plain ops and omforge's kernel —
honours it on prefill, chunks and decodes far past the window."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from helpers import NUM_LAYERS, TINY_HF_CONFIGS, export_tiny, load_export
from omforge.passes import lower_ascend, manager, ops
from omforge.passes.pipeline import build
from omforge.runtime import kernels
from omforge.runtime.full_recompute import ExportedModel
from omforge.runtime.ort_executor import OrtExecutor
from omforge.runtime.step import SeqWork, build_step

WINDOW = TINY_HF_CONFIGS["mistral"]["sliding_window"]
BLOCK = 4


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_tiny(tmp_path_factory.mktemp("mistral-window"), "mistral")


def test_fusion_carries_the_window(mistral: Path) -> None:
    model = load_export(mistral)
    manager.run_fusions(model)
    attn = [n for n in model.graph if n.domain == ops.DOMAIN and n.op_type == "Attention"]
    assert len(attn) == NUM_LAYERS and all(n.attributes["window"].value == WINDOW for n in attn)
    with pytest.raises(ValueError, match="sliding-window attention .* not supported on the ascend target"):
        lower_ascend.lower(model)


@pytest.mark.parametrize("kernel", [False, True], ids=["plain", "kernel"])
def test_paged_step_honours_the_window(mistral: Path, tmp_path: Path, kernel: bool) -> None:
    if kernel and not kernels.status().available:
        pytest.skip(f"kernel library: {kernels.status().reason}")
    ref = ExportedModel(mistral)
    report = build(mistral, tmp_path / "step.onnx", block_size=BLOCK, kernel=kernel)
    assert report.extra["paged_attention"] == ("kernel" if kernel else "plain")
    ex = OrtExecutor(tmp_path / "step.onnx", report.layout, num_blocks=64)
    ids = [int(t) for t in np.random.default_rng(0).integers(3, 256, 2 * WINDOW + 5)]
    table = list(range(40, 60))
    # a prefill longer than the window in two chunks, then decodes further past it
    first = 2 * WINDOW - 3
    ex.run(build_step([SeqWork(ids[:WINDOW], 0, table)], BLOCK))
    logits = ex.run(build_step([SeqWork(ids[WINDOW:first], WINDOW, table)], BLOCK))
    np.testing.assert_allclose(logits[0], ref.logits(np.array([ids[:first]]))[0, -1], atol=1e-4)
    for n in range(first, len(ids)):
        logits = ex.run(build_step([SeqWork(ids[n:n + 1], n, table)], BLOCK))
        np.testing.assert_allclose(logits[0], ref.logits(np.array([ids[:n + 1]]))[0, -1], atol=1e-4)
