"""``omforge.MoE`` on Ascend: CANN's MoE op chain where every kernel of it ships for the SoC, else plain ops.

The chain (the order and layouts of vllm-ascend's ``fused_experts`` for Qwen3-MoE at 936c1021, 2025-08-28:
``vllm_ascend/ops/fused_moe.py:771-834``, ``vllm_ascend/ops/layers/experts_selector.py:206-209``), T tokens,
E experts, k = ``top_k``, every op an own plugin (:mod:`omforge.compile.ascend.atc_plugins`) mapping to the GE op::

  w, ids, rows = OmMoeGatingTopKSoftmax(logits [T, E]; k)          → MoeGatingTopKSoftmax
                   w = topk(softmax(logits)) [T, k] (logits' dtype), ids [T, k] int32,
                   rows[t, j] = j·T + t int32 (aclnnMoeGatingTopKSoftmax.md: rowIdxOut)
  w = w · 1/Σw                                                       normalize = 1: plain ops, a float32 island
  ex, erow, eids = OmMoeInitRouting(x [T, H], rows, ids; active_num) → MoeInitRouting
                   sortedExpertIdx, sortedRowIdx = keyValueSort(ids, rows); ex[i] = x[sortedRowIdx[i] % T]
                   [T·k, H]; erow[sortedRowIdx[i]] = i [T·k] int32; eids = sortedExpertIdx [T·k] int32
  ends = OmMoeComputeExpertTokens(eids; num_experts=E)              → MoeComputeExpertTokens
                   ends[e] = the number of rows of experts ≤ e [E] int32 (BinarySearch), i.e. cumulative
  groups = Cast(ends, int64)                                        GroupedMatmul's group_list is int64
  h = OmGroupedMatmul(ex, gate_up [E, H, 2F], "" ×5, groups;        → GroupedMatmul: rows of expert e (between
                      split_item=2, group_type=0, group_list_type=0)   groups[e-1] and groups[e]) @ gate_up[e]
  a = SwiGlu(h; dim=-1)                                             silu(h[:, :F]) · h[:, F:]: our [gate | up]
  d = OmGroupedMatmul(a, down [E, F, H], "" ×5, groups; …)          [T·k, H]
  y = OmMoeFinalizeRoutingV2(d, erow, "", "", "", w; drop_pad_mode=0)  → MoeFinalizeRoutingV2
                   y[t] = Σ_j w[t, j] · d[erow[t + j·T]] (aclnnMoeFinalizeRoutingV2.md; mode 0: column order,
                   the order of MoeGatingTopKSoftmax's rows)

``x`` and the logits are flattened to 2-D first (MoeInitRouting takes a 2-D x) and ``y`` takes ``x``'s shape.
``active_num`` is 2^31 - 1: MoeInitRouting keeps ``min(T, active_num)·k`` rows (its infershape.cpp:197), and
the OM's token count changes per gear while an attribute cannot. Weights need no transposition: our
``gate_up [E, H, 2F]`` is vllm-ascend's ``w13.transpose(1, 2)`` (gate then up) and ``down [E, F, H]`` its
``w2.transpose(1, 2)``. vllm-ascend left MoeFinalizeRouting for MoeTokenUnpermute in 2026 ("will lead to accuracy
issues", ``vllm_ascend/ops/fused_moe/moe_comm_method.py:186-193`` at 182b75e) without saying which case: a
first-run risk (docs/ascend.md).

``plain=True`` (the twin the tests' FAKE pyACL runs): each op of the chain as its document's formula in plain
ONNX ops (TopK, ScatterElements, Gather…), so the wiring between them — ``rows``' column order, ``erow``'s
inverse map, the cumulative ``groups`` — is exercised; the twin is never handed to ATC.

Where a kernel of the chain does not ship (:data:`~omforge.passes.ascend.kernels.MOE_KERNELS`; 310P and 310B),
:func:`plain_moe`: every expert on every token (``decompose.moe``'s dense form) with the routing built without
TopK or ScatterElements, whose CANN forms are not usable there (GE TopK takes an int32 ``k``, ONNX gives int64:
hicann/ops-math ``math/topk/op_graph/topk_proto.h:32``; ScatterElementsV2's prototype says Atlas A2/A3 only,
kernels.py): k rounds of "the largest probability not yet chosen, the lowest expert index among equals" — torch's
``topk`` order — in a float32 island (passes/float16.py marked islands), so a float16 graph ranks float32
probabilities. The softmax there is written out (max, Exp, sum, Reciprocal): a ``Softmax`` node would be a float32
island of its own whose float16 output the ranking would then read.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from omforge.passes import ops
from omforge.passes.float16 import ISLAND_IN, ISLAND_OUT

ACTIVE_NUM = 2**31 - 1
"""MoeInitRouting's ``active_num``: at least every gear's token count (module docstring)."""
I32, I64, F32 = ir.DataType.INT32, ir.DataType.INT64, ir.DataType.FLOAT
GMM_INPUTS_AT = (0, 1, 7)
"""The IR indices of OmGroupedMatmul's inputs: x 0, weight 1, group_list 7 (bias, scale, offset, antiquant_scale,
antiquant_offset empty between: hicann/ops-transformer c29bc10 ``gmm/grouped_matmul/op_host/grouped_matmul_def.cpp
:22-107``)."""
FINALIZE_INPUTS_AT = (0, 1, 5)
"""The IR indices of OmMoeFinalizeRoutingV2's inputs: expanded_x 0, expanded_row_idx 1, scales 5 (x1, x2, bias
empty between: ``moe/moe_finalize_routing_v2/op_graph/moe_finalize_routing_v2_proto.h:53-58``)."""


def _typed(value: ir.Value, dtype: ir.DataType) -> ir.Value:
    """``value`` with its element type set (the float16 pass types an untyped plugin output as its input 0)."""
    value.type = ir.TensorType(dtype)
    return value


def softmax_f32(op, logits, name: str):  # noqa: ANN001, ANN201
    """softmax over the last axis in float32, opening a marked float32 island at ``logits`` (module docstring)."""
    last = op.Constant(value_ints=[-1])
    x = op.Cast(logits, to=F32, _outputs=[f"{ISLAND_IN}{name}.logits"])
    e = op.Exp(op.Add(x, op.Neg(op.ReduceMax(x, last, keepdims=1))))
    return op.Mul(e, op.Reciprocal(op.ReduceSum(e, last, keepdims=1)))


def _renormalize(op, w):  # noqa: ANN001, ANN202
    return op.Mul(w, op.Reciprocal(op.ReduceSum(w, op.Constant(value_ints=[-1]), keepdims=1)))


def routing_weights(op, logits, *, experts: int, top_k: int, normalize: bool, dtype: ir.DataType, name: str):  # noqa: ANN001, ANN201
    """The routing matrix ``[T, E]`` (the chosen experts' weights, 0 elsewhere) without TopK: ``top_k`` rounds
    each choose, per token, the largest probability not chosen yet, the lowest expert index among equals. In
    float32 (a marked island), left as ``dtype``."""
    p = softmax_f32(op, logits, name)
    last = op.Constant(value_ints=[-1])
    descending = op.Constant(value=ir.tensor(np.arange(experts, 0, -1, dtype=np.float32)))  # E - e
    gone = op.Constant(value_float=-1.0)  # below every probability
    left, chosen = p, None
    for _ in range(top_k):
        best = op.Equal(left, op.ReduceMax(left, last, keepdims=1))
        order = op.Where(best, descending, op.Constant(value_float=0.0))
        first = op.Equal(order, op.ReduceMax(order, last, keepdims=1))  # the lowest index among the best
        chosen = first if chosen is None else op.Or(chosen, first)
        left = op.Where(first, gone, left)
    w = op.Where(chosen, p, op.Constant(value_float=0.0))
    if normalize:
        w = _renormalize(op, w)
    return op.Cast(w, to=dtype, _outputs=[f"{ISLAND_OUT}{name}.routing"])


def plain_moe(op, x, logits, gate_up, down, *, top_k: int, normalize: bool, name: str,  # noqa: ANN001, ANN201
              dtype: ir.DataType):
    """The MoE in plain ops with a row of the CANN matrix (module docstring): ``[T, H]`` out of 2-D ``x`` (of
    ``dtype``)."""
    experts = gate_up.shape[0]
    routing = routing_weights(op, logits, experts=experts, top_k=top_k, normalize=normalize, dtype=dtype, name=name)
    gate, up = op.Split(op.MatMul(op.Unsqueeze(x, op.Constant(value_ints=[0])), gate_up), axis=-1, num_outputs=2,
                        _outputs=2)  # [E, T, F] each
    out = op.MatMul(op.Mul(op.Mul(gate, op.Sigmoid(gate)), up), down)  # [E, T, H]
    scale = op.Unsqueeze(op.Transpose(routing, perm=[1, 0]), op.Constant(value_ints=[2]))  # [E, T, 1]
    return op.ReduceSum(op.Mul(scale, out), op.Constant(value_ints=[0]), keepdims=0)


def chain(op, x, logits, gate_up, down, *, top_k: int, normalize: bool, name: str,  # noqa: ANN001, ANN201
          dtype: ir.DataType):
    """CANN's chain (module docstring) over 2-D ``x [T, H]`` and ``logits [T, E]`` (both of ``dtype``):
    ``[T, H]``."""
    experts = gate_up.shape[0]
    w, ids, rows = op.OmMoeGatingTopKSoftmax(logits, k=top_k, _outputs=3)
    _typed(ids, I32)
    _typed(rows, I32)
    if normalize:  # float32 island: Cast up, the sum, Cast back
        w = op.Cast(_renormalize(op, op.Cast(w, to=F32, _outputs=[f"{ISLAND_IN}{name}.weights"])), to=dtype,
                    _outputs=[f"{ISLAND_OUT}{name}.weights"])
    ex, erow, eids = op.OmMoeInitRouting(x, rows, ids, active_num=ACTIVE_NUM, _outputs=3)
    _typed(erow, I32)
    _typed(eids, I32)
    ends = _typed(op.OmMoeComputeExpertTokens(eids, num_experts=experts), I32)
    groups = op.Cast(ends, to=I64)
    gmm = dict(split_item=2, group_type=0, group_list_type=0)
    h = op.OmGroupedMatmul(ex, gate_up, groups, **gmm)  # inputs moved to their IR indices after the rewrite
    d = op.OmGroupedMatmul(op.SwiGlu(h, dim=-1), down, groups, **gmm)
    return op.OmMoeFinalizeRoutingV2(d, erow, w, drop_pad_mode=0)


def twin_gating(op, logits, *, top_k: int, name: str, dtype: ir.DataType):  # noqa: ANN001, ANN201
    """MoeGatingTopKSoftmax: ``(y, expert_idx, row_idx)`` = topk of softmax (in float32: the island closes at both
    TopK outputs), ``row_idx[t, j] = j·T + t`` (aclnnMoeGatingTopKSoftmax.md: rowIdxOut)."""
    zero, one = op.Constant(value_int=0), op.Constant(value_int=1)
    values, index = op.TopK(softmax_f32(op, logits, name), op.Constant(value_ints=[top_k]), axis=-1, largest=1,
                            sorted=1, _outputs=2)
    _typed(values, F32)
    _typed(index, I64)
    w = op.Cast(values, to=dtype, _outputs=[f"{ISLAND_OUT}{name}.values"])
    ids = op.Cast(index, to=I32, _outputs=[f"{ISLAND_OUT}{name}.ids"])
    tokens = op.Gather(op.Shape(logits), zero, axis=0)
    shape = op.Concat(op.Constant(value_ints=[top_k]), op.Unsqueeze(tokens, op.Constant(value_ints=[0])), axis=0)
    rows = op.Transpose(op.Reshape(op.Range(zero, op.Mul(tokens, op.Constant(value_int=top_k)), one), shape),
                        perm=[1, 0])
    return w, ids, rows


def twin_init_routing(op, x, rows, ids):  # noqa: ANN001, ANN201
    """MoeInitRouting: ``sortedExpertIdx, sortedRowIdx = keyValueSort(expert_idx, row_idx)`` (the keys
    ``expert · T·k + row`` are unique: any sort gives this order); ``expanded_x[i] = x[sortedRowIdx[i] % T]``,
    ``expanded_row_idx[sortedRowIdx[i]] = i``; returns those and ``sortedExpertIdx`` (int64)."""
    zero, one, flat = op.Constant(value_int=0), op.Constant(value_int=1), op.Constant(value_ints=[-1])
    e64, r64 = op.Reshape(op.Cast(ids, to=I64), flat), op.Reshape(op.Cast(rows, to=I64), flat)
    total = op.Gather(op.Shape(e64), zero, axis=0)
    _, perm = op.TopK(op.Add(op.Mul(e64, total), r64), op.Unsqueeze(total, op.Constant(value_ints=[0])), axis=0,
                      largest=0, sorted=1, _outputs=2)
    _typed(perm, I64)
    sorted_rows, sorted_ids = op.Gather(r64, perm, axis=0), op.Gather(e64, perm, axis=0)
    expanded_row_idx = op.ScatterElements(sorted_rows, sorted_rows, op.Range(zero, total, one), axis=0)
    tokens = op.Gather(op.Shape(x), zero, axis=0)
    return op.Gather(x, op.Mod(sorted_rows, tokens), axis=0), expanded_row_idx, sorted_ids


def twin_compute_expert_tokens(op, sorted_ids, *, experts: int):  # noqa: ANN001, ANN201
    """MoeComputeExpertTokens: ``out[e]`` = the end of expert e's rows in the sorted array (BinarySearch) = the
    number of rows of experts ≤ e (int64)."""
    below = op.LessOrEqual(op.Unsqueeze(sorted_ids, op.Constant(value_ints=[0])),
                           op.Constant(value=ir.tensor(np.arange(experts)[:, None])))  # [E, R]
    return op.ReduceSum(op.Cast(below, to=I64), op.Constant(value_ints=[1]), keepdims=0)


def twin_grouped_matmul(op, a, weight, group_list):  # noqa: ANN001, ANN201
    """GroupedMatmul, group_type 0, group_list_type 0 (cumulative): row r of ``a`` times ``weight[e]`` for the
    expert e whose range ``[group_list[e-1], group_list[e])`` holds r, i.e. ``e = #(group_list <= r)``."""
    r = op.Range(op.Constant(value_int=0), op.Gather(op.Shape(a), op.Constant(value_int=0), axis=0),
                 op.Constant(value_int=1))
    owner = op.ReduceSum(op.Cast(op.LessOrEqual(op.Unsqueeze(group_list, op.Constant(value_ints=[0])),
                                                op.Unsqueeze(r, op.Constant(value_ints=[1]))), to=I64),
                         op.Constant(value_ints=[1]), keepdims=0)  # [R]
    per_row = op.Gather(weight, owner, axis=0)  # [R, K, N]
    one = op.Constant(value_ints=[1])
    return op.Squeeze(op.MatMul(op.Unsqueeze(a, one), per_row), one)


def twin_finalize_routing(op, d, expanded_row_idx, scales, *, top_k: int):  # noqa: ANN001, ANN201
    """MoeFinalizeRoutingV2, drop_pad_mode 0: ``y[t] = Σ_j scales[t, j] · d[expanded_row_idx[t + j·T]]``."""
    at = op.Transpose(op.Reshape(expanded_row_idx, op.Constant(value_ints=[top_k, -1])), perm=[1, 0])  # [T, k]
    picked = op.Gather(d, at, axis=0)  # [T, k, H]
    weights = op.Unsqueeze(op.CastLike(scales, d), op.Constant(value_ints=[2]))
    return op.ReduceSum(op.Mul(picked, weights), op.Constant(value_ints=[1]), keepdims=0)


def twin_chain(op, x, logits, gate_up, down, *, top_k: int, normalize: bool, name: str,  # noqa: ANN001, ANN201
               dtype: ir.DataType):
    """The chain (``plain=True``) with each op as its document's formula in plain ops: the ``twin_*`` functions,
    wired as :func:`chain` wires the CANN ops."""
    w, ids, rows = twin_gating(op, logits, top_k=top_k, name=name, dtype=dtype)
    if normalize:
        w = op.Cast(_renormalize(op, op.Cast(w, to=F32, _outputs=[f"{ISLAND_IN}{name}.weights"])), to=dtype,
                    _outputs=[f"{ISLAND_OUT}{name}.weights"])
    ex, erow, sorted_ids = twin_init_routing(op, x, rows, ids)
    groups = twin_compute_expert_tokens(op, sorted_ids, experts=gate_up.shape[0])
    gate, up = op.Split(twin_grouped_matmul(op, ex, gate_up, groups), axis=-1, num_outputs=2, _outputs=2)
    d = twin_grouped_matmul(op, op.Mul(op.Mul(gate, op.Sigmoid(gate)), up), down, groups)  # [T·k, H]
    return twin_finalize_routing(op, d, erow, w, top_k=top_k)


class LowerMoE(pattern.RewriteRuleClassBase):
    """``omforge.MoE`` → :func:`chain` (``fused``), :func:`twin_chain` (``fused`` and ``plain``) or
    :func:`plain_moe`. Needs static ``[E, H, 2F]`` / ``[E, F, H]`` weights."""

    def __init__(self, fused: bool, plain: bool):
        super().__init__(f"ascend_moe_{'chain' if fused else 'plain'}{'_twin' if fused and plain else ''}")
        self.fused, self.plain, self.count = fused, plain, 0

    def pattern(self, op, x, logits, gate_up, down):  # noqa: ANN001, ANN201
        return op.MoE(x, logits, gate_up, down, _domain=ops.DOMAIN, _allow_other_attributes=True, _outputs=["y"])

    def check(self, context, x, logits, gate_up, down, **_) -> pattern.MatchResult:  # noqa: ANN001
        result = pattern.MatchResult()
        gu, d = gate_up.shape, down.shape
        if gu is None or d is None or len(gu) != 3 or len(d) != 3 or not all(isinstance(n, int) for n in (*gu, *d)):
            return result.fail("the stacked expert weights' shapes are not static [E, H, 2F] / [E, F, H]", gate_up)
        if len({v.dtype for v in (x, logits, gate_up, down)} - {None}) > 1:
            return result.fail("x, the router logits and the expert weights are not of one float type", x)
        return result

    def rewrite(self, op, x, logits, gate_up, down, y, **_):  # noqa: ANN001, ANN201
        a = y.producer().attributes
        experts, hidden, _ = gate_up.shape
        self.count += 1
        args = dict(top_k=int(a["top_k"].value), normalize=bool(a["normalize"].value), name=f"moe{self.count}",
                    dtype=x.dtype if x.dtype is not None else F32)
        x2 = op.Reshape(x, op.Constant(value_ints=[-1, hidden]))
        logits2 = op.Reshape(logits, op.Constant(value_ints=[-1, experts]))
        body = plain_moe if not self.fused else twin_chain if self.plain else chain
        return op.Reshape(body(op, x2, logits2, gate_up, down, **args), op.Shape(x))


IR_INPUTS_AT: dict[str, tuple[int, ...]] = {"OmGroupedMatmul": GMM_INPUTS_AT,
                                            "OmMoeFinalizeRoutingV2": FINALIZE_INPUTS_AT}
"""Plugin nodes whose optional inputs between the given ones are left empty (:func:`lower._inputs_at_ir_indices`)."""
