"""RMSNorm fusion: ``w * (x * Reciprocal(Sqrt(ReduceMean(Pow(x, 2), [-1]) + eps)))`` → ``omforge.RMSNorm``.

Matches the export of :class:`omforge.models.llama.RMSNorm` (either operand order of the scaling Muls), the
decoder's norms over ``[B, S, hidden]`` and Qwen3's per-head q/k norms over the last axis of ``[B, S, H, head_dim]``
alike (so ``omforge diff --per-fusion``'s rms_norm row covers those too).
Check: the exponent is 2, the reduction is over the last axis only with keepdims (set, or left at its
default), epsilon is a scalar constant and the weight is a 1-D constant as long as the normalized axis.
"""

from __future__ import annotations

from onnxscript.rewriter import pattern

from omforge.passes import ops
from omforge.passes.util import const_array, const_scalar


class RMSNormFusion(pattern.RewriteRuleClassBase):
    """``weight_first``: the scaling Mul is ``Mul(w, normed)``, else ``Mul(normed, w)``."""

    def __init__(self, name: str, weight_first: bool = True):
        super().__init__(name)
        self.weight_first = weight_first

    def pattern(self, op, x, weight, two, axes, eps):  # noqa: ANN001, ANN201
        mean = op.ReduceMean(op.Pow(x, two), axes, _allow_other_attributes=True, _outputs=["mean"])
        inv_rms = op.Reciprocal(op.Sqrt(op.Add(mean, eps)))
        normed = pattern.OrValue([op.Mul(x, inv_rms), op.Mul(inv_rms, x)])
        return op.Mul(weight, normed, _outputs=["y"]) if self.weight_first else op.Mul(normed, weight, _outputs=["y"])

    def check(self, context, x, weight, two, axes, eps, mean, **_) -> pattern.MatchResult:  # noqa: ANN001
        result = pattern.MatchResult()
        if const_scalar(two) != 2.0:
            return result.fail("exponent is not 2", two)
        if mean.producer().attributes.get_int("keepdims", 1) != 1:  # absent means the default, 1
            return result.fail("the reduction drops the axis", mean)
        ax = const_array(axes)
        if ax is None or ax.tolist() not in ([-1], [len(x.shape) - 1] if x.shape else [-1]):
            return result.fail("not a reduction over the last axis", axes)
        if const_scalar(eps) is None:
            return result.fail("epsilon is not a constant scalar", eps)
        w = const_array(weight)
        if w is None or w.ndim != 1 or (x.shape is not None and x.shape[-1] != w.shape[0]):
            return result.fail("weight is not a constant vector over the last axis", weight)
        return result

    def rewrite(self, op, x, weight, eps, **_):  # noqa: ANN001, ANN201
        return op.RMSNorm(x, weight, epsilon=float(const_scalar(eps)), _domain=ops.DOMAIN)


RULES = pattern.RewriteRuleSet([RMSNormFusion.rule("rms_norm"), RMSNormFusion.rule("rms_norm_swapped", False)])
