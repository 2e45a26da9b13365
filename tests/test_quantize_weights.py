"""Weight-only quantization in the ort pipeline (passes/quantize_weights.py) and through compile and serving:
the quantized graph computes exactly the model whose weights are the dequantized ones (every group, tied
embedding gathered from the lm_head's table), the recipe validates what a target can run, a tiny int4 bundle
generates, and SmolLM2 built from its own Q4_1 blocks matches the float32 export of the same blocks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest

from helpers import SMOLLM2_RECIPE, TINY_RECIPE, compile_bundle, export_feeds, load_export, run_model
from omforge.errors import OmforgeError
from omforge.passes import gemm_pack, manager, quant
from omforge.passes.options import QuantizeOptions
from omforge.passes.pipeline import Pipeline
from omforge.passes.quantize_weights import QuantizeWeights, group_of, parts_of
from omforge.recipe import load_recipe
from omforge.runtime.ort import kernels


def test_groups_and_merged_parts() -> None:
    assert group_of("model.layers.3.self_attn.qkv_proj.weight") == "attention"
    assert group_of("model.layers.3.mlp.down_proj.weight") == "mlp"
    assert group_of("model.embed_tokens.weight") == group_of("lm_head.weight") == "lm_head"
    assert group_of("model.norm.weight") is None
    assert parts_of("model.layers.0.mlp.gate_up_proj.weight") == ["model.layers.0.mlp.gate_proj.weight",
                                                                  "model.layers.0.mlp.up_proj.weight"]
    assert parts_of("model.layers.0.self_attn.o_proj.weight") == ["model.layers.0.self_attn.o_proj.weight"]


def _dequantized_reference(fused: ir.Model, qpass: QuantizeWeights) -> np.ndarray:
    """The reference: logits of the float graph ``fused`` with every weight ``qpass`` quantized replaced by its
    dequantized values (the export feeds of seed 3)."""
    for source, packed in qpass._packed.items():
        w = quant.dequantize(packed)
        value = fused.graph.initializers.get(f"{source}.T") or fused.graph.initializers[source]
        value.const_value = ir.tensor(np.ascontiguousarray(w.T if value.name.endswith(".T") else w), name=value.name)
    return run_model(fused, export_feeds(seed=3))[0]


@pytest.mark.parametrize(("bits", "symmetric", "group", "level", "tol"),
                         [(4, False, 32, 0, 1e-4), (4, True, 64, 0, 1e-4), (8, True, 32, 4, 3e-2)])
def test_quantized_graph_is_the_dequantized_model(tiny_exports: dict[str, Path], bits: int, symmetric: bool,
                                                  group: int, level: int, tol: float) -> None:
    """Every attention, MLP and (tied) lm_head weight becomes MatMulNBits, the embedding a gather of quantized
    rows; the logits equal those of the float graph whose weights are the dequantized values: to float32
    rounding at accuracy level 0, within int8 activation rounding at level 4 (8-bit runs only there)."""
    for variant in ("llama", "qwen2"):  # tied embedding + q/k/v bias; untied lm_head
        export = tiny_exports[variant]
        options = {"bits": bits, "group_size": group, "symmetric": symmetric, "accuracy_level": level}
        fused, quantized = load_export(export), load_export(export)
        Pipeline("ort").run(fused)
        run = Pipeline("ort", quantize=QuantizeOptions(**options)).run(quantized)
        qpass = next(p for p in run.passes if isinstance(p, QuantizeWeights))
        ops = [n.op_type for n in quantized.graph]
        assert ops.count("MatMulNBits") == 2 * 4 + 1, variant  # 2 layers x (qkv, o, gate_up, down) + lm_head
        assert not [n for n in quantized.graph if n.op_type == "MatMul" and n.inputs[1] is not None
                    and (n.inputs[1].name or "").endswith(".T")]
        assert all(v["bits"] == bits and v["source"].startswith("rtn") for v in run.quantized.values())
        ref, got = _dequantized_reference(fused, qpass), run_model(quantized, export_feeds(seed=3))[0]
        assert np.abs(got - ref).max() <= tol * np.abs(ref).max(), variant


@pytest.mark.skipif(kernels.status().weight_layout is None, reason="the kernel library's MatMulQ is unavailable")
@pytest.mark.parametrize(("bits", "symmetric", "group"), [(4, False, 32), (4, True, 128), (8, True, 64)])
def test_kernel_gemm_graph_is_the_dequantized_model(tiny_exports: dict[str, Path], bits: int, symmetric: bool,
                                                    group: int) -> None:
    """gemm "kernel": every quantized weight MatMul is one MatMulQ (affine blocks too: no offset MatMul is left),
    and the logits are those of the float graph on the dequantized weights within int8 activation rounding."""
    for variant in ("llama", "qwen2"):
        export = tiny_exports[variant]
        options = {"bits": bits, "group_size": group, "symmetric": symmetric, "accuracy_level": 4, "gemm": "kernel"}
        fused, quantized = load_export(export), load_export(export)
        Pipeline("ort").run(fused)
        run = Pipeline("ort", quantize=QuantizeOptions(**options)).run(quantized)
        qpass = next(p for p in run.passes if isinstance(p, QuantizeWeights))
        ops = [n.op_type for n in quantized.graph]
        assert ops.count("MatMulQ") == 2 * 4 + 1 and "MatMulNBits" not in ops, variant
        assert not [n for n in quantized.graph if n.op_type == "MatMul"]  # no block_min MatMuls either
        ref, got = _dequantized_reference(fused, qpass), run_model(quantized, export_feeds(seed=3))[0]
        assert np.abs(got - ref).max() <= 3e-2 * np.abs(ref).max(), variant


def _tied_graph(table: np.ndarray) -> ir.Model:
    """``ids [B, S] → (Gather(table, ids), x [M, K] @ Transpose(table))``: a tied embedding and its lm_head."""
    v, k = table.shape
    ids = ir.Value(name="ids", type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape(["B", "S"]))
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(["M", k]))
    w = ir.Value(name="model.embed_tokens.weight", const_value=ir.tensor(table, name="model.embed_tokens.weight"))
    gather = ir.node("Gather", [w, ids], name="embed")
    transpose = ir.node("Transpose", [w], attributes={"perm": [1, 0]}, name="lm_head_tied_transpose")
    matmul = ir.node("MatMul", [x, transpose.outputs[0]], name="lm_head")
    gather.outputs[0].name, matmul.outputs[0].name = "rows", "logits"
    graph = ir.Graph([ids, x], [gather.outputs[0], matmul.outputs[0]], nodes=[gather, transpose, matmul],
                     initializers=[w], opset_imports={"": 23})
    return ir.Model(graph, ir_version=10)


@pytest.mark.skipif(kernels.status().weight_layout is None, reason="the kernel library is unavailable")
@pytest.mark.parametrize("bits", [32, 16])
@pytest.mark.parametrize("k", [37, 32])
def test_a_tied_table_is_gathered_from_the_lm_head_panels(bits: int, k: int) -> None:
    """bits 32 / 16: the lm_head is MatMulF32 / MatMulBF16 and the tied embedding's rows come from its panels (the
    table itself is gone): exactly the table's rows (float32), or their bfloat16 rounding (bfloat16: what every
    weight of such a bundle is), an odd K and a vocabulary that is not a whole number of panels included (K 32:
    16 bfloat16 k pairs a panel, as many as its columns)."""
    rng = np.random.default_rng(5)
    table = rng.standard_normal((53, k)).astype(np.float32)
    model = _tied_graph(table)
    QuantizeWeights(bits=bits, embedding="float", gemm="kernel")(model)
    manager.Cleanup()(model)  # as the pipeline does after it: the lm_head's Transpose goes, and the table with it
    assert "model.embed_tokens.weight" not in model.graph.initializers
    assert {n.op_type for n in model.graph} >= {"GatherElements", "MatMulF32" if bits == 32 else "MatMulBF16"}
    ids = np.array([[0, 52, 16, 17], [31, 15, 1, 48]], np.int64)
    x = rng.standard_normal((3, k)).astype(np.float32)
    rows, logits = run_model(model, {"ids": ids, "x": x})
    want = table if bits == 32 else gemm_pack.unpack_bf16(gemm_pack.pack_bf16(table), 53, k)
    assert rows.shape == (2, 4, k) and np.array_equal(rows, want[ids])
    assert np.allclose(logits, x @ table.T, rtol=0, atol=(1e-4 if bits == 32 else 0.1))


@pytest.mark.skipif(kernels.status().weight_layout is None, reason="the kernel library's MatMulQ is unavailable")
@pytest.mark.parametrize(("bits", "symmetric", "k"), [(4, True, 70), (4, False, 70), (8, True, 70), (4, True, 512)])
def test_a_quantized_tied_table_is_gathered_from_the_lm_head_panels(bits: int, symmetric: bool, k: int) -> None:
    """gemm "kernel": the tied embedding's rows come from the lm_head's MatMulQ panels (no second copy of the
    blocks): exactly the dequantized rows the blocks stand for, affine blocks, a K padded to whole blocks and K 512
    (16 chunks a panel, as many as its columns) included."""
    rng = np.random.default_rng(6)
    table = rng.standard_normal((53, k)).astype(np.float32)
    model = _tied_graph(table)
    qpass = QuantizeWeights(bits=bits, group_size=32, symmetric=symmetric, accuracy_level=4, gemm="kernel")
    qpass(model)
    manager.Cleanup()(model)
    names = set(model.graph.initializers)
    assert "model.embed_tokens.weight" not in names and f"model.embed_tokens.weight.q{bits}" not in names
    assert {n.op_type for n in model.graph} >= {"GatherElements", "MatMulQ"}
    ids = np.array([[0, 52, 16, 17], [31, 15, 1, 48]], np.int64)
    rows, logits = run_model(model, {"ids": ids, "x": rng.standard_normal((3, k)).astype(np.float32)})
    want = quant.dequantize(qpass._packed["model.embed_tokens.weight"])
    assert rows.shape == (2, 4, k) and logits.shape == (3, 53) and np.array_equal(rows, want[ids])


@pytest.mark.skipif(kernels.status().weight_layout is None, reason="the kernel library's MatMulF32 is unavailable")
def test_float32_panels_hold_a_tied_table_once(tiny_exports: dict[str, Path]) -> None:
    """bits 32 on the tiny exports: every weight MatMul is MatMulF32; a tied embedding is gathered from the lm_head's
    panels (its table is gone from the graph), an untied one keeps its table; the logits are the float graph's to
    float32 summation order."""
    for variant, tied in (("qwen2", True), ("llama", False)):
        fused, packed = load_export(tiny_exports[variant]), load_export(tiny_exports[variant])
        Pipeline("ort").run(fused)
        Pipeline("ort", quantize=QuantizeOptions(bits=32, embedding="float", gemm="kernel")).run(packed)
        ops = [n.op_type for n in packed.graph]
        assert ops.count("MatMulF32") == 2 * 4 + 1, variant
        assert ("model.embed_tokens.weight" in packed.graph.initializers) is not tied, variant
        assert ("GatherElements" in ops) is tied, variant
        feeds = export_feeds(seed=3)
        ref, got = run_model(fused, feeds)[0], run_model(packed, feeds)[0]
        assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max(), variant


def test_8bit_stays_float_at_accuracy_level_0(tiny_exports: dict[str, Path]) -> None:
    model = load_export(tiny_exports["llama"])
    run = Pipeline("ort", quantize=QuantizeOptions(bits=8, accuracy_level=0)).run(model)
    assert "MatMulNBits" not in {n.op_type for n in model.graph}
    assert all(v["bits"] == 32 and "8-bit at accuracy_level 0 is slow" in v["source"] for v in run.quantized.values())


def test_recipe_refuses_what_cannot_run(tmp_path: Path) -> None:
    base = TINY_RECIPE.read_text()
    cases = {
        "weights: float16": "float16 weights are built for the ascend target",
        "weights: int8\n  quantization:\n    accuracy_level: 0": "accuracy_level 0 with int8 weights",
        "weights: int4\n  target: ascend": "int4 weights on ascend",
        "weights: int4\n  quantization:\n    group_size: 48": "group_size",
        "weights: int4\n  quantization:\n    matrices: [mlp, mlp]": "once",
        "quantization:\n    group_size: 64": "applies to weights int8 or int4",
    }
    for i, (setting, message) in enumerate(cases.items()):
        path = tmp_path / f"r{i}.yaml"
        path.write_text(base.replace("compile:\n", f"compile:\n  {setting}\n"))
        with pytest.raises(OmforgeError, match=message):
            load_recipe(path)


def test_tiny_int4_bundle_generates(tmp_path: Path) -> None:
    from omforge import LLM, SamplingParams

    recipe = tmp_path / "tiny-int4.yaml"
    recipe.write_text(TINY_RECIPE.read_text().replace("compile:\n", "compile:\n  weights: int4\n"))
    bundle = compile_bundle(recipe, tmp_path / "bundle", tmp_path / "cache")
    import json

    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["weights"]["precision"] == "int4"
    assert len(manifest["weights"]["quantized"]) == 2 * 4 + 1
    if kernels.status().weight_layout is not None:  # the kernel library's GEMM, its layout recorded
        assert manifest["passes"]["op_histogram"]["omforge.kernels::MatMulQ"] == 9
        assert manifest["weights"]["gemm"] == "MatMulQ"
        assert manifest["kernels"]["weight_layout"] == kernels.status().weight_layout
    else:
        assert manifest["passes"]["op_histogram"]["com.microsoft::MatMulNBits"] == 9
    with LLM(bundle) as llm:
        out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    assert len(out.token_ids) == 8
    if kernels.status().weight_layout is not None:  # a layout this library does not read: one line at load
        manifest["kernels"]["weight_layout"] = 99
        (bundle / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(OmforgeError, match=f"MatMulQ layout version 99, this kernel library reads version "
                                               f"{kernels.status().weight_layout}"):
            LLM(bundle)


def test_smollm2_from_its_own_q4_1_blocks(smollm2_cache: Path, smollm2_export: Path, smollm2_bundle: Path,
                                          tmp_path: Path) -> None:
    """The acceptance of issue 13 item 3: the int4 bundle takes the GGUF's Q4_1 blocks as they are (its Q8_0
    tied embedding stays exact: float32 at accuracy level 0) and matches the float32 export of the same blocks
    within float32 accumulation noise, with identical greedy text on 5 chat prompts."""
    import json

    from omforge.diff.bundles import CHAT_PROMPTS, diff_bundles

    recipe = tmp_path / "smollm2-int4.yaml"
    recipe.write_text(SMOLLM2_RECIPE.read_text().replace(
        "compile:\n", "compile:\n  weights: int4\n  quantization:\n    accuracy_level: 0\n"))
    bundle = compile_bundle(recipe, tmp_path / "bundle", smollm2_cache)
    quantized = json.loads((bundle / "manifest.json").read_text())["weights"]["quantized"]
    sources = sorted({v["source"] for v in quantized.values()})
    assert sum(v["source"] == "gguf Q4_1" for v in quantized.values()) == 30 * 4
    assert sources == ["float32 (gguf Q8_0 dequantized: 8-bit at accuracy_level 0 is slow)", "gguf Q4_1"]
    d = diff_bundles(smollm2_bundle, bundle, prompts=CHAT_PROMPTS[:5], max_tokens=24)
    assert max(p.max_abs for p in d.prompts) <= 1e-3
    assert all(p.identical_prefix == 24 for p in d.prompts)
