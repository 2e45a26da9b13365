"""Residual Add + RMSNorm fusion: an Add of two same-shape operands feeding an RMSNorm becomes one AddRMSNorm whose
second output is the sum; a broadcasting Add is left alone; a real export fuses every norm but the first."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import helper

from helpers import (
    NUM_LAYERS,
    apply_rules,
    assert_fuses,
    assert_no_match,
    assert_same_logits,
    fused_ops,
    load_export,
    make_model,
)
from omforge.passes import add_rms_norm, rms_norm

HIDDEN = 8
EPS = 1e-6


def fuse(model: ir.Model) -> int:
    """The fusion as the pass manager runs it: RMSNorm first, then the Add into it; returns the Add count."""
    rms_norm.RULES.apply_to_model(model)
    return add_rms_norm.RULES.apply_to_model(model)


def add_norm_graph(a_shape: tuple[int, ...] = (2, 3, HIDDEN), b_shape: tuple[int, ...] = (2, 3, HIDDEN), *,
                   read_on: bool = True, producer: str = "Add",
                   shapes: dict | None = None) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """``s = a + b; y = rmsnorm(s)``, and (``read_on``) the residual stream reading ``s`` on: ``next = s + y``,
    with ``s`` also a graph output. ``producer`` replaces the Add (a Mul is no residual add)."""
    rng = np.random.default_rng(0)
    feeds = {"a": rng.standard_normal(a_shape).astype(np.float32), "b": rng.standard_normal(b_shape).astype(np.float32)}
    inits = {"w": (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32), "two": np.array(2.0, np.float32),
             "axes": np.array([-1], np.int64), "eps": np.array(EPS, np.float32)}
    nodes = [
        helper.make_node(producer, ["a", "b"], ["s"]),
        helper.make_node("Pow", ["s", "two"], ["sq"]),
        helper.make_node("ReduceMean", ["sq", "axes"], ["mean"], keepdims=1, noop_with_empty_axes=0),
        helper.make_node("Add", ["mean", "eps"], ["var"]),
        helper.make_node("Sqrt", ["var"], ["rms"]),
        helper.make_node("Reciprocal", ["rms"], ["inv"]),
        helper.make_node("Mul", ["s", "inv"], ["normed"]),
        helper.make_node("Mul", ["w", "normed"], ["y"]),
    ]
    outputs = ["y"]
    if read_on:
        nodes.append(helper.make_node("Add", ["s", "y"], ["next"]))
        outputs += ["s", "next"]
    return make_model(nodes, feeds, outputs, inits, shapes=shapes), feeds


@pytest.mark.parametrize("read_on", [True, False], ids=["sum-read-on", "sum-only-normed"])
@pytest.mark.parametrize("symbolic", [False, True], ids=["static", "symbolic"])
def test_fuses_residual_add(read_on: bool, symbolic: bool) -> None:
    shapes = {"a": ["batch", "seq", HIDDEN], "b": ["batch", "seq", HIDDEN]} if symbolic else None
    model, feeds = add_norm_graph(read_on=read_on, shapes=shapes)
    fused = assert_fuses(model, fuse, feeds, 1, "AddRMSNorm")
    (node,) = fused_ops(fused)
    assert node.attributes["epsilon"].value == pytest.approx(EPS, rel=1e-6)
    assert [v.name for v in node.inputs] == ["a", "b", "w"]
    assert not [n for n in fused.graph if n.op_type == "RMSNorm"]
    total = node.outputs[1]
    if read_on:  # the sum is the fused op's second output wherever it was read
        assert total.is_graph_output()
        assert [(u.node.op_type, u.idx) for u in total.uses()] == [("Add", 0)]
    else:
        assert not total.uses() and not total.is_graph_output()


@pytest.mark.parametrize("b_shape", [(HIDDEN,), (3, HIDDEN)], ids=["rank1", "rank2"])
def test_check_rejects_rank_broadcast(b_shape: tuple[int, ...]) -> None:
    """The check: the residual operands have one rank (a broadcasting Add is not a residual add)."""
    model, _ = add_norm_graph(b_shape=b_shape)
    normed = ir.from_proto(model)
    assert apply_rules(normed, rms_norm.RULES) == 1
    assert_no_match(ir.to_proto(normed), add_rms_norm.RULES)


@pytest.mark.parametrize("b_shape", [(1, 1, HIDDEN), (1, 3, HIDDEN)], ids=["1x1xH", "1xSxH"])
def test_check_rejects_same_rank_broadcast(b_shape: tuple[int, ...]) -> None:
    """The check: the residual operands have one shape where both are known. (A [1, 1, H] residual used to
    match and then fail inside ORT's SkipSimplifiedLayerNormalization.)"""
    model, _ = add_norm_graph(b_shape=b_shape)
    normed = ir.from_proto(model)
    assert apply_rules(normed, rms_norm.RULES) == 1
    assert_no_match(ir.to_proto(normed), add_rms_norm.RULES)


def test_no_match_without_add_or_without_rms_norm() -> None:
    """The pattern: only an Add feeds it, and only a fused RMSNorm (the rule runs after ``rms_norm``)."""
    model, _ = add_norm_graph(producer="Mul")
    normed = ir.from_proto(model)
    assert apply_rules(normed, rms_norm.RULES) == 1
    assert_no_match(ir.to_proto(normed), add_rms_norm.RULES)
    model, _ = add_norm_graph()
    assert_no_match(model, add_rms_norm.RULES)  # the primitive norm is not an RMSNorm yet


def test_real_exports(tiny_exports: dict[str, Path]) -> None:
    """Every family: both norms of every layer but layer 0's input norm (it reads the embedding, not an Add) and
    the final norm; 2L in all, with the same logits after fusing and lowering."""
    for variant, export_dir in tiny_exports.items():
        unfused, model = load_export(export_dir), load_export(export_dir)
        assert fuse(model) == 2 * NUM_LAYERS, variant
        (first,) = fused_ops(model, "RMSNorm")
        assert first.inputs[1].name == "model.layers.0.input_layernorm.weight"
        assert first.inputs[0].producer().op_type == "Gather"
        assert_same_logits(unfused, model)
