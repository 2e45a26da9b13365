"""The paged step graph: prefill, decode, mixed and chunked steps against the unfused full-recompute graph."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from helpers import TINY_RECIPE
from omforge.compile.ort import build
from omforge.contract import DECODE_GROUP_INPUTS, STEP_INPUTS, cdiv
from omforge.export.onnx_export import export_recipe
from omforge.recipe import load_recipe
from omforge.runtime.full_recompute import ExportedModel
from omforge.runtime.ort.ort_executor import OrtExecutor
from omforge.runtime.step import SeqWork, build_step

BLOCK = 4  # small blocks so short tests cross many block boundaries


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    root = tmp_path_factory.mktemp("paged")
    export_recipe(load_recipe(TINY_RECIPE), root / "export", quiet=True)
    report = build(root / "export", root / "step" / "model.onnx", block_size=BLOCK)
    return ExportedModel(root / "export"), root / "step" / "model.onnx", report


def fresh(tiny, num_blocks: int = 64) -> OrtExecutor:  # noqa: ANN001
    _, path, report = tiny
    return OrtExecutor(path, report.layout, num_blocks=num_blocks)


def last_logits(ref: ExportedModel, ids: list[int]) -> np.ndarray:
    return ref.logits(np.array([ids]))[0, -1]


def test_abi_inputs_and_outputs(tiny) -> None:  # noqa: ANN001
    _, path, report = tiny
    model = onnx.load(str(path), load_external_data=False)
    names = [i.name for i in model.graph.input]
    assert names[:len(STEP_INPUTS)] == list(STEP_INPUTS)
    layers = report.layout.num_layers
    assert names[len(STEP_INPUTS):] == [f"{k}_cache.{i}" for i in range(layers) for k in ("key", "value")] + list(
        DECODE_GROUP_INPUTS)
    outs = [o.name for o in model.graph.output]
    assert outs == ["logits"] + [f"{k}_cache_out.{i}" for i in range(layers) for k in ("key", "value")]
    assert report.layout.block_size == BLOCK and report.layout.kv_heads == 2 and report.layout.head_dim == 16


def test_prefill_then_decode_matches_full_recompute(tiny) -> None:  # noqa: ANN001
    ref = tiny[0]
    ex = fresh(tiny)
    rng = np.random.default_rng(0)
    ids = [int(t) for t in rng.integers(3, 256, 23)]
    table = [9, 2, 40, 7, 13, 5, 31, 60, 1, 22]  # scattered, out of order
    logits = ex.run(build_step([SeqWork(ids, 0, table)], BLOCK))
    for _ in range(16):
        np.testing.assert_allclose(logits[0], last_logits(ref, ids), atol=1e-5)
        ids.append(int(logits[0].argmax()))
        logits = ex.run(build_step([SeqWork(ids[-1:], len(ids) - 1, table)], BLOCK))


def test_chunked_prefill_equals_one_shot(tiny) -> None:  # noqa: ANN001
    ref = tiny[0]
    ex = fresh(tiny)
    ids = [int(t) for t in np.random.default_rng(1).integers(3, 256, 30)]
    table = list(range(20, 30))
    for lo, hi in ((0, 7), (7, 20), (20, 30)):
        logits = ex.run(build_step([SeqWork(ids[lo:hi], lo, table)], BLOCK))
        np.testing.assert_allclose(logits[0], last_logits(ref, ids[:hi]), atol=1e-5)


@pytest.mark.parametrize("split_decodes", [False, True])
def test_mixed_step_of_prefill_chunks_and_decodes(tiny, split_decodes: bool) -> None:  # noqa: ANN001
    """One execution carries a decode, a prefill chunk and a whole prompt of three sequences; with
    ``split_decodes`` the decode is attended in the decode group (unpadded), with the same logits."""
    ref = tiny[0]
    ex = fresh(tiny)
    rng = np.random.default_rng(2)
    a, b, c = ([int(t) for t in rng.integers(3, 256, n)] for n in (12, 17, 9))
    ta, tb, tc = [3, 4, 5, 6], [10, 11, 12, 13, 14], [20, 21, 22]
    ex.run(build_step([SeqWork(a[:11], 0, ta), SeqWork(b[:6], 0, tb)], BLOCK))
    step = build_step([SeqWork(a[11:], 11, ta), SeqWork(b[6:], 6, tb), SeqWork(c, 0, tc)], BLOCK,
                      split_decodes=split_decodes)
    assert step["query_index"].shape == ((2, 11) if split_decodes else (3, 11))
    logits = ex.run(step)
    assert logits.shape == (3, 256)
    for row, seq in enumerate((a, b, c)):
        np.testing.assert_allclose(logits[row], last_logits(ref, seq), atol=1e-5)


def test_decode_group_of_several_decodes_beside_a_chunk(tiny) -> None:  # noqa: ANN001
    """Four decodes at different context lengths in the decode group, a 20-token chunk in the main group."""
    ref = tiny[0]
    ex = fresh(tiny)
    rng = np.random.default_rng(3)
    seqs = [[int(t) for t in rng.integers(3, 256, n)] for n in (3, 40, 9, 70)]
    ids = iter(range(1, 64))
    tables = [[next(ids) for _ in range(cdiv(len(s), BLOCK))] for s in seqs]
    ex.run(build_step([SeqWork(s[:-1], 0, t) for s, t in zip(seqs, tables)], BLOCK))
    chunk = [int(t) for t in rng.integers(3, 256, 20)]
    work = [SeqWork(s[-1:], len(s) - 1, t) for s, t in zip(seqs, tables)] + [
        SeqWork(chunk, 0, [next(ids) for _ in range(cdiv(20, BLOCK))])]
    step = build_step(work[:2] + work[4:] + work[2:4], BLOCK, split_decodes=True)  # the chunk between decodes
    assert step["decode_query_index"].shape == (4, 1) and step["query_index"].shape == (1, 20)
    logits = ex.run(step)
    for row, seq in enumerate(seqs[:2] + [chunk] + seqs[2:]):
        np.testing.assert_allclose(logits[row], last_logits(ref, seq), atol=1e-5)


def test_logits_only_for_requested_rows(tiny) -> None:  # noqa: ANN001
    ref = tiny[0]
    ex = fresh(tiny)
    a, b = [5, 6, 7, 8, 9], [10, 11, 12]
    step = build_step([SeqWork(a, 0, [1, 2]), SeqWork(b, 0, [3], needs_logits=False)], BLOCK)
    logits = ex.run(step)
    assert logits.shape == (1, 256)  # only sequence a samples (b is a prefill chunk that is not finished)
    np.testing.assert_allclose(logits[0], last_logits(ref, a), atol=1e-5)


@pytest.mark.parametrize("kv_write", ["runtime", "graph"])
def test_kv_written_at_its_slots_only(tiny, kv_write: str, tmp_path: Path) -> None:  # noqa: ANN001
    ref, _, _ = tiny
    report = build(ref.export_dir, tmp_path / "model.onnx", block_size=BLOCK, kv_write=kv_write)
    ex = OrtExecutor(tmp_path / "model.onnx", report.layout, num_blocks=16)
    assert ex.runtime_write == (kv_write == "runtime")
    before = [p.copy() for p in ex.key_pools]
    step = build_step([SeqWork([5, 6, 7, 8, 9, 10], 0, [7, 3])], BLOCK)
    ex.run(step)
    written = set(step["slot_mapping"].tolist())
    for old, pool in zip(before, ex.key_pools):
        flat_old, flat_new = old.reshape(16 * BLOCK, -1), pool.reshape(16 * BLOCK, -1)
        changed = {s for s in range(16 * BLOCK) if not np.array_equal(flat_old[s], flat_new[s])}
        assert changed == written  # the pool array itself was updated, nowhere else


def test_smollm2_paged_matches_unfused(smollm2_export: Path, tmp_path: Path) -> None:
    """Acceptance: prefill then 16 decode steps within 1e-4 of the unfused full recompute; greedy identical."""
    # ORT's MatMul, as the unfused reference runs it: this checks the paging (MatMulF32's own sums, in k order,
    # drift 1.1e-4 from MLAS's: test_matmul_f32.py)
    report = build(smollm2_export, tmp_path / "model.onnx", block_size=16, float_gemm="MatMul")
    assert all(report.fusion_counts[f] > 0 for f in report.fusion_counts if f != "moe")  # dense: no MoE block
    ex = OrtExecutor(tmp_path / "model.onnx", report.layout, num_blocks=32)
    ref = ExportedModel(smollm2_export)
    text = ref.tokenizer.apply_chat_template([{"role": "user", "content": "Name three planets of the solar system."}])
    ids = ref.tokenizer.encode(text, add_special_tokens=False)
    table = [4, 17, 9, 30, 2, 11]
    logits = ex.run(build_step([SeqWork(ids, 0, table)], 16))
    worst = 0.0
    for _ in range(17):
        full = last_logits(ref, ids)
        worst = max(worst, float(np.abs(full - logits[0]).max()))
        assert int(full.argmax()) == int(logits[0].argmax())
        ids.append(int(logits[0].argmax()))
        logits = ex.run(build_step([SeqWork(ids[-1:], len(ids) - 1, table)], 16))
    assert worst <= 1e-4, worst


def test_paged_graph_with_every_fusion_off(tiny, tmp_path: Path) -> None:  # noqa: ANN001
    """The switches off: the paged pass still finds attention (the cache must go somewhere), plain ops elsewhere."""
    from omforge.recipe import FUSIONS

    ref, _, _ = tiny
    report = build(ref.export_dir, tmp_path / "model.onnx", fusions={f: False for f in FUSIONS}, block_size=BLOCK)
    assert set(report.fusion_counts.values()) == {0}
    ops = report.op_histogram
    assert "Attention" not in ops and "RMSNormalization" not in ops and "ScatterND" in ops
    ex = OrtExecutor(tmp_path / "model.onnx", report.layout, num_blocks=16)
    ids = [7, 8, 9, 10, 11, 12, 13]
    logits = ex.run(build_step([SeqWork(ids, 0, [3, 1])], BLOCK))
    np.testing.assert_allclose(logits[0], last_logits(ref, ids), atol=1e-5)
