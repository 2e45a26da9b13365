"""The MoE fusion (passes/moe.py) and the plain-op decomposition of ``omforge.MoE`` (passes/decompose.py): the exported
sparse MoE block becomes one MoE node per layer with the experts' weights stacked and no expert MatMul left, with
unchanged logits; a block that is not the pattern stays and says why; the decomposition equals the contract's float64
reference on ragged routing (an expert every token picks, one none picks), with and without renormalization; a
quantized MoE bundle in plain ops keeps its stacked experts float32 and says so, its routers float."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from moe_setup import EXPERTS, FFN, HIDDEN, LAYERS, TOP_K, moe_export, moe_reference
from onnx import helper, numpy_helper
from onnxscript.rewriter import pattern

from helpers import (
    FUSED_TOL,
    assert_fuses,
    assert_no_match,
    assert_same_logits,
    fused_ops,
    load_export,
    make_model,
    run_model,
)
from omforge.compile.ort import build
from omforge.passes import decompose, lower_ort, manager, moe

H, F, E, K = 16, 8, 4, 2  # the hand-built block: hidden, expert width, experts, top-k


def block_graph(normalize: bool = True, *, seed: int = 0, concat_axis: int = -2, largest: int = 1,
                down_input: bool = False, fill: float = 0.0,
                names: bool = False) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """The export's MoE block (models/llama.py ``SparseMoeBlock``, node for node) over ``x [2, 5, H]``; the knobs
    break one part of the pattern each: the stack's axis, TopK picking the smallest, expert 0's down weight a graph
    input, the routing scattered into ``fill`` instead of zeros; ``names``: the export's weight names
    (``model.layers.3.mlp.experts.<e>.<proj>.weight.T``)."""
    rng = np.random.default_rng(seed)
    feeds = {"x": rng.standard_normal((2, 5, H)).astype(np.float32)}

    def w(proj: str, e: int) -> str:
        return f"model.layers.3.mlp.experts.{e}.{proj}.weight.T" if names else f"{proj}{e}"

    inits = {"wr": rng.standard_normal((H, E)).astype(np.float32), "k": np.array([K], np.int64),
             "last": np.array([-1], np.int64), "stack_axis": np.array([-2], np.int64), "zero": np.float32(fill)}
    nodes = [
        helper.make_node("MatMul", ["x", "wr"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["probs"], axis=-1),
        helper.make_node("TopK", ["probs", "k"], ["topw", "topi"], axis=-1, largest=largest, sorted=1),
        helper.make_node("Shape", ["probs"], ["probs_shape"]),
        helper.make_node("Expand", ["zero", "probs_shape"], ["zeros"]),
    ]
    if normalize:
        nodes += [helper.make_node("ReduceSum", ["topw", "last"], ["topsum"], keepdims=1),
                  helper.make_node("Div", ["topw", "topsum"], ["topn"])]
    nodes.append(helper.make_node("ScatterElements", ["zeros", "topi", "topn" if normalize else "topw"], ["routing"],
                                  axis=-1, reduction="none"))
    for e in range(E):
        for proj, shape in (("gate_proj", (H, F)), ("up_proj", (H, F)), ("down_proj", (F, H))):
            (feeds if down_input and e == 0 and proj == "down_proj" else inits)[w(proj, e)] = (
                rng.standard_normal(shape).astype(np.float32) / 3)
        nodes += [
            helper.make_node("MatMul", ["x", w("gate_proj", e)], [f"g{e}"]),
            helper.make_node("Sigmoid", [f"g{e}"], [f"s{e}"]),
            helper.make_node("Mul", [f"g{e}", f"s{e}"], [f"a{e}"]),
            helper.make_node("MatMul", ["x", w("up_proj", e)], [f"u{e}"]),
            helper.make_node("Mul", [f"a{e}", f"u{e}"], [f"h{e}"]),
            helper.make_node("MatMul", [f"h{e}", w("down_proj", e)], [f"d{e}"]),
            helper.make_node("Unsqueeze", [f"d{e}", "stack_axis"], [f"q{e}"]),
        ]
    nodes += [
        helper.make_node("Concat", [f"q{e}" for e in range(E)], ["stack"], axis=concat_axis),
        helper.make_node("Unsqueeze", ["routing", "last"], ["routing4"]),
        helper.make_node("Mul", ["routing4", "stack"], ["weighted"]),
        helper.make_node("ReduceSum", ["weighted", "stack_axis"], ["y"], keepdims=0),
    ]
    return make_model(nodes, feeds, ["y"], inits, shapes={"x": ["batch", "seq", H]}), feeds


def weights_of(model: onnx.ModelProto, feeds: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    return {**{t.name: numpy_helper.to_array(t) for t in model.graph.initializer}, **(feeds or {})}


@pytest.mark.parametrize("normalize", [True, False], ids=["normalize", "no-normalize"])
def test_fuses_the_block_into_one_moe(normalize: bool) -> None:
    """One MoE node with the router MatMul left outside, weights stacked ``[E, H, 2F]`` / ``[E, F, H]`` (gate columns
    then up columns per expert), nothing of the block left; the fused-then-lowered graph computes the unfused one's
    outputs and the float64 reference's."""
    proto, feeds = block_graph(normalize)
    fused = assert_fuses(proto, moe.apply, feeds, 1, "MoE")
    (node,) = fused_ops(fused)
    assert node.attributes["top_k"].value == K and node.attributes["normalize"].value == int(normalize)
    x, logits, gate_up, down = node.inputs
    assert x.name == "x" and logits.producer().op_type == "MatMul" and logits.producer().inputs[1].name == "wr"
    w = weights_of(proto)
    np.testing.assert_array_equal(gate_up.const_value.numpy(), np.stack(
        [np.concatenate([w[f"gate_proj{e}"], w[f"up_proj{e}"]], axis=1) for e in range(E)]))
    np.testing.assert_array_equal(down.const_value.numpy(), np.stack([w[f"down_proj{e}"] for e in range(E)]))
    assert Counter(n.op_type for n in fused.graph) == {"MatMul": 1, "MoE": 1}
    ref = moe_reference(feeds["x"], feeds["x"] @ w["wr"], gate_up.const_value.numpy(), down.const_value.numpy(), K,
                        normalize)
    out = run_model(lowered_plain(fused), feeds)[0]
    assert float(np.abs(out - ref).max()) <= 1e-5


def test_stacked_weights_named_after_the_experts() -> None:
    proto, feeds = block_graph(names=True)
    fused = assert_fuses(proto, moe.apply, feeds, 1, "MoE")
    (node,) = fused_ops(fused)
    assert [v.name for v in node.inputs[2:]] == ["model.layers.3.mlp.experts.gate_up_proj.weight.T",
                                                 "model.layers.3.mlp.experts.down_proj.weight.T"]


@pytest.mark.parametrize(("knobs", "reason"), [
    ({"concat_axis": 0}, "the expert outputs are not stacked by a Concat on axis -2"),
    ({"largest": 0}, "TopK does not pick the largest along the last axis"),
    ({"down_input": True}, "the experts' weights are not constants of one shape"),
    ({"fill": 1.0}, "the routing scatter does not start from zeros shaped like the router's probabilities"),
])
def test_a_block_off_the_pattern_stays_and_says_why(knobs: dict, reason: str) -> None:
    proto, _ = block_graph(**knobs)
    blocks, misses = moe.match(ir.from_proto(proto).graph)
    assert not blocks and [m.reason for m in misses] == [reason]
    assert_no_match(proto, moe.apply)


def moe_node_graph(tokens: tuple[int, ...], normalize: bool, top_k: int) -> onnx.ModelProto:
    """One ``omforge.MoE`` node over graph inputs (the weights too)."""
    node = helper.make_node("MoE", ["x", "logits", "gate_up", "down"], ["y"], domain="omforge", top_k=top_k,
                            normalize=int(normalize))
    graph = helper.make_graph([node], "moe", [
        helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [*tokens, H]),
        helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, [*tokens, E]),
        helper.make_tensor_value_info("gate_up", onnx.TensorProto.FLOAT, [E, H, 2 * F]),
        helper.make_tensor_value_info("down", onnx.TensorProto.FLOAT, [E, F, H]),
    ], [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [*tokens, H])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("omforge", 1)])
    model.ir_version = 10
    return model


def lowered_plain(model: ir.Model) -> ir.Model:
    copy = ir.from_proto(ir.to_proto(model))
    lower_ort.lower(copy)
    return copy


def ragged_logits(rng: np.random.Generator, tokens: tuple[int, ...]) -> np.ndarray:
    """Router logits whose top-k always holds expert 1 and never expert 3 (experts 0 and 2 share the rest), with a
    tie between experts 0 and 2 on the first token (the lower index wins)."""
    logits = rng.standard_normal((*tokens, E)).astype(np.float32)
    logits[..., 1] = 5.0
    logits[..., 3] = -5.0
    flat = logits.reshape(-1, E)
    flat[0, 0] = flat[0, 2] = 0.5
    return logits


@pytest.mark.parametrize("top_k", [1, 2, 3])
@pytest.mark.parametrize("normalize", [True, False], ids=["normalize", "no-normalize"])
@pytest.mark.parametrize("tokens", [(7,), (2, 5)], ids=["flat", "batched"])
def test_decomposition_is_the_reference_on_ragged_routing(top_k: int, normalize: bool, tokens: tuple[int, ...]) -> None:
    """The plain ops (ORT lowering without the kernel library, opset 18 ops only) against the float64 reference of the
    contract; the routing is ragged: one expert carries every token, one none."""
    rng = np.random.default_rng(top_k)
    feeds = {"x": rng.standard_normal((*tokens, H)).astype(np.float32), "logits": ragged_logits(rng, tokens),
             "gate_up": (rng.standard_normal((E, H, 2 * F)) / 3).astype(np.float32),
             "down": (rng.standard_normal((E, F, H)) / 3).astype(np.float32)}
    proto = moe_node_graph(tokens, normalize, top_k)
    model = ir.from_proto(proto)
    rules = pattern.RewriteRuleSet([decompose.RULES["MoE"]])
    assert rules.apply_to_model(model) == 1
    assert not fused_ops(model) and all(n.domain in ("", "ai.onnx") for n in model.graph)
    out = run_model(model, feeds)[0]
    ref = moe_reference(feeds["x"], feeds["logits"], feeds["gate_up"], feeds["down"], top_k, normalize)
    assert out.shape == ref.shape
    assert float(np.abs(out - ref).max()) <= 1e-5
    chosen = np.argsort(-feeds["logits"].reshape(-1, E), kind="stable", axis=-1)[:, :top_k]
    assert (chosen == 1).any(-1).all() and not (chosen == 3).any()  # ragged as meant
    assert float(np.abs(out - run_model(lowered_plain(ir.from_proto(proto)), feeds)[0]).max()) == 0.0  # ORT: the same


# --- a real export: the tiny Qwen3-MoE of moe_setup.py (transformers' checkpoint, no top-k renormalization) --------


@pytest.fixture(scope="module")
def export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return moe_export("qwen3_moe", tmp_path_factory)["export"]


def test_one_moe_per_layer_and_no_expert_matmul_left(export: Path) -> None:
    unfused, model = load_export(export), load_export(export)
    counts = manager.run_fusions(model)
    assert counts == {"rms_norm": 4 * LAYERS + 1, "add_rms_norm": 2 * LAYERS, "rotary": 2 * LAYERS,
                      "qkv_merge": LAYERS, "moe": LAYERS, "gate_up_swiglu": 0, "attention": LAYERS}
    nodes = fused_ops(model, "MoE")
    assert all(n.attributes["top_k"].value == TOP_K and n.attributes["normalize"].value == 0 for n in nodes)
    assert [n.inputs[2].name for n in nodes] == [f"model.layers.{i}.mlp.experts.gate_up_proj.weight.T"
                                                 for i in range(LAYERS)]
    assert all(n.inputs[1].producer().inputs[1].name == f"model.layers.{i}.mlp.gate.weight.T"
               for i, n in enumerate(nodes))
    exported = unfused.graph.initializers
    for i, node in enumerate(nodes):  # expert e's weights at index e, gate columns then up columns
        gate_up, down = (v.const_value.numpy() for v in node.inputs[2:])
        assert gate_up.shape == (EXPERTS, HIDDEN, 2 * FFN) and down.shape == (EXPERTS, FFN, HIDDEN)
        for e in range(EXPERTS):
            w = {p: exported[f"model.layers.{i}.mlp.experts.{e}.{p}_proj.weight.T"].const_value.numpy()
                 for p in ("gate", "up", "down")}
            np.testing.assert_array_equal(gate_up[e], np.concatenate([w["gate"], w["up"]], axis=1))
            np.testing.assert_array_equal(down[e], w["down"])
    hist = Counter(n.op_type for n in model.graph)
    assert not {"TopK", "ScatterElements", "Sigmoid", "Softmax", "ReduceSum"} & set(hist), hist
    matmul_weights = [n.inputs[1].name or "" for n in model.graph if n.op_type == "MatMul"]
    assert not [w for w in matmul_weights if ".experts." in w]
    assert hist["MatMul"] == 3 * LAYERS + 1  # qkv, o_proj, router per layer; the tied lm_head
    assert_same_logits(unfused, model)


def test_moe_switched_off_leaves_the_experts_to_gate_up_swiglu(export: Path) -> None:
    unfused, model = load_export(export), load_export(export)
    counts = manager.run_fusions(model, {"moe": False})
    assert counts["moe"] == 0 and counts["gate_up_swiglu"] == LAYERS * EXPERTS
    assert not fused_ops(model, "MoE") and len(fused_ops(model, "SwiGLU")) == LAYERS * EXPERTS
    assert_same_logits(unfused, model)


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_plain_op_experts_stay_float_and_say_why(export: Path, tmp_path: Path, weights: str) -> None:
    """Without the kernel lowering (``kernel=False``: plain ops, any runtime) a quantized bundle's attention and lm_head
    take the precision, the routers stay float (llama.cpp keeps ``ffn_gate_inp`` unrounded) and the plain-op MoE's
    stacked expert weights stay float32, the manifest entry saying why (tests/test_moe_precision.py: the kernel's)."""
    report = build(export, tmp_path / "step.onnx", block_size=4, weights=weights, kernel=False)
    assert report.fusion_counts["moe"] == LAYERS and report.op_histogram["TopK"] == LAYERS
    quantized = report.weights.quantized
    assert not {f"model.layers.{i}.mlp.gate.weight" for i in range(LAYERS)} & set(quantized)
    assert any(".self_attn." in q for q in quantized)
    for i in range(LAYERS):
        assert quantized[f"model.layers.{i}.mlp.experts"] == {
            "bits": 32, "block": None, "op": "plain ops", "source": "float32 (plain ops: the kernel lowering is off)"}
    graph = ir.load(tmp_path / "step.onnx").graph
    stacked = {name: v for name, v in graph.initializers.items() if ".experts." in name}
    assert sorted(stacked) == sorted(f"model.layers.{i}.mlp.experts.{p}.weight.T" for i in range(LAYERS)
                                     for p in ("gate_up_proj", "down_proj"))
    assert all(v.dtype == ir.DataType.FLOAT for v in stacked.values())


def test_decompositions_undo_the_moe_fusion(export: Path) -> None:
    """Every decomposition rule (no ORT-specific op): opset 18 kept, the unfused logits."""
    unfused, model = load_export(export), load_export(export)
    manager.run_fusions(model)
    rules, neutral = pattern.RewriteRuleSet(list(decompose.RULES.values())), len(fused_ops(model))
    assert rules.apply_to_model(model) == neutral
    manager.cleanup(model)
    assert not fused_ops(model) and model.opset_imports[""] == 18
    feeds = {"input_ids": np.arange(22, dtype=np.int64).reshape(2, 11) * 7 % 256,
             "position_ids": np.tile(np.arange(11, dtype=np.int64), (2, 1))}
    diff = float(np.abs(run_model(model, feeds)[0] - run_model(unfused, feeds)[0]).max())
    assert diff <= FUSED_TOL, diff
