"""The ``readonly`` paged attention (``compile.paged_attention: readonly``, 910B / 910_93, float16/bfloat16 graphs):
FIA over the pool AS IT WAS before the step, the step's own rows attended in plain ops, the two merged by their
log-sum-exp; no ref op, no RefData (plain ``atc --framework=5``), the new rows leave the graph as ``kv_new`` and the
executor copies them into the pools.

Per layer (``PagedAttentionInPlace``'s interface less the write; module docstring of :mod:`.lower`):

  OmFusedInferAttentionScoreLse(query [B, Q, Hq·D] BSH, key_cache [nb, bs, kv·D], value_cache, actual_seq_lengths
    [B] int64, actual_seq_lengths_kv [B] int64, block_table [B, M] int32 — each at its GE IR index;
    num_heads, num_key_value_heads, scale, input_layout="BSH", sparse_mode=0 (no mask: every query sees the whole
    prior context), block_size, inner_precise=0, softmax_lse_flag=1) -> (attention_out [B, Q, Hq·D],
    softmax_lse [B, Hq, Q, 1] float32)                                     own plugin → GE FusedInferAttentionScore
    (hicann/ops-transformer c29bc10 ``attention/fused_infer_attention_score/op_host/fused_infer_attention_score_def.cpp
    :544`` softmax_lse output DT_FLOAT ND, ``:555`` attr softmax_lse_flag Bool; ``docs/aclnnFusedInferAttentionScoreV4
    .md:714`` shape [B, N, Q_S, 1]; ``:708`` inf marks invalid rows; the only LSE refusals are the MLA rows ``:1407,
    :1565`` and ``op_host/fused_infer_attention_score_tiling_check_feature.cpp:264``: none for paged KV or GQA)

``actual_seq_lengths_kv`` is ``max(context BEFORE the step, 1)`` (the executor feeds it: acl_plan.pack_run): a
sequence without a context (a first prefill chunk, a padding sequence) reads one stale key — FIA is never asked for
an empty context (what it returns for a zero length is not documented: ``:824`` covers only an empty key tensor
[unverified]) — and its (o1, lse1) is dropped by the merge where the sequence's first query is at position 0.
The step's own rows: each query over its sequence's new rows at or before it (query-index order = position order
within a sequence, :func:`acl_plan.pack_run`), in float32 with q scaled first. Merge, stably in float32:
``m = max(l1, l2)``, ``o = (e^{l1-m}·o1 + e^{l2-m}·o2) / (e^{l1-m} + e^{l2-m})``; ``l2`` is always finite (a query
sees its own row).

``kv_new`` is LAYER-major, ``[num_layers, 2, num_tokens, kv_heads, head_dim]`` (not the gather mode's token-major
form): the rows one pool receives are then contiguous, so the executor stores a run of consecutive slots with one
device copy per pool (2L per run; ``memcpy_async`` has no strided form in the call table).

``plain=True``: the twin the FAKE pyACL runs — FIA replaced by the same attention in plain ops over the gathered
blocks (keys ``j < max(kv, 1)`` visible), with its log-sum-exp.
"""

from __future__ import annotations

import re

import onnx_ir as ir

from omforge.contract.ascend import KV_NEW
from omforge.passes import decompose
from omforge.passes.float16 import ISLAND_IN, ISLAND_OUT

NEG = -1e30
"""The merge's log-weight for a missing prior context (float32, no inf − inf)."""
FIA_LSE_INPUTS_AT = (0, 1, 2, 5, 6, 14)
"""The IR indices of the readonly FIA node's inputs (query, key, value, the two lengths, block_table; no mask)."""


def _heads(op, x, n: int, head_dim: int):  # noqa: ANN001, ANN202 - [B, S, n*D] -> [B, n, S, D]
    return op.Transpose(op.Reshape(x, op.Constant(value_ints=[0, 0, n, head_dim])), perm=[0, 2, 1, 3])


def attend_lse(op, q4, k4, v4, hide, *, scale: float, q_heads: int, kv_heads: int, head_dim: int,  # noqa: ANN001, ANN201
               name: str):
    """softmax(q·kᵀ·scale, hidden keys out) · v and its log-sum-exp, in float32: ``q4 [B, Hq, Q, D]``, ``k4 / v4
    [B, kv, C, D]``, ``hide`` bool broadcast to ``[B, 1, Q, C]`` (True = hidden; every row keeps one key). Returns
    ``(o [B, Hq, Q, D], lse [B, Hq, Q, 1])`` float32: its entry Casts are named ``ISLAND_IN + name``… so the
    float16 pass keeps it float32 (passes/float16.py, marked islands)."""
    f32 = ir.DataType.FLOAT
    q4, k4, v4 = (op.Cast(x, to=f32, _outputs=[f"{ISLAND_IN}{name}.{t}"]) for x, t in ((q4, "q"), (k4, "k"), (v4, "v")))
    k4, v4 = decompose.repeat_kv(op, k4, v4, q_heads, kv_heads, head_dim)
    scores = op.MatMul(op.Mul(q4, op.Constant(value_float=scale)), op.Transpose(k4, perm=[0, 1, 3, 2]))
    scores = op.Where(hide, op.Constant(value_float=NEG), scores)
    last = op.Constant(value_ints=[-1])
    m = op.ReduceMax(scores, last, keepdims=1)
    e = op.Exp(op.Add(scores, op.Neg(m)))  # Add/Neg, Mul/Reciprocal: ops with a row of the CANN matrix
    total = op.ReduceSum(e, last, keepdims=1)
    return op.MatMul(op.Mul(e, op.Reciprocal(total)), v4), op.Add(m, op.Log(total))


def merge_lse(op, o1, l1, o2, l2, has_prior):  # noqa: ANN001, ANN201
    """The two partial attentions merged by their log-sum-exp (float32), part 1 dropped where ``has_prior`` (bool,
    broadcast to ``l1``) is False: its values are then never read, NaN or inf included."""
    zero = op.Constant(value_float=0.0)
    l1 = op.Where(has_prior, l1, op.Constant(value_float=NEG))
    o1 = op.Where(has_prior, o1, zero)
    m = op.Neg(op.ReduceMax(op.Concat(l1, l2, axis=-1), op.Constant(value_ints=[-1]), keepdims=1))
    w1, w2 = op.Exp(op.Add(l1, m)), op.Exp(op.Add(l2, m))
    return op.Mul(op.Add(op.Mul(w1, o1), op.Mul(w2, o2)), op.Reciprocal(op.Add(w1, w2)))


class PagedAttentionReadOnly(decompose.DecomposePagedAttention):
    """PagedAttention (readonly mode) → FIA with its LSE over the pools as they were, the step's rows in plain ops,
    the LSE merge (module docstring); ``plain``: the twin. Returns (o, new K rows [T, kv, D], new V rows): the
    row outputs become ``kv_new`` (:func:`stack_layer_major`)."""

    def __init__(self, plain: bool, seq_q: ir.Value, seq_kv: ir.Value):
        super().__init__(f"ascend_paged_attention_readonly{'_plain' if plain else ''}")
        self.plain, self.seq_q, self.seq_kv = plain, seq_q, seq_kv

    def rewrite(self, op, q, k, v, kc, vc, slots, tables, qidx, tidx, pos, o, **_):  # noqa: ANN001, ANN201
        a = {name: o.producer().attributes[name].value for name in ("scale", "q_heads", "kv_heads", "block_size")}
        hq, kv, bs, head_dim, scale = a["q_heads"], a["kv_heads"], a["block_size"], q.shape[-1], a["scale"]
        layer = int(kc.name.rsplit(".", 1)[1])
        dtype = q.dtype if q.dtype is not None else ir.DataType.FLOAT16
        blocks = kc.shape[0] if isinstance(kc.shape[0], int) else -1
        k_tok, v_tok = decompose.token_major(op, k), decompose.token_major(op, v)  # [T, kv, D]
        flat_rows = op.Constant(value_ints=[0, -1])
        q_pad = op.Gather(op.Reshape(decompose.token_major(op, q), flat_rows), qidx, axis=0)  # [B, Q, Hq*D]
        # the executor feeds max(context before the step, 1): FIA never gets an empty context; whether there is
        # one is the position of each sequence's first query (its context before the step)
        first = op.Gather(qidx, op.Constant(value_int=0), axis=1)  # [B]
        has_prior = op.Unsqueeze(op.Greater(op.Gather(op.Reshape(pos, op.Constant(value_ints=[-1])), first, axis=0),
                                            op.Constant(value_ints=[0])), op.Constant(value_ints=[1, 2, 3]))
        if self.plain:
            o1, l1 = self._twin_fia(op, q_pad, kc, vc, tables, self.seq_kv, hq=hq, kv=kv, bs=bs, head_dim=head_dim,
                                    scale=scale, name=f"{layer}.ctx")
        else:
            bnbsh = op.Constant(value_ints=[blocks, bs, kv * head_dim])  # BnBsH for a BSH query (FIA V4 doc :916)
            o_fia, l1 = op.OmFusedInferAttentionScoreLse(
                q_pad, op.Reshape(kc, bnbsh), op.Reshape(vc, bnbsh), self.seq_q, self.seq_kv, tables,
                num_heads=hq, num_key_value_heads=kv, scale=scale, input_layout="BSH", sparse_mode=0,
                block_size=bs, inner_precise=0, softmax_lse_flag=1, _outputs=2)
            o1 = op.Cast(_heads(op, o_fia, hq, head_dim), to=ir.DataType.FLOAT, _outputs=[f"{ISLAND_IN}{layer}.fia"])
            l1 = op.Cast(l1, to=ir.DataType.FLOAT, _outputs=[f"{ISLAND_IN}{layer}.lse"])  # already float32: the
            # Cast only opens the island at the LSE too (FIA's softmax_lse is DT_FLOAT, def.cpp:544)
        # the step's own rows, in the queries' padded layout: [B, Q, kv*D]
        k_new = op.Gather(op.Reshape(k_tok, flat_rows), qidx, axis=0)
        v_new = op.Gather(op.Reshape(v_tok, flat_rows), qidx, axis=0)
        zero, one = op.Constant(value_int=0), op.Constant(value_int=1)
        r = op.Range(zero, op.Gather(op.Shape(qidx), one, axis=0), one)
        hide = op.Greater(op.Unsqueeze(r, op.Constant(value_ints=[0])), op.Unsqueeze(r, op.Constant(value_ints=[1])))
        o2, l2 = attend_lse(op, _heads(op, q_pad, hq, head_dim), _heads(op, k_new, kv, head_dim),
                            _heads(op, v_new, kv, head_dim), hide, scale=scale, q_heads=hq, kv_heads=kv,
                            head_dim=head_dim, name=f"{layer}.own")
        o4 = op.Cast(merge_lse(op, o1, l1, o2, l2, has_prior), to=dtype,
                     _outputs=[f"{ISLAND_OUT}{layer}"])  # [B, Hq, Q, D]: the float32 island ends
        rows = op.Reshape(op.Transpose(o4, perm=[0, 2, 1, 3]), op.Constant(value_ints=[-1, hq, head_dim]))
        out = op.Unsqueeze(op.Transpose(op.Gather(rows, tidx, axis=0), perm=[1, 0, 2]), op.Constant(value_ints=[0]))
        return out, k_tok, v_tok

    def _twin_fia(self, op, q_pad, kc, vc, tables, kv_fed, *, hq: int, kv: int, bs: int, head_dim: int,  # noqa: ANN001, ANN202
                  scale: float, name: str):
        """FIA's sparse mode 0 with the actual lengths in plain ops: key ``j < kv_fed[b]`` of sequence b's blocks
        visible to all its queries; returns (o1, lse1) float32 ``[B, Hq, Q, D]`` / ``[B, Hq, Q, 1]``."""
        flat = op.Constant(value_ints=[-1, kv, head_dim])
        k_ctx = decompose._gather_blocks(op, op.Reshape(kc, flat), tables, block_size=bs, kv_heads=kv,
                                         head_dim=head_dim)
        v_ctx = decompose._gather_blocks(op, op.Reshape(vc, flat), tables, block_size=bs, kv_heads=kv,
                                         head_dim=head_dim)
        zero, one = op.Constant(value_int=0), op.Constant(value_int=1)
        cols = op.Unsqueeze(op.Range(zero, op.Gather(op.Shape(k_ctx), one, axis=0), one),
                            op.Constant(value_ints=[0, 1, 2]))  # [1, 1, 1, C]
        hide = op.GreaterOrEqual(cols, op.Unsqueeze(kv_fed, op.Constant(value_ints=[1, 2, 3])))  # [B, 1, 1, C]
        o1, l1 = attend_lse(op, _heads(op, q_pad, hq, head_dim), _heads(op, k_ctx, kv, head_dim),
                            _heads(op, v_ctx, kv, head_dim), hide, scale=scale, q_heads=hq, kv_heads=kv,
                            head_dim=head_dim, name=name)
        # FIA rounds its attention_out to the graph's dtype; the twin keeps o1 in float32 (within its ulp)
        return o1, l1


def new_row_outputs(graph: ir.Graph, num_layers: int) -> dict[tuple[int, int], ir.Value]:
    """The per-layer new-row outputs the rewrite left under ``key_cache_out.N`` / ``value_cache_out.N``, by
    ``(layer, kind)`` (kind 0: K, 1: V); RuntimeError unless every layer has both."""
    rows: dict[tuple[int, int], ir.Value] = {}
    for value in graph.outputs:
        m = re.fullmatch(r"(key|value)_cache_out\.(\d+)", value.name or "")
        if m is not None:
            rows[int(m[2]), 0 if m[1] == "key" else 1] = value
    if sorted(rows) != [(n, k) for n in range(num_layers) for k in (0, 1)]:
        raise RuntimeError(f"ascend lowering: new K/V rows of {num_layers} layers expected, found {sorted(rows)}")
    return rows


def stack_layer_major(graph: ir.Graph, num_layers: int, pool: ir.Value) -> None:
    """Replace the per-layer new-row outputs (under ``key_cache_out.N`` / ``value_cache_out.N``, ``[T, kv, D]``) by
    one ``kv_new [num_layers, 2, num_tokens, kv, D]`` (layer-major: pool ``(N, kind)``'s rows at ``[N, kind]``), and
    drop the then unused ``slot_mapping`` input. ``pool``: a layer's pool input ``[nb, bs, kv, D]`` (dims, dtype)."""
    rows = new_row_outputs(graph, num_layers)
    *_, kv_heads, head_dim = pool.shape
    axis0 = ir.node("Constant", [], attributes={"value_ints": [0]}, name="kv_new_axis")
    nodes = [axis0]
    for n in range(num_layers):
        for k in (0, 1):
            nodes.append(ir.node("Unsqueeze", [rows[n, k], axis0.outputs[0]], name=f"kv_new_unsqueeze_{n}_{k}"))
    concat = ir.node("Concat", [x.outputs[0] for x in nodes[1:]], attributes={"axis": 0}, name="kv_new_concat")
    shape = ir.node("Constant", [], attributes={"value_ints": [num_layers, 2, -1, kv_heads, head_dim]},
                    name="kv_new_shape")
    reshape = ir.node("Reshape", [concat.outputs[0], shape.outputs[0]], name="kv_new_reshape")
    nodes += [concat, shape, reshape]
    out = reshape.outputs[0]
    out.name, out.type = KV_NEW, pool.type
    out.shape = ir.Shape([num_layers, 2, "num_tokens", kv_heads, head_dim])
    graph.extend(nodes)
    kept = [v for v in graph.outputs if v not in rows.values()]
    graph.outputs.clear()
    graph.outputs.extend([*kept, out])
    for (n, k), value in rows.items():
        value.name = f"{('key', 'value')[k]}_new.{n}"
    for value in list(graph.inputs):
        if value.name == "slot_mapping" and not value.uses():
            graph.inputs.remove(value)
