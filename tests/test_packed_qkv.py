"""passes/packed_qkv.py: the kernel attention takes the QKV projection as it is (no Split, head transposes or
RotaryEmbedding nodes) — on a one-layer graph against its unfused run, on compiled bundles, with the qkv_merge
fusion off (q, k, v apart), and left alone where a value on the chain has another use or a reshape is not the
heads' split."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

from helpers import TINY_RECIPE, compile_bundle, write_recipe
from kernel_reference import INPUTS, kernel_session
from omforge.passes import packed_qkv
from omforge.runtime.llm import LLM
from omforge.runtime.ort import kernels
from omforge.runtime.sampling_params import SamplingParams
from omforge.runtime.step import SeqWork, build_step

pytestmark = pytest.mark.skipif(not kernels.status().available, reason=f"kernel library: {kernels.status().reason}")
HQ, HKV, D, BS = 4, 2, 16, 16


def one_layer(extra_use: bool = False) -> onnx.ModelProto:
    """qkv → Split → Reshape/Transpose ×3 → RotaryEmbedding (q, k) → PagedAttention → Transpose → Reshape → y, as the
    ORT kernel lowering leaves a layer; ``extra_use``: the rotated q is also a graph output."""
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    W = (HQ + 2 * HKV) * D
    inits = [helper.make_tensor("sizes", i64, [3], [HQ * D, HKV * D, HKV * D]),
             helper.make_tensor("q_shape", i64, [4], [1, -1, HQ, D]),
             helper.make_tensor("kv_shape", i64, [4], [1, -1, HKV, D]),
             helper.make_tensor("flat", i64, [3], [1, -1, HQ * D])]
    nodes = [helper.make_node("Split", ["qkv", "sizes"], ["q3", "k3", "v3"], axis=-1)]
    for name, shape in (("q", "q_shape"), ("k", "kv_shape"), ("v", "kv_shape")):
        nodes += [helper.make_node("Reshape", [f"{name}3", shape], [f"{name}4"]),
                  helper.make_node("Transpose", [f"{name}4"], [f"{name}h"], perm=[0, 2, 1, 3])]
    nodes += [helper.make_node("RotaryEmbedding", [f"{n}h", "cos", "sin"], [f"{n}r"], interleaved=0) for n in "qk"]
    nodes += [helper.make_node("PagedAttention", ["qr", "kr", "vh", *INPUTS[3:]], ["o", "kc_out", "vc_out"],
                               domain=kernels.DOMAIN, scale=D ** -0.5, q_heads=HQ, kv_heads=HKV, block_size=BS,
                               window=0),
              helper.make_node("Transpose", ["o"], ["ot"], perm=[0, 2, 1, 3]),
              helper.make_node("Reshape", ["ot", "flat"], ["y"])]
    inputs = [helper.make_tensor_value_info("qkv", f, [1, "T", W]),
              *(helper.make_tensor_value_info(n, f, [1, "T", D // 2]) for n in ("cos", "sin")),
              *(helper.make_tensor_value_info(n, f, ["S", HKV, D]) for n in INPUTS[3:5]),
              *(helper.make_tensor_value_info(n, i64, None) for n in INPUTS[5:])]
    outputs = [helper.make_tensor_value_info(n, f, None) for n in ("y", "kc_out", "vc_out")]
    if extra_use:
        outputs.append(helper.make_tensor_value_info("qr", f, None))
    graph = helper.make_graph(nodes, "layer", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid(kernels.DOMAIN, 1)],
                             ir_version=10)


def feeds(rng: np.random.Generator) -> dict[str, np.ndarray]:
    step = build_step([SeqWork([1] * 20, 13, [3, 1, 7]), SeqWork([2], 40, [0, 2, 5]), SeqWork([3] * 5, 0, [6])], BS)
    T = step["input_ids"].shape[1]
    angles = step["position_ids"][0, :, None] * 10000.0 ** (-np.arange(D // 2) * 2 / D)
    f = {k: step[k] for k in INPUTS[5:]}
    f.update(qkv=rng.standard_normal((1, T, (HQ + 2 * HKV) * D), dtype=np.float32),
             cos=np.cos(angles).astype(np.float32)[None], sin=np.sin(angles).astype(np.float32)[None],
             key_cache=rng.standard_normal((8 * BS, HKV, D), dtype=np.float32),
             value_cache=rng.standard_normal((8 * BS, HKV, D), dtype=np.float32))
    return f


def test_one_layer_folds_into_the_kernel_and_computes_the_same() -> None:
    proto = one_layer()
    model = ir.from_proto(proto)
    assert packed_qkv.fuse(model.graph, ("PagedAttention",)) == 1
    ops = [n.op_type for n in model.graph]
    assert ops == ["PagedAttention"], ops
    node = next(iter(model.graph))
    assert node.inputs[0].name == "qkv" and node.inputs[1] is None and node.inputs[2] is None
    assert [v.name for v in node.inputs[12:]] == ["cos", "sin"]
    assert [v.name for v in model.graph.outputs] == ["y", "kc_out", "vc_out"]
    f = feeds(np.random.default_rng(0))
    want = kernel_session(proto).run(None, f)
    got = kernel_session(ir.to_proto(model)).run(None, f)
    assert got[0].shape == want[0].shape
    np.testing.assert_allclose(got[0], want[0], atol=1e-5, rtol=1e-5)  # RotaryEmbedding's rounding (FMA or not)
    np.testing.assert_allclose(got[1], want[1], atol=1e-6, rtol=1e-6)
    np.testing.assert_array_equal(got[2], want[2])  # v is copied, never rotated


def other_split_of_heads() -> onnx.ModelProto:
    """q's reshape declared as [1, T, 2·Hq, D/2]: not q's heads (the kernel would read it as Hq heads of D)."""
    proto = one_layer()
    proto.graph.value_info.append(helper.make_tensor_value_info("q4", TensorProto.FLOAT, [1, "T", 2 * HQ, D // 2]))
    return proto


@pytest.mark.parametrize("proto", [one_layer(extra_use=True), other_split_of_heads()], ids=["shared", "heads"])
def test_a_layer_it_cannot_prove_is_left_alone(proto: onnx.ModelProto) -> None:
    model = ir.from_proto(proto)
    before = [n.op_type for n in model.graph]
    assert packed_qkv.fuse(model.graph, ("PagedAttention",)) == 0
    assert [n.op_type for n in model.graph] == before


def step_nodes(bundle: Path) -> list[onnx.NodeProto]:
    return list(onnx.load(str(bundle / "ort" / "step.onnx"), load_external_data=False).graph.node)


def test_bundles_hand_the_projection_to_the_kernel_with_or_without_qkv_merge(tmp_path: Path) -> None:
    """Merged QKV: one packed input; qkv_merge off: q, k and v as three 3-D inputs — rotary folded in both, and both
    bundles give the same greedy tokens."""
    cache = tmp_path / "cache"
    merged = compile_bundle(TINY_RECIPE, tmp_path / "merged", cache)
    import yaml

    spec = yaml.safe_load(TINY_RECIPE.read_text())
    apart_recipe = write_recipe(tmp_path / "apart.yaml", spec["model"],
                                compile={**spec.get("compile", {}), "fusions": {"qkv_merge": False}})
    apart = compile_bundle(apart_recipe, tmp_path / "apart", cache)
    for bundle, packed in ((merged, True), (apart, False)):
        nodes = step_nodes(bundle)
        attention = [n for n in nodes if n.op_type == "PagedAttention"]
        assert len(attention) == 2
        assert "RotaryEmbedding" not in {n.op_type for n in nodes}
        assert not [n for n in nodes if n.op_type == "Transpose" and list(n.attribute[0].ints) == [0, 2, 1, 3]]
        assert "Split" not in {n.op_type for n in nodes}
        producers = {out: n.op_type for n in nodes for out in n.output}
        for n in attention:
            assert len(n.input) == 14 and n.input[12] and n.input[13]
            operands = n.input[:1] if packed else n.input[:3]
            assert (n.input[1] == n.input[2] == "") is packed
            # the projections as they are (ORT's MatMul, or the kernel library's on float32 panels)
            assert {producers[x] for x in operands} <= {"MatMul", "MatMulF32"}
    prompts = [[int(t) for t in range(3 + i, 30 + 5 * i)] for i in range(4)]
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    tokens = [[o.token_ids for o in LLM(b).generate(prompts, greedy, use_tqdm=False)] for b in (merged, apart)]
    assert tokens[0] == tokens[1]
