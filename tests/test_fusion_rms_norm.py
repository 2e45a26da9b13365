"""RMSNorm fusion: the exported form and the variants the rule accepts fuse with unchanged numerics; each check
of the rule rejects its counterexample; a real export of every family fuses exactly 2L+1 norms."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from helpers import NUM_LAYERS, assert_fuses, assert_no_match, assert_same_logits, fused_ops, load_export, make_model
from omforge.passes import rms_norm

HIDDEN = 8
EPS = 1e-5


def rms_graph(*, weight_left: bool = True, x_first: bool = True, constants: str = "initializer",
              two: float = 2.0, axes: list[int] | None = None, reduce_attrs: dict | None = None,
              eps: float | np.ndarray | None = EPS, weight: np.ndarray | None = None, weight_input: bool = False,
              x_shape: tuple[int, ...] = (2, 3, HIDDEN)) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """``w * (x * 1/sqrt(mean(x**2, axes) + eps))`` in the export's ops; ``eps=None`` makes epsilon a graph input,
    ``constants='node'`` gives the scalars as Constant nodes instead of initializers; ``reduce_attrs`` replaces
    the ReduceMean attributes the export writes (``keepdims=1, noop_with_empty_axes=0``)."""
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal(x_shape).astype(np.float32)}
    consts = {"two": np.array(two, np.float32), "axes": np.array(axes or [-1], np.int64)}
    if eps is None:
        feeds["eps"] = np.array(EPS, np.float32)
    else:
        consts["eps"] = np.array(eps, np.float32)
    w = (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32) if weight is None else weight
    if weight_input:
        feeds["w"] = w
    nodes, inits = [], {} if weight_input else {"w": w}
    if constants == "node":
        nodes += [helper.make_node("Constant", [], [k], value=numpy_helper.from_array(v, k)) for k, v in consts.items()]
    else:
        inits.update(consts)
    nodes += [
        helper.make_node("Pow", ["x", "two"], ["sq"]),
        helper.make_node("ReduceMean", ["sq", "axes"], ["mean"],
                         **(dict(keepdims=1, noop_with_empty_axes=0) if reduce_attrs is None else reduce_attrs)),
        helper.make_node("Add", ["mean", "eps"], ["var"]),
        helper.make_node("Sqrt", ["var"], ["rms"]),
        helper.make_node("Reciprocal", ["rms"], ["inv"]),
        helper.make_node("Mul", ["x", "inv"] if x_first else ["inv", "x"], ["normed"]),
        helper.make_node("Mul", ["w", "normed"] if weight_left else ["normed", "w"], ["y"]),
    ]
    return make_model(nodes, feeds, ["y"], inits), feeds


@pytest.mark.parametrize("weight_left", [True, False], ids=["w*normed", "normed*w"])
@pytest.mark.parametrize("x_first", [True, False], ids=["x*inv", "inv*x"])
def test_fuses_either_operand_order(weight_left: bool, x_first: bool) -> None:
    model, feeds = rms_graph(weight_left=weight_left, x_first=x_first)
    fused = assert_fuses(model, rms_norm.RULES, feeds, 1, "RMSNorm")
    (node,) = fused_ops(fused)
    assert node.attributes["epsilon"].value == pytest.approx(EPS, rel=1e-6)
    assert [v.name for v in node.inputs] == ["x", "w"]
    assert [n.op_type for n in fused.graph] == ["RMSNorm"]  # the whole chain is gone


@pytest.mark.parametrize("axes", [[-1], [2]], ids=["axis-1", "axis2"])
@pytest.mark.parametrize("reduce_attrs", [{}, {"keepdims": 1}], ids=["defaults", "keepdims"])
def test_fuses_last_axis_either_sign_default_attributes_constant_nodes(axes: list[int], reduce_attrs: dict) -> None:
    """The last axis as -1 or rank-1; ReduceMean's attributes written out or left at their defaults; the scalars
    as Constant nodes."""
    model, feeds = rms_graph(axes=axes, constants="node", eps=1e-6, reduce_attrs=reduce_attrs)
    fused = assert_fuses(model, rms_norm.RULES, feeds, 1, "RMSNorm")
    assert fused_ops(fused)[0].attributes["epsilon"].value == pytest.approx(1e-6, rel=1e-6)


@pytest.mark.parametrize("case", [
    "exponent 3", "exponent not constant", "reduce over axis 0", "reduce over two axes", "keepdims 0",
    "epsilon not constant", "epsilon not scalar", "weight 2-D", "weight not constant", "weight length 1",
])
def test_check_rejects(case: str) -> None:
    """One counterexample per check: the exponent is 2, the reduction is over the last axis only with keepdims,
    epsilon is a scalar constant, the weight is a constant vector as long as the normalized axis."""
    if case == "exponent 3":
        model, _ = rms_graph(two=3.0)
    elif case == "exponent not constant":
        model, _ = rms_graph()
        model.graph.initializer.remove(next(t for t in model.graph.initializer if t.name == "two"))
        model.graph.input.append(helper.make_tensor_value_info("two", 1, []))
    elif case == "reduce over axis 0":
        model, _ = rms_graph(axes=[0])
    elif case == "reduce over two axes":
        model, _ = rms_graph(axes=[1, 2])
    elif case == "keepdims 0":
        # x [8, 8]: the mean [8] broadcasts against the last axis, so the graph stays valid
        model, _ = rms_graph(reduce_attrs={"keepdims": 0}, x_shape=(HIDDEN, HIDDEN))
    elif case == "epsilon not constant":
        model, _ = rms_graph(eps=None)
    elif case == "epsilon not scalar":
        model, _ = rms_graph(eps=np.full((3, 1), EPS, np.float32))
    elif case == "weight 2-D":
        model, _ = rms_graph(weight=np.ones((1, HIDDEN), np.float32))
    elif case == "weight not constant":
        model, _ = rms_graph(weight_input=True)
    else:
        model, _ = rms_graph(weight=np.full(1, 0.5, np.float32))
    assert_no_match(model, rms_norm.RULES)


def test_real_exports(tiny_exports: dict[str, Path]) -> None:
    """Every family: 2 norms per layer plus the final one, and the same logits after fusing and lowering."""
    for variant, export_dir in tiny_exports.items():
        unfused, model = load_export(export_dir), load_export(export_dir)
        assert rms_norm.RULES.apply_to_model(model) == 2 * NUM_LAYERS + 1, variant
        assert not [n for n in model.graph if n.op_type in ("Pow", "ReduceMean", "Reciprocal")], variant
        assert all(n.attributes["epsilon"].value == pytest.approx(1e-5, rel=1e-6) for n in fused_ops(model))
        assert_same_logits(unfused, model)
