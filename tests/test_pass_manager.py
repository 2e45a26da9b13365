"""The pass manager on real exports: a count per fusion in FUSIONS order, switches that turn exactly one fusion off
(its primitive ops stay), the add_rms_norm → rms_norm dependency, unknown switches refused, and the plain-op
decompositions undoing every fusion with the unfused numerics."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from onnxscript.rewriter import pattern

from helpers import FUSED_TOL, NUM_LAYERS, assert_same_logits, export_feeds, fused_ops, load_export, run_model
from omforge.passes import decompose, manager
from omforge.recipe import FUSIONS

L = NUM_LAYERS
EXPECTED = {"rms_norm": 2 * L + 1, "add_rms_norm": 2 * L, "rotary": 2 * L, "qkv_merge": L, "moe": 0,
            "gate_up_swiglu": L, "attention": L}  # dense families: no MoE block (tests/test_moe_graph.py has them)
# What each fusion leaves behind when switched off: a primitive op of its pattern and how many of it remain.
LEFT_WHEN_OFF = {"rms_norm": ("Pow", 2 * L + 1), "add_rms_norm": ("omforge::RMSNorm", 2 * L + 1),
                 "rotary": ("Neg", 2 * L), "qkv_merge": ("MatMul:q_proj", L), "moe": ("TopK", 0),
                 "gate_up_swiglu": ("Sigmoid", L), "attention": ("Softmax", L)}


def histogram(model) -> Counter:  # noqa: ANN001 - ir.Model
    ops = Counter(f"{n.domain}::{n.op_type}" if n.domain == "omforge" else n.op_type for n in model.graph)
    ops["MatMul:q_proj"] = sum(1 for n in model.graph if n.op_type == "MatMul" and "q_proj" in (n.inputs[1].name or ""))
    return ops


def test_expected_counts_are_the_fusions() -> None:
    assert tuple(EXPECTED) == FUSIONS == tuple(LEFT_WHEN_OFF)


def test_counts_in_fusions_order_and_numerics(tiny_exports: dict[str, Path]) -> None:
    """Every family, all fusions on: the exact count per pass, nothing of any pattern left, the same logits."""
    for variant, export_dir in tiny_exports.items():
        unfused, model = load_export(export_dir), load_export(export_dir)
        counts = manager.run_fusions(model)
        assert list(counts) == list(FUSIONS), variant
        assert counts == EXPECTED, variant
        ops = histogram(model)
        assert all(ops[op] == 0 for op, _ in LEFT_WHEN_OFF.values() if op != "omforge::RMSNorm"), variant
        assert ops["omforge::RMSNorm"] == 1 and ops["omforge::AddRMSNorm"] == 2 * L, variant
        assert_same_logits(unfused, model)


@pytest.mark.parametrize("off", FUSIONS)
def test_each_switch_turns_one_fusion_off(tiny_exports: dict[str, Path], off: str) -> None:
    """Switched off, a fusion counts 0 and its pattern's primitive ops remain; the others count as before
    (add_rms_norm also goes with rms_norm, which it fuses into); numerics hold."""
    unfused, model = load_export(tiny_exports["qwen2"]), load_export(tiny_exports["qwen2"])
    counts = manager.run_fusions(model, {off: False})
    off_too = {"add_rms_norm"} if off == "rms_norm" else set()
    assert counts == {name: 0 if name == off or name in off_too else n for name, n in EXPECTED.items()}
    op, remaining = LEFT_WHEN_OFF[off]
    assert histogram(model)[op] == remaining
    assert_same_logits(unfused, model)


def test_add_rms_norm_needs_rms_norm(tiny_exports: dict[str, Path]) -> None:
    """The dependency on its own: with rms_norm off, add_rms_norm finds no RMSNorm to fuse into."""
    model = load_export(tiny_exports["llama"])
    counts = manager.run_fusions(model, {name: name == "add_rms_norm" for name in FUSIONS})
    assert counts == {name: 0 for name in FUSIONS}
    assert not fused_ops(model)


def test_all_switches_off_fuse_nothing(tiny_exports: dict[str, Path]) -> None:
    model = load_export(tiny_exports["llama"])
    assert manager.run_fusions(model, {name: False for name in FUSIONS}) == {name: 0 for name in FUSIONS}
    assert not fused_ops(model)


@pytest.mark.parametrize("switches", [{"rmsnorm": False}, {"rms_norm": True, "flash_attention": True}])
def test_unknown_switch_is_an_error(tiny_exports: dict[str, Path], switches: dict[str, bool]) -> None:
    model = load_export(tiny_exports["llama"])
    with pytest.raises(ValueError, match="unknown fusion switches") as err:
        manager.run_fusions(model, switches)
    assert str(sorted(set(switches) - set(FUSIONS))) in str(err.value)
    assert not fused_ops(model)  # refused before anything ran


def test_decompositions_undo_every_fusion(tiny_exports: dict[str, Path]) -> None:
    """Fuse everything, then apply every plain-op decomposition: no neutral op is left, the default opset is
    untouched, and the logits are the unfused ones."""
    rules = pattern.RewriteRuleSet(list(decompose.RULES.values()))
    feeds = export_feeds(seed=3, batch=3, seq=11)
    for variant, export_dir in tiny_exports.items():
        unfused, model = load_export(export_dir), load_export(export_dir)
        manager.run_fusions(model)
        neutral = Counter(n.op_type for n in fused_ops(model))
        assert neutral == {"RMSNorm": 1, "AddRMSNorm": 2 * L, "Rotary": 2 * L, "SwiGLU": L, "Attention": L}
        assert rules.apply_to_model(model) == sum(neutral.values()), variant
        manager.cleanup(model)
        assert not [n for n in model.graph if n.domain == "omforge"], variant
        assert model.opset_imports[""] == 18
        ref, out = run_model(unfused, feeds)[0], run_model(model, feeds)[0]
        diff = float(np.abs(out - ref).max())
        assert diff <= FUSED_TOL, f"{variant}: max abs diff {diff:.3g}"
