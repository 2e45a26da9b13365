"""The fusion passes: onnx-ir passes in a fixed order, each behind its recipe switch, with a count per pass.

Order matters and is fixed: ``rms_norm`` before ``add_rms_norm`` (which fuses the residual Add into an
RMSNorm), ``rotary`` before ``attention`` (whose q/k are the rotary outputs), ``moe`` before ``gate_up_swiglu``
(which would fuse each expert's gate/up on its own; with ``moe`` off it does, E per layer), ``qkv_merge`` and
``gate_up_swiglu`` anywhere else (they touch only projections). After the fusions, dead nodes are removed and
common subexpressions merged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import onnx_ir as ir
import onnx_ir.passes.common as common
from onnxscript.rewriter import pattern

from omforge.contract import FUSIONS
from omforge.passes import add_rms_norm, attention, gate_up_swiglu, moe, qkv_merge, rms_norm, rotary

_PASSES: dict[str, Callable[[ir.Model], int] | pattern.RewriteRuleSet] = {
    "rms_norm": rms_norm.RULES,
    "add_rms_norm": add_rms_norm.RULES,
    "rotary": rotary.RULES,
    "qkv_merge": qkv_merge.apply,
    "moe": moe.apply,
    "gate_up_swiglu": gate_up_swiglu.RULES,
    "attention": attention.RULES,
}
assert tuple(_PASSES) == FUSIONS, "pass order and the recipe's fusion switches must agree"


class Fusion(ir.passes.InPlacePass):
    """One fusion of :data:`FUSIONS`, by name; ``count``: its matches in the last run."""

    def __init__(self, name: str):
        super().__init__()
        if name not in _PASSES:
            raise ValueError(f"unknown fusion {name!r}; known: {', '.join(FUSIONS)}")
        self.name, self.count = name, 0

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        p = _PASSES[self.name]
        self.count = p.apply_to_model(model) if isinstance(p, pattern.RewriteRuleSet) else p(model)
        return ir.passes.PassResult(model, modified=self.count > 0)


class Cleanup(ir.passes.InPlacePass):
    """Dead nodes removed and common subexpressions merged (after the fusions, after a lowering)."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        for p in (common.RemoveUnusedNodesPass(), common.CommonSubexpressionEliminationPass(),
                  common.RemoveUnusedNodesPass()):
            modified |= p(model).modified
        return ir.passes.PassResult(model, modified=modified)


def fusion_passes(switches: Mapping[str, bool] | None = None) -> list[Fusion]:
    """The enabled fusions in :data:`FUSIONS` order (``switches`` default all on; unknown names are an error)."""
    switches = dict(switches or {})
    unknown = set(switches) - set(FUSIONS)
    if unknown:
        raise ValueError(f"unknown fusion switches: {sorted(unknown)}; known: {', '.join(FUSIONS)}")
    return [Fusion(name) for name in FUSIONS if switches.get(name, True)]


def cleanup(model: ir.Model) -> None:
    Cleanup()(model)


def run_fusions(model: ir.Model, switches: Mapping[str, bool] | None = None) -> dict[str, int]:
    """Apply the enabled fusions to ``model`` in place, in :data:`FUSIONS` order, then :class:`Cleanup`; returns
    matches per fusion (0 for a disabled one)."""
    passes = fusion_passes(switches)
    ir.passes.PassManager([*passes, Cleanup()])(model)
    counts = {p.name: p.count for p in passes}
    return {name: counts.get(name, 0) for name in FUSIONS}
