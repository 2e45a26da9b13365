"""The in-place ascend step graph (``paged_attention="inplace"``, issue 60): per-SoC structure (ScatterPaKvCache →
FusedInferAttentionScore, the write feeding the read, no pool among the outputs, no kv_new), its plain twin on ORT
against the ORT step graph, the per-SoC / dtype fallbacks with their reasons, and the gather path's ops."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest

from helpers import TINY_RECIPE
from omforge.compile.ort import build
from omforge.contract.ascend import REF_SUFFIX, SEQ_LENS_KV, SEQ_LENS_Q
from omforge.export.onnx_export import export_recipe
from omforge.passes import decompose, manager
from omforge.passes.ascend import kernels
from omforge.passes.ascend import lower as lower_ascend
from omforge.passes.paged_kv import insert_paged_kv
from omforge.recipe import load_recipe
from omforge.runtime.ort.ort_executor import OrtExecutor
from omforge.runtime.step import SeqWork, build_step

BLOCK, BLOCKS = 16, 16  # FIA: block size a multiple of 16 in float16 (V4 doc :1936)
LAYERS, HEADS, KV_HEADS, HEAD_DIM = 2, 4, 2, 16  # tests/recipes/tiny-llama.yaml


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("inplace") / "export"
    export_recipe(load_recipe(TINY_RECIPE), out, quiet=True)
    return out


def lowered(export_dir: Path, **options: object) -> tuple[ir.Model, lower_ascend.AscendLowering]:
    model = ir.load(export_dir / "model.onnx")
    manager.run_fusions(model)
    insert_paged_kv(model, BLOCK)
    result = lower_ascend.lower(model, num_slots=BLOCKS * BLOCK, **options)
    manager.cleanup(model)
    return model, result


def nodes(model: ir.Model, op_type: str) -> list[ir.Node]:
    return [n for n in model.graph if n.op_type == op_type]


def test_910b_inplace_graph_writes_then_reads_the_pools(export_dir: Path) -> None:
    model, result = lowered(export_dir, paged_attention="inplace", soc_version="Ascend910B3")
    proto = ir.to_proto(model)
    assert [(o.domain, o.version) for o in proto.opset_import] == [("", 18)] and not proto.functions
    inputs = {v.name: v for v in model.graph.inputs}
    pools = [f"{kind}_cache.{n}" for n in range(LAYERS) for kind in ("key", "value")]
    assert result.ref_inputs == pools and result.new_kv_outputs == [] and result.removed_inputs == []
    for name in pools:
        assert list(inputs[name].shape) == [BLOCKS, BLOCK, KV_HEADS, HEAD_DIM]
    assert inputs["slot_mapping"].dtype == inputs["block_tables"].dtype == ir.DataType.INT32
    assert inputs[SEQ_LENS_Q].dtype == inputs[SEQ_LENS_KV].dtype == ir.DataType.INT64
    assert [o.name for o in model.graph.outputs] == ["logits"]  # no pool alias, no kv_new
    assert not nodes(model, "ScatterND") and not nodes(model, "Div")
    writes, reads = nodes(model, "OmScatterPaKvCache"), nodes(model, "OmFusedInferAttentionScore")
    assert len(writes) == len(reads) == LAYERS
    for layer, (write, read) in enumerate(zip(writes, reads)):
        assert [write.inputs[1].name, write.inputs[4].name] == [f"key_cache.{layer}", f"value_cache.{layer}"]
        assert write.inputs[2].name == "slot_mapping" and write.attributes["cache_mode"].value == "Norm"
        for out, fia_input in zip(write.outputs, read.inputs[1:3]):  # the write feeds the read (via a Reshape)
            assert fia_input.producer().op_type == "Reshape" and fia_input.producer().inputs[0] is out
            assert list(fia_input.shape or []) in ([], [BLOCKS, BLOCK, KV_HEADS * HEAD_DIM])
        assert len(read.inputs) == 15 and read.inputs[3] is None and set(read.inputs[7:14]) == {None}
        assert [read.inputs[i].name for i in (4, 5, 6, 14)] == ["fia_causal_mask", SEQ_LENS_Q, SEQ_LENS_KV,
                                                                "block_tables"]  # at their FIA IR indices
        assert {k: a.value for k, a in read.attributes.items()} == {
            "num_heads": HEADS, "num_key_value_heads": KV_HEADS, "scale": pytest.approx(HEAD_DIM ** -0.5),
            "input_layout": "BSH", "sparse_mode": 3, "block_size": BLOCK, "inner_precise": 0}
    mask = model.graph.initializers["fia_causal_mask"].const_value.numpy()
    assert mask.shape == (2048, 2048) and mask[0, 1] and not mask[1, 1] and not mask[1, 0]
    ops = result.custom_ops
    assert (ops["OmScatterPaKvCache"].ge_type, ops["OmFusedInferAttentionScore"].ge_type) == (
        "ScatterPaKvCache", "FusedInferAttentionScore")
    assert ops["OmFusedInferAttentionScore"].own_plugin and not ops["OmFusedInferAttentionScore"].own_kernel


@pytest.mark.parametrize("soc", ["Ascend310P3", "Ascend310B1", "Ascend999"])
def test_inplace_is_refused_where_its_kernels_do_not_ship(export_dir: Path, soc: str) -> None:
    with pytest.raises(ValueError, match=f"inplace' on {soc}: ScatterPaKvCache: no kernel ships"):
        lowered(export_dir, paged_attention="inplace", soc_version=soc)


@pytest.mark.parametrize(("soc", "dtype", "mode", "why"), [
    ("Ascend910B3", "float16", "inplace", "ScatterPaKvCache and FusedInferAttentionScore ship for Ascend910B3"),
    ("Ascend910_9392", "float16", "inplace", "ship for Ascend910_9392"),
    ("Ascend910B3", "float32", "gather", "FusedInferAttentionScore computes in float16/bfloat16/int8, the graph "
                                         "is float32"),
    ("Ascend310P3", "float16", "gather", "ScatterPaKvCache: no kernel ships for Ascend310P3 (ascend310p)"),
    ("Ascend310B1", "float16", "gather", "FusedInferAttentionScore: no kernel ships for Ascend310B1"),
    ("Ascend999", "float16", "gather", "a SoC family no row names"),
])
def test_auto_mode_per_soc_and_dtype(soc: str, dtype: str, mode: str, why: str) -> None:
    got, note = kernels.paged_attention_mode("auto", soc, dtype)
    assert got == mode and why in note and note.startswith(mode)


def test_explicit_modes() -> None:
    assert kernels.paged_attention_mode("gather", "Ascend910B3", "float16") == ("gather", "gather: the recipe chose it")
    assert kernels.paged_attention_mode("inplace", "Ascend910B3", "float16")[0] == "inplace"
    assert kernels.paged_attention_mode("readonly", "Ascend910B3", "float16")[0] == "readonly"
    with pytest.raises(ValueError, match="'readonly' cannot be built: FusedInferAttentionScore: no kernel ships"):
        kernels.paged_attention_mode("readonly", "Ascend310P3", "float16")
    with pytest.raises(ValueError, match="cannot be built: ScatterPaKvCache: no kernel ships for Ascend310P3"):
        kernels.paged_attention_mode("inplace", "Ascend310P3", "float16")
    with pytest.raises(ValueError, match="'inplace' cannot be built: FusedInferAttentionScore computes in"):
        kernels.paged_attention_mode("inplace", "Ascend910B3", "float32")


def inplace_feeds(work: list[SeqWork], step: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The in-place step inputs from the ORT ABI's: int32 slots and tables, the FIA lengths of each sequence."""
    return {**step, "slot_mapping": step["slot_mapping"].astype(np.int32),
            "block_tables": step["block_tables"].astype(np.int32),
            SEQ_LENS_Q: np.array([len(w.token_ids) for w in work], np.int64),
            SEQ_LENS_KV: np.array([w.start + len(w.token_ids) for w in work], np.int64)}


def test_twin_matches_the_ort_step_graph(export_dir: Path, tmp_path: Path) -> None:
    """The twin (what the FAKE pyACL runs) on ORT: logits equal the ORT step graph's, and what its ``.ref`` outputs
    write into the pools equals ORT's pools after each step (prefill over blocks, decodes, a chunk, a mixed step)."""
    report = build(export_dir, tmp_path / "ort" / "model.onnx", block_size=BLOCK)
    ref = OrtExecutor(tmp_path / "ort" / "model.onnx", report.layout, num_blocks=BLOCKS, threads=2)
    model, result = lowered(export_dir, paged_attention="inplace", plain=True, soc_version="Ascend910B3")
    assert not result.custom_ops and result.ref_inputs == [f"{k}_cache.{n}" for n in range(LAYERS)
                                                           for k in ("key", "value")]
    assert [o.name for o in model.graph.outputs] == ["logits", *(n + REF_SUFFIX for n in result.ref_inputs)]
    ir.save(model, tmp_path / "twin.onnx", external_data="twin.onnx.data")
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    sess = ort.InferenceSession(str(tmp_path / "twin.onnx"), opts, providers=["CPUExecutionProvider"])
    feeds = {i.name for i in sess.get_inputs()}
    outputs = [o.name for o in sess.get_outputs()]
    pools = {name: np.zeros((BLOCKS, BLOCK, KV_HEADS, HEAD_DIM), np.float32) for name in result.ref_inputs}

    def check(work: list[SeqWork]) -> np.ndarray:
        step = build_step(work, BLOCK)
        values = dict(zip(outputs, sess.run(None, {**{k: v for k, v in inplace_feeds(work, step).items()
                                                      if k in feeds}, **pools})))
        for name in pools:  # RefData: what the ref op wrote lands in the caller's buffer
            pools[name][...] = values[name + REF_SUFFIX]
        theirs = ref.run(step)
        np.testing.assert_allclose(values["logits"][0], theirs, atol=1e-5, rtol=0)
        for layer in range(LAYERS):
            np.testing.assert_allclose(pools[f"key_cache.{layer}"].reshape(-1), ref.key_pools[layer].reshape(-1),
                                       atol=1e-6)
            np.testing.assert_allclose(pools[f"value_cache.{layer}"].reshape(-1),
                                       ref.value_pools[layer].reshape(-1), atol=1e-6)
        return values["logits"][0]

    rng = np.random.default_rng(5)
    a = [int(t) for t in rng.integers(3, 256, 37)]
    ta, tb = [9, 2, 11, 5], [3, 14, 8]
    logits = check([SeqWork(a, 0, ta)])  # prefill across 3 blocks, out of order
    for _ in range(12):  # decodes, crossing into the next block
        a.append(int(logits[0].argmax()))
        logits = check([SeqWork(a[-1:], len(a) - 1, ta)])
    b = [int(t) for t in rng.integers(3, 256, 21)]
    check([SeqWork(b[:6], 0, tb, needs_logits=False)])  # a chunk, then the rest over its cached prefix
    a.append(int(logits[0].argmax()))
    mixed = check([SeqWork(a[-1:], len(a) - 1, ta), SeqWork(b[6:], 6, tb)])
    assert mixed.shape == (2, 256)


def test_gather_path_emits_no_scatternd_and_no_int64_division(export_dir: Path) -> None:
    model, result = lowered(export_dir, paged_attention="gather")
    assert result.new_kv_outputs == ["kv_new"] and not result.ref_inputs
    assert not nodes(model, "ScatterND") and not nodes(model, "Div")
    assert {"Gather", "Concat"} <= {n.op_type for n in model.graph}


def test_float16_scores_do_not_overflow_before_the_scale() -> None:
    """q·kᵀ of activations around 40 over head_dim 128 is ~2e5, above float16's 65504: with the scale applied after
    the MatMul the scores are inf and the softmax NaN; q scaled first keeps them finite."""
    heads, d, s = 2, 128, 4
    q, k, v = (ir.Value(name=n, shape=ir.Shape([1, heads, s, d]), type=ir.TensorType(ir.DataType.FLOAT16))
               for n in "qkv")
    builder = _Ops()
    out = decompose.causal_attention(builder, q, k, v, d ** -0.5, heads, heads, d)
    graph = ir.Graph([q, k, v], [out], nodes=builder.nodes, opset_imports={"": 18})
    out.name = "o"
    for node in graph:
        if node.op_type == "Constant" and "value_float" in node.attributes:  # the scale in float16, as CastToFloat16
            scale = np.float16(max(node.attributes["value_float"].value, float(np.finfo(np.float16).min)))
            node.attributes["value"] = ir.AttrTensor("value", ir.tensor(scale))
            del node.attributes["value_float"]
    # onnx's reference evaluator: numpy float16 arithmetic (ORT's CPU EP runs float16 MatMul in float32)
    from onnx.reference import ReferenceEvaluator

    big = np.full((1, heads, s, d), 40.0, np.float16)
    with np.errstate(over="ignore", invalid="ignore"):
        (o,) = ReferenceEvaluator(ir.to_proto(ir.Model(graph, ir_version=10))).run(None, {"q": big, "k": big, "v": big})
    assert np.isfinite(o).all() and np.allclose(o, 40.0)
    assert np.float16(40.0) * np.float16(40.0) * d > np.finfo(np.float16).max  # the unscaled score overflows


class _Ops:
    """The rewriter's ``op.X(...)`` builder over plain onnx_ir nodes (single-output ops)."""

    def __init__(self) -> None:
        self.nodes: list[ir.Node] = []

    def __getattr__(self, op_type: str):
        def make(*inputs: ir.Value, **attributes: object) -> ir.Value:
            self.nodes.append(ir.node(op_type, list(inputs), attributes=attributes))
            return self.nodes[-1].outputs[0]

        return make
