"""Sliding-window attention (Mistral): the export masks keys that fell out of the window (against transformers in
test_export), the attention fusion carries the window, and every paged lowering — plain ops and omforge's kernel —
honours it on prefill, chunks and decodes far past the window."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from helpers import NUM_LAYERS, TINY_HF_CONFIGS, compile_bundle, export_tiny, load_export, write_recipe
from omforge.compile.ort import build
from omforge.contract import cdiv
from omforge.passes import manager, ops
from omforge.passes.ascend import lower as lower_ascend
from omforge.runtime.full_recompute import ExportedModel
from omforge.runtime.kv_cache_manager import NO_BLOCK
from omforge.runtime.llm import LLM
from omforge.runtime.ort import kernels
from omforge.runtime.ort.ort_executor import OrtExecutor
from omforge.runtime.sampling_params import SamplingParams
from omforge.runtime.step import SeqWork, build_step

WINDOW = TINY_HF_CONFIGS["mistral"]["sliding_window"]
BLOCK = 4


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_tiny(tmp_path_factory.mktemp("mistral-window"), "mistral")


@pytest.fixture(scope="module")
def mistral_bundle(mistral: Path) -> Path:
    """A bundle of the tiny windowed Mistral (the HF directory export_tiny made beside its export)."""
    root = mistral.parent
    recipe = write_recipe(root / "bundle.yaml", {"name": "tiny-mistral", "source": "hf", "path": "hf"},
                          compile={"kv_block_size": BLOCK})
    return compile_bundle(recipe, root / "bundle", root / "cache")


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
    assert report.paged_attention == ("kernel" if kernel else "plain")
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


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_engine_frees_blocks_behind_the_window(mistral: Path, mistral_bundle: Path, mode: str) -> None:
    """Long generations keep at most the window's blocks per sequence, give the full-recompute tokens, and survive
    preemption (a swapped sequence moves only its live blocks)."""
    ref = ExportedModel(mistral)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 256, int(n)).tolist() for n in (30, 9, 17)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    llm = LLM(mistral_bundle, num_kv_blocks=20, preemption_mode=mode, swap_space_gb=0.01)
    engine, peak = llm.engine, 0  # the most live blocks one sequence held
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=str(i))
    outs = {}
    for _ in range(500):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.token_ids
        for req in engine.scheduler.running:
            peak = max(peak, sum(b != NO_BLOCK for b in engine.kv.block_table(req.request_id)))
        engine.kv.check_invariants()
    assert engine.stats.preemptions > 0  # 20 blocks: the three windows (8 blocks each at most) do not fit at once
    per_seq = cdiv(WINDOW, BLOCK) + 2  # the window's blocks, the partial one at each end
    assert peak <= per_seq < cdiv(30 + 40, BLOCK)
    for i, p in enumerate(prompts):
        assert outs[str(i)] == ref.greedy(p, 40, ignore_eos=True).token_ids
