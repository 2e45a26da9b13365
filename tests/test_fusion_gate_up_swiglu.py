"""Gate/up merge + SwiGLU: ``silu(x @ Wg) * (x @ Wu)`` becomes ``SwiGLU(x @ [Wg | Wu])`` with unchanged numerics;
weights that are not constant matrices of one shape are left alone; a real export fuses one MLP per layer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from helpers import NUM_LAYERS, assert_fuses, assert_no_match, assert_same_logits, fused_ops, load_export, make_model
from omforge.passes import gate_up_swiglu

HIDDEN, FFN = 16, 32


def mlp_graph(*, up_shape: tuple[int, ...] = (HIDDEN, FFN), gate_shape: tuple[int, ...] = (HIDDEN, FFN),
              up_input: bool = False, gate_input: bool = False, up_reads: str = "x", down: bool = True,
              names: tuple[str, str] = ("wg", "wu"),
              shapes: dict | None = None) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """``(g * sigmoid(g)) * u`` with ``g = x @ Wg``, ``u = <up_reads> @ Wu`` (then ``@ Wd`` when ``down``), in the
    export's order; ``*_input`` makes that weight a graph input instead of an initializer."""
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((2, 3, HIDDEN)).astype(np.float32)}
    if up_reads != "x":
        feeds[up_reads] = rng.standard_normal((2, 3, HIDDEN)).astype(np.float32)
    wg, wu = (rng.standard_normal(s).astype(np.float32) / 4 for s in (gate_shape, up_shape))
    inits = {"wd": rng.standard_normal((FFN, HIDDEN)).astype(np.float32)} if down else {}
    for name, w, as_input in ((names[0], wg, gate_input), (names[1], wu, up_input)):
        (feeds if as_input else inits)[name] = w
    nodes = [
        helper.make_node("MatMul", ["x", names[0]], ["gate"]),
        helper.make_node("Sigmoid", ["gate"], ["sig"]),
        helper.make_node("Mul", ["gate", "sig"], ["silu"]),
        helper.make_node("MatMul", [up_reads, names[1]], ["up"]),
        helper.make_node("Mul", ["silu", "up"], ["act"]),
    ]
    if down:
        nodes.append(helper.make_node("MatMul", ["act", "wd"], ["y"]))
    return make_model(nodes, feeds, ["y" if down else "act"], inits, shapes=shapes), feeds


@pytest.mark.parametrize("down", [True, False], ids=["with-down", "act-is-output"])
@pytest.mark.parametrize("symbolic", [False, True], ids=["static", "symbolic"])
def test_fuses_gate_up(down: bool, symbolic: bool) -> None:
    model, feeds = mlp_graph(down=down, shapes={"x": ["batch", "seq", HIDDEN]} if symbolic else None)
    fused = assert_fuses(model, gate_up_swiglu.RULES, feeds, 1, "SwiGLU")
    (node,) = fused_ops(fused)
    matmul = node.inputs[0].producer()
    assert matmul.op_type == "MatMul" and matmul.inputs[0].name == "x"
    init = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    np.testing.assert_array_equal(matmul.inputs[1].const_value.numpy(), np.concatenate([init["wg"], init["wu"]], 1))
    assert not [n for n in fused.graph if n.op_type == "Sigmoid"]


def test_merged_weight_named_after_the_export() -> None:
    model, feeds = mlp_graph(names=("mlp.gate_proj.weight.T", "mlp.up_proj.weight.T"))
    fused = assert_fuses(model, gate_up_swiglu.RULES, feeds, 1, "SwiGLU")
    assert fused_ops(fused)[0].inputs[0].producer().inputs[1].name == "mlp.gate_up_proj.weight.T"


@pytest.mark.parametrize("case", ["shapes differ", "gate not constant", "up not constant", "weights 3-D",
                                  "up reads another activation"])
def test_check_rejects(case: str) -> None:
    """The check: both weights constant 2-D matrices of one shape (and the pattern: one activation read twice)."""
    if case == "shapes differ":
        model, _ = mlp_graph(up_shape=(HIDDEN, 1), down=False)  # [.., 1] broadcasts: a valid graph, no SwiGLU
    elif case == "gate not constant":
        model, _ = mlp_graph(gate_input=True)
    elif case == "up not constant":
        model, _ = mlp_graph(up_input=True)
    elif case == "weights 3-D":
        model, _ = mlp_graph(gate_shape=(2, HIDDEN, FFN), up_shape=(2, HIDDEN, FFN), down=False)
    else:
        model, _ = mlp_graph(up_reads="z")
    assert_no_match(model, gate_up_swiglu.RULES)


def test_real_exports(tiny_exports: dict[str, Path]) -> None:
    """Every family: one MLP per layer into ``gate_up_proj`` [64, 2·128]; the same logits."""
    for variant, export_dir in tiny_exports.items():
        unfused, model = load_export(export_dir), load_export(export_dir)
        assert gate_up_swiglu.RULES.apply_to_model(model) == NUM_LAYERS, variant
        weights = sorted(n.inputs[0].producer().inputs[1].name for n in fused_ops(model, "SwiGLU"))
        assert weights == [f"model.layers.{i}.mlp.gate_up_proj.weight.T" for i in range(NUM_LAYERS)]
        assert all(model.graph.initializers[w].const_value.shape == (64, 256) for w in weights)
        assert not [n for n in model.graph if n.op_type == "Sigmoid"], variant
        assert_same_logits(unfused, model)
