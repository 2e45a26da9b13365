"""Residual Add + RMSNorm fusion: ``s = Add(a, b); y = omforge.RMSNorm(s, w)``
→ ``omforge.AddRMSNorm(a, b, w) -> (y, s)``.

Runs after :mod:`rms_norm`. The sum stays an output because the residual stream reads it on; the fused
op is the one kernel that does both (ORT's SkipSimplifiedLayerNormalization, CANN's AddRmsNorm).
Check: the two operands have one shape, compared where both are known (any such Add feeding an RMSNorm is a
residual add; a broadcasting one is not, and SkipSimplifiedLayerNormalization refuses e.g. a [1, 1, H] skip).
"""

from __future__ import annotations

from onnxscript.rewriter import pattern

from omforge.passes import ops
from omforge.passes.util import dims_agree


class AddRMSNormFusion(pattern.RewriteRuleClassBase):
    def pattern(self, op, a, b, weight):  # noqa: ANN001, ANN201
        total = op.Add(a, b)
        y = op.RMSNorm(total, weight, _domain=ops.DOMAIN, _allow_other_attributes=True, _outputs=["y"])
        return y, total

    def check(self, context, a, b, y, **_) -> pattern.MatchResult:  # noqa: ANN001
        result = pattern.MatchResult()
        if a.shape is not None and b.shape is not None:
            if a.shape.rank() != b.shape.rank():
                return result.fail("residual operands differ in rank (broadcasting add)", a)
            if not dims_agree(a.shape, b.shape):
                return result.fail("residual operands differ in shape (broadcasting add)", a)
        return result

    def rewrite(self, op, a, b, weight, y, **_):  # noqa: ANN001, ANN201
        eps = y.producer().attributes["epsilon"].value
        return op.AddRMSNorm(a, b, weight, epsilon=eps, _domain=ops.DOMAIN, _outputs=2)


RULES = pattern.RewriteRuleSet([AddRMSNormFusion.rule("add_rms_norm")])
