"""Attention fusion: causal scaled dot-product attention, with the GQA head repeat or without, fuses with the
right scale and head counts and unchanged numerics; a mask that is not causal, a fill that is not large negative,
a non-constant scale or unknown head counts are left alone; a real export fuses one attention per layer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import helper

from helpers import (
    NUM_LAYERS,
    TINY_HF_CONFIGS,
    apply_rules,
    assert_fuses,
    assert_no_match,
    assert_same_logits,
    fused_ops,
    load_export,
    lowered,
    make_model,
    run_model,
)
from omforge.passes import attention

B, S, D = 2, 6, 8
NEG = float(np.finfo(np.float32).min)


def attention_graph(q_heads: int = 4, kv_heads: int = 2, *, scale: float | np.ndarray | None = D ** -0.5,
                    fill: float | None = NEG, mask: str = "causal", repeat_axis: int = 2, symbolic: bool = False,
                    k_heads: int | None = None) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """The export's attention: ``softmax(Where(mask, fill, q @ k'ᵀ * scale)) @ v'`` with ``k' = v' = repeat(kv)``
    (Unsqueeze at ``repeat_axis``, Expand, Reshape) when ``q_heads > kv_heads``, and the mask the causal
    ``arange[None, :] > arange[:, None]`` over ``Range(0, S)``. ``scale``/``fill`` None: a graph input.
    ``mask``: 'causal', 'transposed' (the unsqueezes swapped: hides the past), 'less' (Less for Greater),
    'two-ranges' (rows and columns from different Ranges), 'input' (a graph input)."""
    rng = np.random.default_rng(0)
    feeds = {"q": rng.standard_normal((B, q_heads, S, D)).astype(np.float32),
             "k": rng.standard_normal((B, k_heads or kv_heads, S, D)).astype(np.float32),
             "v": rng.standard_normal((B, kv_heads, S, D)).astype(np.float32)}
    inits = {"ax0": np.array([0], np.int64), "ax1": np.array([1], np.int64), "two": np.array(2, np.int64),
             "zero": np.array(0, np.int64), "one": np.array(1, np.int64)}
    for name, value in (("scale", scale), ("fill", fill)):
        if value is None:
            feeds[name] = np.array(D ** -0.5 if name == "scale" else NEG, np.float32)
        else:
            inits[name] = np.asarray(value, np.float32)
    nodes = [helper.make_node("Shape", ["q"], ["q_shape"]),
             helper.make_node("Gather", ["q_shape", "two"], ["seq"], axis=0),
             helper.make_node("Range", ["zero", "seq", "one"], ["r"])]
    if mask == "two-ranges":
        nodes.append(helper.make_node("Range", ["zero", "seq", "one"], ["r2"]))
    cols, rows = ("ax1", "ax0") if mask == "transposed" else ("ax0", "ax1")
    nodes += [helper.make_node("Unsqueeze", ["r", cols], ["cols"]),
              helper.make_node("Unsqueeze", ["r2" if mask == "two-ranges" else "r", rows], ["rows"]),
              helper.make_node("Less" if mask == "less" else "Greater", ["cols", "rows"], ["causal"])]
    if mask == "input":
        nodes = []
        feeds["causal"] = np.triu(np.ones((S, S), bool), 1)
    k, v = "k", "v"
    if q_heads > kv_heads:
        groups = q_heads // kv_heads
        inits["rep_axis"] = np.array([repeat_axis], np.int64)
        expand = [1, 1, 1, 1, 1]
        expand[repeat_axis] = groups  # [B, kv, g, S, D] at axis 2; [B, g, kv, S, D] at axis 1
        inits["rep"] = np.array(expand, np.int64)
        inits["heads_shape"] = np.array([0, q_heads, -1, D], np.int64)
        for name in ("k", "v"):
            nodes += [helper.make_node("Unsqueeze", [name, "rep_axis"], [f"{name}_u"]),
                      helper.make_node("Expand", [f"{name}_u", "rep"], [f"{name}_e"]),
                      helper.make_node("Reshape", [f"{name}_e", "heads_shape"], [f"{name}_rep"], allowzero=0)]
        k, v = "k_rep", "v_rep"
    nodes += [helper.make_node("Transpose", [k], ["kt"], perm=[0, 1, 3, 2]),
              helper.make_node("MatMul", ["q", "kt"], ["qk"]),
              helper.make_node("Mul", ["qk", "scale"], ["scores"]),
              helper.make_node("Where", ["causal", "fill", "scores"], ["masked"]),
              helper.make_node("Softmax", ["masked"], ["probs"], axis=-1),
              helper.make_node("MatMul", ["probs", v], ["o"])]
    shapes = None
    if symbolic:
        shapes = {"q": ["batch", q_heads, "seq", D], "k": ["batch", kv_heads, "seq", D],
                  "v": ["batch", kv_heads, "seq", D]}
    return make_model(nodes, feeds, ["o"], inits, shapes=shapes), feeds


@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("symbolic", [False, True], ids=["static", "symbolic"])
def test_fuses_causal_attention(q_heads: int, kv_heads: int, symbolic: bool) -> None:
    model, feeds = attention_graph(q_heads, kv_heads, symbolic=symbolic)
    fused = assert_fuses(model, attention.RULES, feeds, 1, "Attention")
    (node,) = fused_ops(fused)
    assert [v.name for v in node.inputs] == ["q", "k", "v"]  # the repeat is gone: the op shares KV heads itself
    assert node.attributes["scale"].value == pytest.approx(D ** -0.5)
    assert (node.attributes["q_heads"].value, node.attributes["kv_heads"].value) == (q_heads, kv_heads)
    assert not [n for n in fused.graph if n.op_type in ("Softmax", "Expand", "MatMul")]


@pytest.mark.parametrize("fill", [NEG, -1e30, -np.inf], ids=["finfo-min", "-1e30", "-inf"])
def test_fuses_any_large_negative_fill_and_scale(fill: float) -> None:
    model, feeds = attention_graph(scale=0.1, fill=fill)
    fused = assert_fuses(model, attention.RULES, feeds, 1, "Attention")
    assert fused_ops(fused)[0].attributes["scale"].value == pytest.approx(0.1)


@pytest.mark.parametrize("case", [
    "scale not constant", "scale per head", "fill -1e4", "fill not constant", "mask transposed", "mask Less",
    "mask from two ranges", "mask an input", "heads not static", "heads not a multiple",
])
def test_check_rejects(case: str) -> None:
    """One counterexample per check: constant scalar scale; fill ≤ -1e30; the causal arange comparison over one
    Range; static head counts with q_heads % kv_heads == 0."""
    if case == "scale not constant":
        model, _ = attention_graph(scale=None)
    elif case == "scale per head":
        model, _ = attention_graph(scale=np.full((1, 4, 1, 1), D ** -0.5, np.float32))
    elif case == "fill -1e4":
        model, _ = attention_graph(fill=-1e4)
    elif case == "fill not constant":
        model, _ = attention_graph(fill=None)
    elif case.startswith("mask"):
        model, _ = attention_graph(mask={"mask transposed": "transposed", "mask Less": "less",
                                         "mask from two ranges": "two-ranges", "mask an input": "input"}[case])
    elif case == "heads not static":
        model, _ = attention_graph(4, 4)
        model.graph.input[0].type.tensor_type.shape.dim[1].dim_param = "heads"
        model.graph.input[0].type.tensor_type.shape.dim[1].ClearField("dim_value")
    else:  # k with 3 heads against q's 4: an invalid graph, but the check is what refuses it
        model, _ = attention_graph(4, 4, k_heads=3)
    assert_no_match(model, attention.RULES)


def test_repeat_not_at_axis_2_is_not_gqa() -> None:
    """The GQA check: the repeat is an Unsqueeze at axis 2 (each KV head serves a run of query heads). Repeated
    at axis 1 the heads interleave, so the GQA rule refuses it; the MHA rule then takes the repeated K/V as they
    are (kv_heads == q_heads), which is still exact."""
    model, feeds = attention_graph(4, 2, repeat_axis=1)
    assert_no_match(model, attention.AttentionFusion.rule("attention_gqa", True))
    fused = ir.from_proto(model)
    assert apply_rules(fused, attention.RULES) == 1
    (node,) = fused_ops(fused)
    assert (node.attributes["q_heads"].value, node.attributes["kv_heads"].value) == (4, 4)
    assert node.inputs[1].producer().op_type == "Reshape"
    np.testing.assert_allclose(run_model(lowered(fused), feeds)[0], run_model(model, feeds)[0], atol=1e-5, rtol=0)


def test_real_exports(tiny_exports: dict[str, Path]) -> None:
    """Every family: one attention per layer, 4 query heads over 2 KV heads, scale 1/sqrt(16), Mistral's sliding
    window carried as ``window``; the same logits."""
    for variant, export_dir in tiny_exports.items():
        unfused, model = load_export(export_dir), load_export(export_dir)
        assert attention.RULES.apply_to_model(model) == NUM_LAYERS, variant
        for node in fused_ops(model, "Attention"):
            a = {k: v.value for k, v in node.attributes.items()}
            window = TINY_HF_CONFIGS[variant].get("sliding_window")
            assert a == {"scale": pytest.approx(0.25), "q_heads": 4, "kv_heads": 2,
                         **({"window": window} if window else {})}
        assert not [n for n in model.graph if n.op_type in ("Softmax", "Expand")], variant
        assert_same_logits(unfused, model)
