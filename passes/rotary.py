"""Rotary embedding fusion: ``x·cos + Concat(-x[..., D/2:], x[..., :D/2])·sin`` → ``omforge.Rotary(x, cos, sin)``.

The rotate-half (GPT-NeoX / Llama) form. Check: x is ``[B, H, S, D]`` and cos/sin ``[B, 1, S, D]`` (the neutral
op's contract; dims compared where both are known), the two slices are exactly the halves of the last axis
(start D/2 to end, and 0 to D/2, step 1, D even) and the concat is on the last axis.
"""

from __future__ import annotations

from onnxscript.rewriter import pattern

from omforge.passes import ops
from omforge.passes.util import const_array, dims_agree

_INT64_MAX = 2**63 - 1


class RotaryFusion(pattern.RewriteRuleClassBase):
    def pattern(self, op, x, cos, sin, s1, e1, a1, t1, s2, e2, a2, t2):  # noqa: ANN001, ANN201
        second = op.Slice(x, s1, e1, a1, t1)
        first = op.Slice(x, s2, e2, a2, t2)
        rotated = op.Concat(op.Neg(second), first, axis=-1)
        return op.Add(op.Mul(x, cos), op.Mul(rotated, sin))

    def check(self, context, x, cos, sin, s1, e1, a1, t1, s2, e2, a2, t2, **_) -> pattern.MatchResult:  # noqa: ANN001
        result = pattern.MatchResult()
        if x.shape is None or not isinstance(x.shape[-1], int):
            return result.fail("head dimension is not static", x)
        dim, rank = x.shape[-1], x.shape.rank()
        if rank != 4 or any(t.shape is None or t.shape.rank() != 4 or t.shape[1] != 1
                            or not dims_agree(t.shape, x.shape, (0, 2, 3)) for t in (cos, sin)):
            return result.fail("not x [B, H, S, D] with cos/sin [B, 1, S, D]", x)
        vals = [const_array(v) for v in (s1, e1, a1, t1, s2, e2, a2, t2)]
        if any(v is None or v.size != 1 for v in vals):
            return result.fail("slice bounds are not constant scalars")
        s1v, e1v, a1v, t1v, s2v, e2v, a2v, t2v = (int(v.reshape(())) for v in vals)
        last = (rank - 1, -1)
        if a1v not in last or a2v not in last or t1v != 1 or t2v != 1:
            return result.fail("slices are not unit-step slices of the last axis")
        if dim % 2 or s1v != dim // 2 or e1v < dim or s2v != 0 or e2v != dim // 2:
            return result.fail("slices are not the two halves of the head dimension")
        return result

    def rewrite(self, op, x, cos, sin, **_):  # noqa: ANN001, ANN201
        return op.Rotary(x, cos, sin, _domain=ops.DOMAIN)


RULES = pattern.RewriteRuleSet([RotaryFusion.rule("rotary")])
