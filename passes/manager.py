"""The pass manager: fusions in a fixed order, each behind its recipe switch, with a count per pass.

Order matters and is fixed: ``rms_norm`` before ``add_rms_norm`` (which fuses the residual Add into an
RMSNorm), ``rotary`` before ``attention`` (whose q/k are the rotary outputs), ``qkv_merge`` and
``gate_up_swiglu`` anywhere (they touch only projections). After the fusions, dead nodes are removed and
common subexpressions merged.
"""

from __future__ import annotations

from typing import Callable, Mapping

import onnx_ir as ir
import onnx_ir.passes.common as common
from onnxscript.rewriter import pattern

from omforge.passes import add_rms_norm, attention, gate_up_swiglu, qkv_merge, rms_norm, rotary
from omforge.recipe import FUSIONS

_PASSES: dict[str, Callable[[ir.Model], int] | pattern.RewriteRuleSet] = {
    "rms_norm": rms_norm.RULES,
    "add_rms_norm": add_rms_norm.RULES,
    "rotary": rotary.RULES,
    "qkv_merge": qkv_merge.apply,
    "gate_up_swiglu": gate_up_swiglu.RULES,
    "attention": attention.RULES,
}
assert tuple(_PASSES) == FUSIONS, "pass order and the recipe's fusion switches must agree"


def cleanup(model: ir.Model) -> None:
    common.RemoveUnusedNodesPass()(model)
    common.CommonSubexpressionEliminationPass()(model)
    common.RemoveUnusedNodesPass()(model)


def run_fusions(model: ir.Model, switches: Mapping[str, bool] | None = None) -> dict[str, int]:
    """Apply the enabled fusions to ``model`` in place, in :data:`FUSIONS` order; returns matches per fusion
    (0 for a disabled one). ``switches`` defaults to all on; unknown names are an error."""
    switches = dict(switches or {})
    unknown = set(switches) - set(FUSIONS)
    if unknown:
        raise ValueError(f"unknown fusion switches: {sorted(unknown)}; known: {', '.join(FUSIONS)}")
    counts = {}
    for name, p in _PASSES.items():
        if not switches.get(name, True):
            counts[name] = 0
            continue
        counts[name] = p.apply_to_model(model) if isinstance(p, pattern.RewriteRuleSet) else p(model)
    cleanup(model)
    return counts
