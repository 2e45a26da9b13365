"""Rotary fusion: the rotate-half form on ``[B, H, S, D]`` fuses with unchanged numerics; slices that are not the
two halves of the last axis, and operands outside the op's contract, are left alone; a real export fuses q and k
of every layer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from helpers import NUM_LAYERS, assert_fuses, assert_no_match, assert_same_logits, fused_ops, load_export, make_model
from omforge.passes import rotary

INT64_MAX = 2**63 - 1
B, H, S, D = 2, 4, 5, 8


def angles(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """RoPE angles: one frequency per pair, the halves repeated (``cat(freqs, freqs)``, as the export builds)."""
    half = rng.uniform(0, 6, shape[:-1] + (shape[-1] // 2,)).astype(np.float32)
    return np.concatenate([half, half, half[..., :shape[-1] % 2]], axis=-1)


def rotary_nodes(x: str, out: str, *, second: tuple = (D // 2, INT64_MAX), first: tuple = (0, D // 2),
                 axis: int = 3, step: int = 1, concat_axis: int = -1) -> tuple[list, dict[str, np.ndarray]]:
    """``x·cos + Concat(-x[..., second], x[..., first])·sin`` with the slice bounds as initializers."""
    c = {f"{x}.s1": [second[0]], f"{x}.e1": [second[1]], f"{x}.s2": [first[0]], f"{x}.e2": [first[1]],
         f"{x}.axis": [axis], f"{x}.step": [step]}
    nodes = [
        helper.make_node("Slice", [x, f"{x}.s1", f"{x}.e1", f"{x}.axis", f"{x}.step"], [f"{x}.second"]),
        helper.make_node("Slice", [x, f"{x}.s2", f"{x}.e2", f"{x}.axis", f"{x}.step"], [f"{x}.first"]),
        helper.make_node("Neg", [f"{x}.second"], [f"{x}.neg"]),
        helper.make_node("Concat", [f"{x}.neg", f"{x}.first"], [f"{x}.rot"], axis=concat_axis),
        helper.make_node("Mul", [x, "cos"], [f"{x}.xc"]),
        helper.make_node("Mul", [f"{x}.rot", "sin"], [f"{x}.rs"]),
        helper.make_node("Add", [f"{x}.xc", f"{x}.rs"], [out]),
    ]
    return nodes, {k: np.array(v, np.int64) for k, v in c.items()}


def rotary_graph(x_shape: tuple[int, ...] = (B, H, S, D), table_shape: tuple[int, ...] | None = None,
                 shapes: dict | None = None, **slices) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    table_shape = table_shape or (x_shape[0], 1, *x_shape[2:])
    ang = angles(rng, table_shape)
    feeds = {"x": rng.standard_normal(x_shape).astype(np.float32), "cos": np.cos(ang), "sin": np.sin(ang)}
    nodes, inits = rotary_nodes("x", "y", **slices)
    return make_model(nodes, feeds, ["y"], inits, shapes=shapes), feeds


@pytest.mark.parametrize("axis", [3, -1])
@pytest.mark.parametrize("end", [INT64_MAX, D], ids=["end-max", "end-D"])
def test_fuses_rotate_half(axis: int, end: int) -> None:
    """The last axis as 3 or -1; the upper half's end as INT64_MAX (the export) or D."""
    model, feeds = rotary_graph(axis=axis, second=(D // 2, end))
    fused = assert_fuses(model, rotary.RULES, feeds, 1, "Rotary")
    assert [v.name for v in fused_ops(fused)[0].inputs] == ["x", "cos", "sin"]
    assert [n.op_type for n in fused.graph] == ["Rotary"]


def test_fuses_q_and_k_sharing_tables_symbolic_dims() -> None:
    """As exported: q [batch, 4, seq, D] and k [batch, 2, seq, D] (GQA) both read cos/sin [batch, 1, seq, D]."""
    rng = np.random.default_rng(1)
    ang = angles(rng, (B, 1, S, D))
    feeds = {"q": rng.standard_normal((B, 4, S, D)).astype(np.float32),
             "k": rng.standard_normal((B, 2, S, D)).astype(np.float32), "cos": np.cos(ang), "sin": np.sin(ang)}
    q_nodes, q_inits = rotary_nodes("q", "q_rot")
    k_nodes, k_inits = rotary_nodes("k", "k_rot")
    shapes = {"q": ["batch", 4, "seq", D], "k": ["batch", 2, "seq", D], "cos": ["batch", 1, "seq", D],
              "sin": ["batch", 1, "seq", D]}
    model = make_model(q_nodes + k_nodes, feeds, ["q_rot", "k_rot"], {**q_inits, **k_inits}, shapes=shapes)
    fused = assert_fuses(model, rotary.RULES, feeds, 2, "Rotary")
    assert sorted(n.inputs[0].name for n in fused_ops(fused)) == ["k", "q"]


def test_fuses_single_token() -> None:
    """S = 1 (a decode step's shape): cos/sin [B, 1, 1, D]."""
    model, feeds = rotary_graph(x_shape=(B, H, 1, D))
    assert_fuses(model, rotary.RULES, feeds, 1, "Rotary")


@pytest.mark.parametrize("case", [
    "head dim not static", "slice start not constant", "slices on axis 2", "step 2", "second half from D/4",
    "halves swapped", "second half short of D", "odd head dim", "concat on axis 2",
    "x 3-D", "cos batch-broadcast", "cos per head",
])
def test_check_rejects(case: str) -> None:
    """One counterexample per check: static head dim; constant scalar bounds; unit-step slices of the last axis;
    exactly the two halves (D even); concat on the last axis; x [B, H, S, D] with cos/sin [B, 1, S, D]."""
    if case == "head dim not static":
        model, _ = rotary_graph(shapes={"x": ["batch", H, "seq", "d"], "cos": ["batch", 1, "seq", "d"],
                                        "sin": ["batch", 1, "seq", "d"]})
    elif case == "slice start not constant":
        model, _ = rotary_graph()
        model.graph.initializer.remove(next(t for t in model.graph.initializer if t.name == "x.s1"))
        model.graph.input.append(helper.make_tensor_value_info("x.s1", 7, [1]))
    elif case == "slices on axis 2":
        model, _ = rotary_graph(x_shape=(B, H, D, D), axis=2)
    elif case == "step 2":
        model, _ = rotary_graph(step=2)
    elif case == "second half from D/4":
        model, _ = rotary_graph(second=(D // 4, INT64_MAX), first=(0, D - D // 4))
    elif case == "halves swapped":
        model, _ = rotary_graph(second=(0, D // 2), first=(D // 2, INT64_MAX))
    elif case == "second half short of D":
        model, _ = rotary_graph(second=(D // 2, D - 1), first=(0, D // 2 - 1))
    elif case == "odd head dim":
        model, _ = rotary_graph(x_shape=(B, H, S, 7), second=(3, INT64_MAX), first=(0, 3))
    elif case == "concat on axis 2":
        model, _ = rotary_graph(concat_axis=2)
    elif case == "x 3-D":
        model, _ = rotary_graph(x_shape=(B, S, D), table_shape=(B, S, D), axis=2)
    elif case == "cos batch-broadcast":
        model, _ = rotary_graph(table_shape=(1, 1, S, D))
    else:
        model, _ = rotary_graph(table_shape=(B, H, S, D))
    assert_no_match(model, rotary.RULES)


def test_real_exports(tiny_exports: dict[str, Path]) -> None:
    """Every family: q and k of every layer (2L), no rotate-half left, the same logits after fusing and lowering."""
    for variant, export_dir in tiny_exports.items():
        unfused, model = load_export(export_dir), load_export(export_dir)
        assert rotary.RULES.apply_to_model(model) == 2 * NUM_LAYERS, variant
        assert not [n for n in model.graph if n.op_type in ("Neg", "Slice")], variant
        heads = sorted(n.inputs[0].shape[1] for n in fused_ops(model, "Rotary"))
        assert heads == [2] * NUM_LAYERS + [4] * NUM_LAYERS  # k (2 KV heads) and q (4 heads)
        assert_same_logits(unfused, model)
