"""Attention fusion: scaled dot-product with a causal mask and GQA head sharing → ``omforge.Attention(q, k, v)``.

Pattern (the export of :class:`omforge.models.llama.Attention`)::

    k' = Reshape(Expand(Unsqueeze(k, [2])))        (GQA: repeat each KV head; absent when heads are equal)
    p  = Softmax(Where(causal, -big, MatMul(q, Transpose(k', [0,1,3,2])) * scale))
    o  = MatMul(p, v')

Check: the scale is a constant scalar, the fill is ≤ -1e30 (masked positions get no probability), the mask
is the causal ``arange[None, :] > arange[:, None]`` over one ``Range`` — or that ``Or`` the sliding window's
``(arange[:, None] - arange[None, :]) >= window`` (Mistral), which becomes the ``window`` attribute — and the
head counts are static with ``q_heads % kv_heads == 0``.
"""

from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import pattern

from omforge.passes import ops
from omforge.passes.util import const_array, const_scalar


def is_causal_mask(mask: ir.Value) -> bool:
    """``Greater(Unsqueeze(r, [0]), Unsqueeze(r, [1]))`` for one value ``r``: True strictly above the diagonal."""
    node = mask.producer()
    if node is None or node.op_type != "Greater":
        return False
    cols, rows = (i.producer() if i is not None else None for i in node.inputs)
    if cols is None or rows is None or cols.op_type != "Unsqueeze" or rows.op_type != "Unsqueeze":
        return False
    axes_c, axes_r = const_array(cols.inputs[1]), const_array(rows.inputs[1])
    return (cols.inputs[0] is rows.inputs[0] and axes_c is not None and axes_r is not None
            and axes_c.tolist() == [0] and axes_r.tolist() == [1])


def mask_window(mask: ir.Value) -> int | None:
    """0 for the causal mask, ``W`` for causal ``Or`` a sliding window of ``W`` keys, None for anything else."""
    if is_causal_mask(mask):
        return 0
    node = mask.producer()
    if node is None or node.op_type != "Or":
        return None
    for causal, other in (node.inputs, reversed(node.inputs)):
        if causal is None or other is None or not is_causal_mask(causal):
            continue
        ge = other.producer()
        if ge is None or ge.op_type != "GreaterOrEqual":
            continue
        sub, width = ge.inputs[0].producer(), const_scalar(ge.inputs[1])
        if sub is None or sub.op_type != "Sub" or width is None or width < 1:
            continue
        rows, cols = (i.producer() for i in sub.inputs)
        r = causal.producer().inputs[0].producer().inputs[0]  # the causal mask's arange
        if rows is None or cols is None or not rows.op_type == cols.op_type == "Unsqueeze":
            continue
        axes = [const_array(u.inputs[1]) for u in (rows, cols)]
        if (rows.inputs[0] is r and cols.inputs[0] is r and all(a is not None for a in axes)
                and axes[0].tolist() == [1] and axes[1].tolist() == [0]):
            return int(width)
    return None


class AttentionFusion(pattern.RewriteRuleClassBase):
    """``gqa``: K and V are repeated to the query heads first (Unsqueeze → Expand → Reshape), else used as they are."""

    def __init__(self, name: str, gqa: bool):
        super().__init__(name)
        self.gqa = gqa

    def pattern(self, op, q, k, v, scale, mask, fill, axes_k, axes_v, ek, rk, ev, rv):  # noqa: ANN001, ANN201
        if self.gqa:
            k = op.Reshape(op.Expand(op.Unsqueeze(k, axes_k), ek), rk, _allow_other_attributes=True)
            v = op.Reshape(op.Expand(op.Unsqueeze(v, axes_v), ev), rv, _allow_other_attributes=True)
        scores = op.Mul(op.MatMul(q, op.Transpose(k, perm=[0, 1, 3, 2])), scale)
        probs = op.Softmax(op.Where(mask, fill, scores), axis=-1)
        return op.MatMul(probs, v)

    def check(self, context, q, k, scale, mask, fill, **kw) -> pattern.MatchResult:  # noqa: ANN001
        result = pattern.MatchResult()
        if const_scalar(scale) is None:
            return result.fail("scale is not a constant scalar", scale)
        f = const_scalar(fill)
        if f is None or f > -1e30:
            return result.fail("masked fill is not a large negative constant", fill)
        if mask_window(mask) is None:
            return result.fail("mask is not the causal arange comparison (or it and a sliding window)", mask)
        for axes in (kw.get("axes_k"), kw.get("axes_v")):
            if axes is not None and (const_array(axes) is None or const_array(axes).tolist() != [2]):
                return result.fail("GQA repeat is not an Unsqueeze at axis 2", axes)
        if q.shape is None or k.shape is None or not isinstance(q.shape[1], int) or not isinstance(k.shape[1], int):
            return result.fail("head counts are not static", q)
        if q.shape[1] % k.shape[1]:
            return result.fail("query heads are not a multiple of KV heads", k)
        return result

    def rewrite(self, op, q, k, v, scale, mask, **_):  # noqa: ANN001, ANN201
        window = mask_window(mask)
        return op.Attention(q, k, v, scale=float(const_scalar(scale)), q_heads=int(q.shape[1]),
                            kv_heads=int(k.shape[1]), **({"window": window} if window else {}), _domain=ops.DOMAIN)


RULES = pattern.RewriteRuleSet([AttentionFusion.rule("attention_gqa", True),
                                AttentionFusion.rule("attention_mha", False)])
