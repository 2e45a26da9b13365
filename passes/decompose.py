"""Plain-op decompositions of the neutral ``omforge`` ops: the fallback any target can run.

Each rule rewrites one neutral op into standard ONNX ops (opset ≤ 18) with the same numerics as the
export it was fused from. Lowerings use these for ops a target has no kernel for.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from omforge.passes import ops

_NEG_BIG = float(np.finfo(np.float32).min)


def rms_norm(op, x, weight, eps: float):  # noqa: ANN001, ANN201
    mean = op.ReduceMean(op.Pow(x, op.Constant(value_float=2.0)), op.Constant(value_ints=[-1]), keepdims=1)
    inv_rms = op.Reciprocal(op.Sqrt(op.Add(mean, op.Constant(value_float=eps))))
    return op.Mul(weight, op.Mul(x, inv_rms))


def window_of(node: ir.Node) -> int:
    """The sliding window of a neutral attention node (0: none)."""
    return int(node.attributes["window"].value) if "window" in node.attributes else 0


def repeat_kv(op, k, v, q_heads: int, kv_heads: int, head_dim: int):  # noqa: ANN001, ANN201
    """Keys and values ``[B, kv, S, D]`` with each KV head repeated for its ``q_heads // kv_heads`` query heads
    (GQA): ``[B, Hq, S, D]``; as they are without GQA."""
    groups = q_heads // kv_heads
    if groups > 1:
        rep = op.Constant(value_ints=[1, 1, groups, 1, 1])
        shape = op.Constant(value_ints=[0, q_heads, -1, head_dim])
        axis = op.Constant(value_ints=[2])
        k = op.Reshape(op.Expand(op.Unsqueeze(k, axis), rep), shape)
        v = op.Reshape(op.Expand(op.Unsqueeze(v, axis), rep), shape)
    return k, v


def causal_attention(op, q, k, v, scale: float, q_heads: int, kv_heads: int, head_dim: int, mask=None,  # noqa: ANN001, ANN201
                     window: int = 0):
    """softmax(q·kᵀ·scale masked) · v with KV heads repeated for GQA. ``mask`` (bool, True = hide) defaults
    to causal over the sequence axis (``q`` and ``k`` of one length), and with ``window`` > 0 also hides keys
    ``window`` or more positions behind the query."""
    k, v = repeat_kv(op, k, v, q_heads, kv_heads, head_dim)
    # q is scaled BEFORE q·kᵀ: in a float16 graph MatMul(q, kᵀ) of large activations overflows before a Mul after
    # it could bring the scores back (reference/ascend.md §5.3, "fp16 scores"); the same numbers in float32
    scores = op.MatMul(op.Mul(q, op.Constant(value_float=scale)), op.Transpose(k, perm=[0, 1, 3, 2]))
    if mask is None:
        seq = op.Gather(op.Shape(q), op.Constant(value_int=2), axis=0)
        r = op.Range(op.Constant(value_int=0), seq, op.Constant(value_int=1))
        cols, rows = op.Unsqueeze(r, op.Constant(value_ints=[0])), op.Unsqueeze(r, op.Constant(value_ints=[1]))
        mask = op.Greater(cols, rows)
        if window:
            mask = op.Or(mask, op.GreaterOrEqual(op.Sub(rows, cols), op.Constant(value_int=window)))
    probs = op.Softmax(op.Where(mask, op.Constant(value_float=_NEG_BIG), scores), axis=-1)
    return op.MatMul(probs, v)


def token_major(op, x):  # noqa: ANN001, ANN201 - [1, H, T, D] -> [T, H, D]
    return op.Transpose(op.Squeeze(x, op.Constant(value_ints=[0])), perm=[1, 0, 2])


def _gather_blocks(op, pool, block_tables, *, block_size: int, kv_heads: int, head_dim: int):  # noqa: ANN001, ANN202
    """Each sequence's blocks of ``pool [S, kv, D]`` in table order: the context ``[B, M * bs, kv * D]``."""
    rows = op.Reshape(pool, op.Constant(value_ints=[-1, block_size * kv_heads * head_dim]))
    return op.Reshape(op.Gather(rows, block_tables, axis=0), op.Constant(value_ints=[0, -1, kv_heads * head_dim]))


def _attend_rows(op, q, k_ctx, v_ctx, query_index, position_ids, *, scale: float, q_heads: int,  # noqa: ANN001, ANN202
                 kv_heads: int, head_dim: int, attend: Callable | None, window: int = 0):
    """Queries gathered into ``[B, Q, Hq * D]``, a key hidden from a query when its position in the context
    exceeds the query's or lies ``window`` or more behind it (``hide [B, 1, Q, C]``), attention (``attend`` or
    plain ops): the padded output rows ``[B * Q, Hq, D]``."""
    zero = op.Constant(value_ints=[0])
    q_pad = op.Gather(op.Reshape(token_major(op, q), op.Constant(value_ints=[0, -1])), query_index, axis=0)
    q_pos = op.Gather(op.Squeeze(position_ids, zero), query_index, axis=0)
    ctx_len = op.Gather(op.Shape(k_ctx), op.Constant(value_int=1), axis=0)
    key_pos = op.Unsqueeze(op.Range(op.Constant(value_int=0), ctx_len, op.Constant(value_int=1)),
                           op.Constant(value_ints=[0, 1, 2]))
    q_pos4 = op.Unsqueeze(q_pos, op.Constant(value_ints=[1, 3]))
    hide = op.Greater(key_pos, q_pos4)  # [B, 1, Q, C]
    if window:  # and keys that fell out of the sliding window: j <= p - window
        hide = op.Or(hide, op.LessOrEqual(key_pos, op.Sub(q_pos4, op.Constant(value_int=window))))
    return attend_padded(op, q_pad, k_ctx, v_ctx, hide, scale=scale, q_heads=q_heads, kv_heads=kv_heads,
                         head_dim=head_dim, attend=attend)


def attend_padded(op, q_pad, k, v, hide, *, scale: float, q_heads: int, kv_heads: int, head_dim: int,  # noqa: ANN001, ANN201
                  attend: Callable | None = None):
    """Padded queries ``[B, Q, Hq·D]`` over keys and values ``[B, S, kv·D]`` with ``hide`` ``[B, 1, Q, S]`` (True:
    masked): ``attend`` when given (a kernel's form), else plain ops (:func:`causal_attention`). Returns the rows
    ``[B·Q, Hq, D]`` in (sequence, query row) order."""
    if attend is None:
        def heads(x, n):  # noqa: ANN001, ANN202 - [B, S, n*D] -> [B, n, S, D]
            return op.Transpose(op.Reshape(x, op.Constant(value_ints=[0, 0, n, head_dim])), perm=[0, 2, 1, 3])

        o4 = causal_attention(op, heads(q_pad, q_heads), heads(k, kv_heads), heads(v, kv_heads), scale, q_heads,
                              kv_heads, head_dim, mask=hide)
        o_pad = op.Transpose(o4, perm=[0, 2, 1, 3])
    else:
        o_pad = attend(op, q_pad, k, v, hide)
    return op.Reshape(o_pad, op.Constant(value_ints=[-1, q_heads, head_dim]))


def _rows_to_tokens(op, rows, token_index):  # noqa: ANN001, ANN202 - [R, Hq, D] rows -> [1, Hq, T, D]
    return op.Unsqueeze(op.Transpose(op.Gather(rows, token_index, axis=0), perm=[1, 0, 2]), op.Constant(value_ints=[0]))


def _attend_over_context(op, q, k_ctx, v_ctx, query_index, token_index, position_ids, *, scale: float,  # noqa: ANN001, ANN202
                         q_heads: int, kv_heads: int, head_dim: int, attend: Callable | None, window: int = 0):
    """:func:`_attend_rows`, then the rows back to token order ``[1, Hq, T, D]``."""
    rows = _attend_rows(op, q, k_ctx, v_ctx, query_index, position_ids, scale=scale, q_heads=q_heads,
                        kv_heads=kv_heads, head_dim=head_dim, attend=attend, window=window)
    return _rows_to_tokens(op, rows, token_index)


def paged_attention(op, q, k, v, key_cache, value_cache, slot_mapping, block_tables, query_index, token_index,  # noqa: ANN001, ANN201
                    position_ids: ir.Value, *, scale: float, q_heads: int, kv_heads: int, block_size: int,
                    attend: Callable | None = None, contiguous: bool = False,
                    decode_group: tuple[ir.Value, ir.Value] | None = None, window: int = 0):
    """The step ABI's paged attention in plain ops (see :mod:`omforge.passes.paged_kv`).

    ScatterND writes the new K/V rows at their slots (its output is the updated pool; bound to the input's
    buffer the write is in place); each sequence's blocks are gathered into a contiguous context
    ``[B, M * block_size, kv * D]`` (sequence-major, so no transpose of the context is needed); queries are
    gathered into ``[B, Q, Hq * D]``; a key is hidden from a query when its position in the context exceeds the
    query's position (``hide [B, 1, Q, C]``). ``attend(op, q, k, v, hide)`` computes attention on those 3-D
    (BSH) tensors; by default the plain ops of :func:`causal_attention`.

    ``contiguous=True`` is the contiguous-cache baseline the benchmarks compare against: sequence ``b`` owns
    slots ``[b*C, (b+1)*C)`` of a pool of exactly ``B*C`` slots, so the context is a reshape, not a gather.

    ``decode_group = (decode_block_tables [Bd, Md], decode_query_index [Bd, 1])``: a second group of sequences
    with one query each, attended separately (its own gathered context, no padding to the first group's longest
    query), so decodes can share a step with prefill chunks at the cost of their own work only. ``token_index``
    then indexes the concatenated rows ``[B * Q + Bd]`` (first group, then the decode group).
    """
    head_dim = q.shape[-1] if q.shape is not None else None
    slots = op.Unsqueeze(slot_mapping, op.Constant(value_ints=[1]))
    k_out = op.ScatterND(key_cache, slots, token_major(op, k))
    v_out = op.ScatterND(value_cache, slots, token_major(op, v))

    def context(pool):  # noqa: ANN001, ANN202 - [S, kv, D] -> [B, M*bs, kv*D]
        if contiguous:
            batch = op.Gather(op.Shape(block_tables), op.Constant(value_ints=[0]), axis=0)
            return op.Reshape(pool, op.Concat(batch, op.Constant(value_ints=[-1, kv_heads * head_dim]), axis=0))
        return _gather_blocks(op, pool, block_tables, block_size=block_size, kv_heads=kv_heads, head_dim=head_dim)

    common = dict(scale=scale, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, attend=attend, window=window)
    rows = _attend_rows(op, q, context(k_out), context(v_out), query_index, position_ids, **common)
    if decode_group is not None:
        tables, qidx = decode_group
        gather = dict(block_size=block_size, kv_heads=kv_heads, head_dim=head_dim)
        rows_d = _attend_rows(op, q, _gather_blocks(op, k_out, tables, **gather),
                              _gather_blocks(op, v_out, tables, **gather), qidx, position_ids, **common)
        rows = op.Concat(rows, rows_d, axis=0)
    return _rows_to_tokens(op, rows, token_index), k_out, v_out


def paged_attention_new_rows(op, q, k, v, key_cache, value_cache, block_tables, query_index, token_index,  # noqa: ANN001, ANN201
                             position_ids: ir.Value, *, scale: float, q_heads: int, kv_heads: int, block_size: int,
                             attend: Callable | None = None, window: int = 0, gather: Callable | None = None,
                             concat: bool = False):
    """The step ABI's paged attention without writing the pools: returns ``(o, key_new, value_new)``.

    Each sequence's blocks are gathered from the pool as it was before this step into ``[B, M * bs, kv * D]``
    (:func:`paged_attention`'s layout; ``gather(op, pool, block_tables)`` replaces the gather for another pool
    layout); the step's own K/V rows are scattered into that gathered
    context at (sequence, position) — token t belongs to sequence ``token_index[t] // Q`` — so attention sees
    them although the pool does not hold them yet. Queries, the mask by position and the attention are
    :func:`paged_attention`'s (``attend`` as there).

    ``concat=True`` (the ascend target: ONNX ScatterND has no AI Core kernel there, and an int64 Div is avoided):
    :func:`_attend_new_rows_concat` instead — no scatter, no division.
    """
    if concat:
        if window:
            raise ValueError("the concat form of paged attention has no sliding window")
        return _attend_new_rows_concat(op, q, k, v, key_cache, value_cache, block_tables, query_index, token_index,
                                       position_ids, scale=scale, q_heads=q_heads, kv_heads=kv_heads,
                                       block_size=block_size, attend=attend, gather=gather)
    head_dim = q.shape[-1]
    one = op.Constant(value_ints=[1])
    k_new, v_new = token_major(op, k), token_major(op, v)
    pos = op.Squeeze(position_ids, op.Constant(value_ints=[0]))
    seq = op.Div(token_index, op.Gather(op.Shape(query_index), op.Constant(value_int=1), axis=0))
    at = op.Concat(op.Unsqueeze(seq, one), op.Unsqueeze(pos, one), axis=1)  # [T, 2]: (sequence, position)

    def context(pool, new):  # noqa: ANN001, ANN202 - [S, kv, D] pool + [T, kv, D] rows -> [B, M*bs, kv*D]
        gathered = gather(op, pool, block_tables) if gather is not None else _gather_blocks(
            op, pool, block_tables, block_size=block_size, kv_heads=kv_heads, head_dim=head_dim)
        return op.ScatterND(gathered, at, op.Reshape(new, op.Constant(value_ints=[0, -1])))

    out = _attend_over_context(op, q, context(key_cache, k_new), context(value_cache, v_new), query_index,
                               token_index, position_ids, scale=scale, q_heads=q_heads, kv_heads=kv_heads,
                               head_dim=head_dim, attend=attend, window=window)
    return out, k_new, v_new


def _attend_new_rows_concat(op, q, k, v, key_cache, value_cache, block_tables, query_index, token_index,  # noqa: ANN001, ANN202
                            position_ids: ir.Value, *, scale: float, q_heads: int, kv_heads: int, block_size: int,
                            attend: Callable | None, gather: Callable | None):
    """:func:`paged_attention_new_rows` with Gather / Concat / Where only: the keys are the context gathered from
    the pool as it was ``[B, C, kv·D]`` followed by the step's own rows of each sequence in query order
    ``[B, Q, kv·D]`` (gathered by ``query_index``). A context key j is hidden when ``j >= `` the sequence's first
    position this step (its slot is written by this step, so the pool holds a stale row there); a new key i' is
    hidden when its position is after the query's, or when it is a padding row of ``query_index`` (a row that
    repeats the row before it: build_step pads with the sequence's last token)."""
    head_dim = q.shape[-1]
    zero, one = op.Constant(value_ints=[0]), op.Constant(value_ints=[1])
    pos = op.Squeeze(position_ids, zero)
    q_pos = op.Gather(pos, query_index, axis=0)  # [B, Q]

    def keys(pool, new):  # noqa: ANN001, ANN202
        ctx = gather(op, pool, block_tables) if gather is not None else _gather_blocks(
            op, pool, block_tables, block_size=block_size, kv_heads=kv_heads, head_dim=head_dim)
        rows = op.Gather(op.Reshape(new, op.Constant(value_ints=[0, -1])), query_index, axis=0)  # [B, Q, kv*D]
        return op.Concat(ctx, rows, axis=1), ctx

    k_new, v_new = token_major(op, k), token_major(op, v)
    k_all, k_ctx = keys(key_cache, k_new)
    v_all, _ = keys(value_cache, v_new)
    ctx_len = op.Gather(op.Shape(k_ctx), op.Constant(value_int=1), axis=0)
    ctx_pos = op.Unsqueeze(op.Range(op.Constant(value_int=0), ctx_len, op.Constant(value_int=1)),
                           op.Constant(value_ints=[0, 1, 2]))  # [1, 1, 1, C]
    first = op.Unsqueeze(op.Gather(q_pos, op.Constant(value_int=0), axis=1), op.Constant(value_ints=[1, 2, 3]))
    hide_ctx = op.GreaterOrEqual(ctx_pos, first)  # [B, 1, 1, C]
    q_len = op.Squeeze(op.Gather(op.Shape(query_index), one, axis=0), zero)
    before = op.Concat(op.Slice(query_index, zero, one, one), op.Slice(query_index, zero, op.Constant(value_ints=[-1]),
                                                                        one, one), axis=1)  # row i - 1 (row 0: itself)
    not_first = op.Greater(op.Range(op.Constant(value_int=0), q_len, op.Constant(value_int=1)),
                           op.Constant(value_int=0))  # [Q]
    is_pad = op.And(op.Equal(query_index, before), not_first)  # [B, Q]: a repeat of the row before it
    key_q_pos = op.Unsqueeze(q_pos, op.Constant(value_ints=[1, 2]))  # [B, 1, 1, Q]
    query_pos = op.Unsqueeze(q_pos, op.Constant(value_ints=[1, 3]))  # [B, 1, Q, 1]
    hide_new = op.Or(op.Greater(key_q_pos, query_pos), op.Unsqueeze(is_pad, op.Constant(value_ints=[1, 2])))
    hide = op.Concat(op.Expand(hide_ctx, op.Concat(op.Shape(hide_new, end=3), op.Unsqueeze(ctx_len, zero), axis=0)),
                     hide_new, axis=3)  # [B, 1, Q, C + Q]
    q_pad = op.Gather(op.Reshape(token_major(op, q), op.Constant(value_ints=[0, -1])), query_index, axis=0)
    rows = attend_padded(op, q_pad, k_all, v_all, hide, scale=scale, q_heads=q_heads, kv_heads=kv_heads,
                         head_dim=head_dim, attend=attend)
    return _rows_to_tokens(op, rows, token_index), k_new, v_new


class DecomposeRMSNorm(pattern.RewriteRuleClassBase):
    def pattern(self, op, x, weight):  # noqa: ANN001, ANN201
        return op.RMSNorm(x, weight, _domain=ops.DOMAIN, _allow_other_attributes=True, _outputs=["y"])

    def rewrite(self, op, x, weight, y, **_):  # noqa: ANN001, ANN201
        return rms_norm(op, x, weight, y.producer().attributes["epsilon"].value)


class DecomposeAddRMSNorm(pattern.RewriteRuleClassBase):
    def pattern(self, op, a, b, weight):  # noqa: ANN001, ANN201
        return op.AddRMSNorm(a, b, weight, _domain=ops.DOMAIN, _allow_other_attributes=True, _outputs=["y", "s"])

    def rewrite(self, op, a, b, weight, y, **_):  # noqa: ANN001, ANN201
        total = op.Add(a, b)
        return rms_norm(op, total, weight, y.producer().attributes["epsilon"].value), total


class DecomposeRotary(pattern.RewriteRuleClassBase):
    def pattern(self, op, x, cos, sin):  # noqa: ANN001, ANN201
        return op.Rotary(x, cos, sin, _domain=ops.DOMAIN)

    def check(self, context, x, **_) -> pattern.MatchResult:  # noqa: ANN001
        result = pattern.MatchResult()
        if x.shape is None or not isinstance(x.shape[-1], int):
            return result.fail("head dimension is not static", x)
        return result

    def rewrite(self, op, x, cos, sin, **_):  # noqa: ANN001, ANN201
        half = x.shape[-1] // 2
        axis, step = op.Constant(value_ints=[-1]), op.Constant(value_ints=[1])
        second = op.Slice(x, op.Constant(value_ints=[half]), op.Constant(value_ints=[2**63 - 1]), axis, step)
        first = op.Slice(x, op.Constant(value_ints=[0]), op.Constant(value_ints=[half]), axis, step)
        rotated = op.Concat(op.Neg(second), first, axis=-1)
        return op.Add(op.Mul(x, cos), op.Mul(rotated, sin))


class DecomposeSwiGLU(pattern.RewriteRuleClassBase):
    def pattern(self, op, gate_up):  # noqa: ANN001, ANN201
        return op.SwiGLU(gate_up, _domain=ops.DOMAIN)

    def rewrite(self, op, gate_up, **_):  # noqa: ANN001, ANN201
        gate, up = op.Split(gate_up, axis=-1, num_outputs=2, _outputs=2)
        return op.Mul(op.Mul(gate, op.Sigmoid(gate)), up)


class DecomposeAttention(pattern.RewriteRuleClassBase):
    def pattern(self, op, q, k, v):  # noqa: ANN001, ANN201
        return op.Attention(q, k, v, _domain=ops.DOMAIN, _allow_other_attributes=True, _outputs=["o"])

    def check(self, context, q, **_) -> pattern.MatchResult:  # noqa: ANN001
        result = pattern.MatchResult()
        if q.shape is None or not isinstance(q.shape[-1], int):
            return result.fail("head dimension is not static", q)
        return result

    def rewrite(self, op, q, k, v, o, **_):  # noqa: ANN001, ANN201
        a = o.producer().attributes
        return causal_attention(op, q, k, v, a["scale"].value, a["q_heads"].value, a["kv_heads"].value, q.shape[-1],
                                window=window_of(o.producer()))


class DecomposePagedAttention(pattern.RewriteRuleClassBase):
    def pattern(self, op, q, k, v, kc, vc, slots, tables, qidx, tidx, pos):  # noqa: ANN001, ANN201
        return op.PagedAttention(q, k, v, kc, vc, slots, tables, qidx, tidx, pos, _domain=ops.DOMAIN,
                                 _allow_other_attributes=True, _outputs=["o", "k_out", "v_out"])

    def attend(self, node: ir.Node):  # noqa: ANN201 - None: the plain-op attention
        return None

    def check(self, context, o, **_) -> pattern.MatchResult:  # noqa: ANN001
        result = pattern.MatchResult()
        if o.shape is None or not isinstance(o.shape[-1], int):
            return result.fail("head dimension is not static", o)
        return result

    def rewrite(self, op, q, k, v, kc, vc, slots, tables, qidx, tidx, pos, o, **_):  # noqa: ANN001, ANN201
        node = o.producer()
        a = {name: node.attributes[name].value for name in ("scale", "q_heads", "kv_heads", "block_size")}
        return paged_attention(op, q, k, v, kc, vc, slots, tables, qidx, tidx, pos, **a, attend=self.attend(node),
                               window=window_of(node))


def moe(op, x, router_logits, gate_up, down, *, top_k: int, normalize: bool, experts: int, hidden: int):  # noqa: ANN001, ANN201
    """``omforge.MoE`` in plain ops, densely: every expert on every token as two batched MatMuls over the stacked
    weights (``[1, T, H] @ [E, H, 2F]``, ``[E, T, F] @ [E, F, H]``), combined by the routing matrix ``[T, E]``
    (Softmax, TopK, optional renormalization, ScatterElements into zeros: a weight for the chosen experts, 0 for the
    rest), as the export's reference graph does. E times the chosen experts' work; correct for any routing."""
    flat = op.Reshape(x, op.Constant(value_ints=[-1, hidden]))  # [T, H]
    probs = op.Softmax(op.Reshape(router_logits, op.Constant(value_ints=[-1, experts])), axis=-1)  # [T, E]
    weights, chosen = op.TopK(probs, op.Constant(value_ints=[top_k]), axis=-1, largest=1, sorted=1, _outputs=2)
    if normalize:
        weights = op.Div(weights, op.ReduceSum(weights, op.Constant(value_ints=[-1]), keepdims=1))
    zeros = op.Expand(op.CastLike(op.Constant(value_float=0.0), probs), op.Shape(probs))
    routing = op.ScatterElements(zeros, chosen, weights, axis=-1)  # [T, E]
    gate, up = op.Split(op.MatMul(op.Unsqueeze(flat, op.Constant(value_ints=[0])), gate_up), axis=-1, num_outputs=2,
                        _outputs=2)  # [E, T, F] each
    out = op.MatMul(op.Mul(op.Mul(gate, op.Sigmoid(gate)), up), down)  # [E, T, H]
    scale = op.Unsqueeze(op.Transpose(routing, perm=[1, 0]), op.Constant(value_ints=[2]))  # [E, T, 1]
    y = op.ReduceSum(op.Mul(scale, out), op.Constant(value_ints=[0]), keepdims=0)  # [T, H]
    return op.Reshape(y, op.Shape(x))


class DecomposeMoE(pattern.RewriteRuleClassBase):
    def pattern(self, op, x, router_logits, gate_up, down):  # noqa: ANN001, ANN201
        return op.MoE(x, router_logits, gate_up, down, _domain=ops.DOMAIN, _allow_other_attributes=True,
                      _outputs=["y"])

    def check(self, context, gate_up, down, **_) -> pattern.MatchResult:  # noqa: ANN001
        result = pattern.MatchResult()
        gu, d = gate_up.shape, down.shape
        if gu is None or d is None or gu.rank() != 3 or d.rank() != 3 or not all(isinstance(n, int) for n in gu):
            return result.fail("the stacked expert weights' shapes are not static [E, H, 2F] / [E, F, H]", gate_up)
        return result

    def rewrite(self, op, x, router_logits, gate_up, down, y, **_):  # noqa: ANN001, ANN201
        a = y.producer().attributes
        experts, hidden, _ = gate_up.shape
        return moe(op, x, router_logits, gate_up, down, top_k=a["top_k"].value, normalize=bool(a["normalize"].value),
                   experts=experts, hidden=hidden)


RULES: dict[str, pattern.RewriteRule] = {
    "PagedAttention": DecomposePagedAttention.rule("decompose_paged_attention"),
    "RMSNorm": DecomposeRMSNorm.rule("decompose_rms_norm"),
    "AddRMSNorm": DecomposeAddRMSNorm.rule("decompose_add_rms_norm"),
    "Rotary": DecomposeRotary.rule("decompose_rotary"),
    "SwiGLU": DecomposeSwiGLU.rule("decompose_swiglu"),
    "Attention": DecomposeAttention.rule("decompose_attention"),
    "MoE": DecomposeMoE.rule("decompose_moe"),
}
"""Neutral op type → its decomposition rule."""

