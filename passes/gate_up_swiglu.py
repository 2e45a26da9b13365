"""Gate/up merge + SwiGLU: ``MatMul(x, Wg)·Sigmoid(MatMul(x, Wg)) · MatMul(x, Wu)`` →
``omforge.SwiGLU(MatMul(x, [Wg | Wu]))``.

Two GEMMs over the same activation become one twice as wide (one read of ``x``, one kernel launch), and the
activation becomes one op. Check: both weights are constant 2-D matrices with the same shape.
"""

from __future__ import annotations

from onnxscript.rewriter import pattern

from omforge.passes import ops
from omforge.passes.util import concat_lazy, const_shape


class GateUpSwiGLUFusion(pattern.RewriteRuleClassBase):
    def pattern(self, op, x, w_gate, w_up):  # noqa: ANN001, ANN201
        gate = op.MatMul(x, w_gate)
        up = op.MatMul(x, w_up)
        return op.Mul(op.Mul(gate, op.Sigmoid(gate)), up)

    def check(self, context, w_gate, w_up, **_) -> pattern.MatchResult:  # noqa: ANN001
        result = pattern.MatchResult()
        g, u = const_shape(w_gate), const_shape(w_up)
        if g is None or u is None or len(g) != 2 or g != u:
            return result.fail("gate/up weights are not constant matrices of one shape", w_gate)
        return result

    def rewrite(self, op, x, w_gate, w_up, **_):  # noqa: ANN001, ANN201
        name = (w_gate.name.replace("gate_proj", "gate_up_proj") if "gate_proj" in w_gate.name
                else w_gate.name + ".gate_up")
        weight = op.initializer(concat_lazy([w_gate, w_up], axis=1, name=name).const_value, name=name)
        return op.SwiGLU(op.MatMul(x, weight), _domain=ops.DOMAIN)


RULES = pattern.RewriteRuleSet([GateUpSwiGLUFusion.rule("gate_up_swiglu")])
