"""Q/K/V merge: three projections of one activation become one MatMul (+ one bias Add) and a Split, with or
without biases; two or four projections, mixed biases or non-constant weights are left alone; a real export
merges one group per layer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import helper

from helpers import FUSED_TOL, NUM_LAYERS, assert_no_match, assert_same_logits, load_export, make_model, run_model
from omforge.passes import qkv_merge

HIDDEN = 16
COLS = (16, 8, 8)  # q, then k and v with half the heads (GQA)


def qkv_graph(cols: tuple[int, ...] = COLS, *, bias: tuple[bool, ...] | bool = False, bias_first: bool = False,
              bias_shape: str = "vector", outputs: str = "consumed", weight_input: bool = False,
              weight_3d: bool = False,
              names: tuple[str, ...] | None = None) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """``len(cols)`` projections ``x @ W_i (+ b_i)`` of one ``x [2, 3, HIDDEN]``. ``outputs='consumed'`` feeds each
    into a Relu (as the export's Reshape reads q/k/v); ``'graph'`` makes the projections graph outputs."""
    rng = np.random.default_rng(0)
    biased = (bias,) * len(cols) if isinstance(bias, bool) else bias
    names = names or tuple(f"w{i}" for i in range(len(cols)))
    feeds = {"x": rng.standard_normal((2, 3, HIDDEN)).astype(np.float32)}
    inits, nodes, outs = {}, [], []
    for i, (name, c, b) in enumerate(zip(names, cols, biased)):
        w = rng.standard_normal((2, HIDDEN, c) if weight_3d else (HIDDEN, c)).astype(np.float32)
        if weight_input and i == 0:
            feeds[name] = w
        else:
            inits[name] = w
        nodes.append(helper.make_node("MatMul", ["x", name], [f"mm{i}"]))
        last = f"mm{i}"
        if b:
            inits[f"b{i}"] = rng.standard_normal(c if bias_shape == "vector" else (1, c)).astype(np.float32)
            nodes.append(helper.make_node("Add", [f"b{i}", last] if bias_first else [last, f"b{i}"], [f"add{i}"]))
            last = f"add{i}"
        if outputs == "consumed":
            nodes.append(helper.make_node("Relu", [last], [f"out{i}"]))
            last = f"out{i}"
        outs.append(last)
    return make_model(nodes, feeds, outs, inits), feeds


def assert_merges(proto: onnx.ModelProto, feeds: dict[str, np.ndarray], count: int = 1) -> ir.Model:
    """``count`` merges, one MatMul and one Split per merge, the graph's outputs and numerics unchanged."""
    model = ir.from_proto(proto)
    assert qkv_merge.apply(model) == count
    ops = [n.op_type for n in model.graph]
    assert ops.count("Split") == count and ops.count("MatMul") == count
    assert [o.name for o in model.graph.outputs] == [o.name for o in proto.graph.output]
    after = ir.from_proto(ir.to_proto(model))
    for b, a in zip(run_model(proto, feeds), run_model(after, feeds)):
        assert b.shape == a.shape and float(np.abs(b - a).max()) <= FUSED_TOL
    return model


@pytest.mark.parametrize("outputs", ["consumed", "graph"])
def test_merges_without_bias(outputs: str) -> None:
    model, feeds = qkv_graph(outputs=outputs)
    merged = assert_merges(model, feeds)
    (matmul,) = [n for n in merged.graph if n.op_type == "MatMul"]
    assert matmul.inputs[1].const_value.shape == (HIDDEN, sum(COLS))
    (split,) = [n for n in merged.graph if n.op_type == "Split"]
    assert split.inputs[1].const_value.numpy().tolist() == list(COLS)
    assert split.inputs[0] is matmul.outputs[0]  # no bias Add between


@pytest.mark.parametrize("outputs", ["consumed", "graph"])
@pytest.mark.parametrize("bias_first", [False, True], ids=["mm+b", "b+mm"])
def test_merges_with_bias(outputs: str, bias_first: bool) -> None:
    """Qwen2: each projection carries a bias; the three become one bias Add before the Split."""
    model, feeds = qkv_graph(bias=True, bias_first=bias_first, outputs=outputs)
    merged = assert_merges(model, feeds)
    (add,) = [n for n in merged.graph if n.op_type == "Add"]
    assert add.inputs[1].const_value.shape == (sum(COLS),)
    assert add.outputs[0].uses()[0].node.op_type == "Split"


def test_names_follow_the_export() -> None:
    """``...q_proj.weight.T`` → ``...qkv_proj.weight.T`` and ``...qkv_proj.bias``."""
    names = tuple(f"model.layers.0.self_attn.{p}_proj.weight.T" for p in "qkv")
    model, feeds = qkv_graph(bias=True, names=names)
    merged = assert_merges(model, feeds)
    assert {"model.layers.0.self_attn.qkv_proj.weight.T", "model.layers.0.self_attn.qkv_proj.bias"} <= set(
        merged.graph.initializers)


def test_bias_of_another_shape_stays_an_add() -> None:
    """A [1, C] bias is not a projection bias: the three merge as unbiased and their Adds stay after the Split."""
    model, feeds = qkv_graph(bias=True, bias_shape="row")
    merged = assert_merges(model, feeds)
    assert [n.op_type for n in merged.graph].count("Add") == 3


@pytest.mark.parametrize("case", ["two projections", "four projections", "mixed bias", "weight not constant",
                                  "weight 3-D"])
def test_check_rejects(case: str) -> None:
    """Exactly three MatMuls of one activation, with constant 2-D weights, all biased or none."""
    if case == "two projections":
        model, _ = qkv_graph(cols=(16, 16))
    elif case == "four projections":
        model, _ = qkv_graph(cols=(16, 8, 8, 8))
    elif case == "mixed bias":
        model, _ = qkv_graph(bias=(True, True, False))
    elif case == "weight not constant":
        model, _ = qkv_graph(weight_input=True)
    else:
        model, _ = qkv_graph(weight_3d=True)
    assert_no_match(model, qkv_merge.apply)


def test_real_exports(tiny_exports: dict[str, Path]) -> None:
    """Every family: one merge per layer into ``qkv_proj`` [64, 64+32+32] (+ bias for Qwen2); the same logits."""
    for variant, export_dir in tiny_exports.items():
        unfused, model = load_export(export_dir), load_export(export_dir)
        assert qkv_merge.apply(model) == NUM_LAYERS, variant
        for layer in range(NUM_LAYERS):
            prefix = f"model.layers.{layer}.self_attn."
            weight = model.graph.initializers[prefix + "qkv_proj.weight.T"]
            assert weight.const_value.shape == (64, 128)
            assert (prefix + "qkv_proj.bias" in model.graph.initializers) == (variant == "qwen2")
            assert not any(v.name.startswith(prefix + "q_proj") for n in model.graph for v in n.inputs if v)
        assert_same_logits(unfused, model)
