"""Paged-KV insertion: the full-recompute graph becomes the *step graph* that reads and writes per-layer KV pools.

Every ``omforge.Attention`` becomes ``omforge.PagedAttention``, which writes each new token's K/V at its slot
and attends over the sequence's blocks; the graph gains the step inputs below and computes logits only for
the rows in ``logits_indices``. One execution carries any mix of prefill chunks and decodes of different
sequences: tokens are packed along one axis and mapped to sequences by ``query_index``/``token_index``.

Step ABI (``T`` tokens this step, ``B`` sequences, ``Q`` the longest query of the step, ``M`` blocks per
block-table row, ``L`` logit rows, ``S = num_blocks * block_size`` slots):

  input_ids        [1, T] int64   the new tokens, packed sequence after sequence
  position_ids     [1, T] int64   each token's position in its sequence
  slot_mapping     [T]    int64   pool slot of each token's K/V: block_id * block_size + offset
  block_tables     [B, M] int64   each sequence's blocks in order (pad with any valid block id)
  query_index      [B, Q] int64   token (index into T) of query row i of sequence b (pad with any token of b)
  token_index      [T]    int64   row b * Q + i of token t in the padded [B, Q] layout
  logits_indices   [L]    int64   tokens whose logits are returned (the last of each sequence that samples)
  key_cache.N / value_cache.N   [S, kv_heads, head_dim] float32, the pool of layer N viewed slot by slot
                                (allocated as [num_blocks, block_size, kv_heads, head_dim])
outputs:
  logits           [1, L, vocab] float32
  key_cache_out.N / value_cache_out.N  the updated pools; bind each to its input's buffer so the write is in place

Invariant: a key at position ``j`` is visible to a query at position ``p`` of the same sequence iff
``j <= p``, so context lengths follow from the positions and need no input of their own.
"""

from __future__ import annotations

import re

import onnx_ir as ir

from omforge.contract import DECODE_GROUP_INPUTS, PagedLayout
from omforge.passes import attention, ops


def _input(name: str, dims: list[int | str], dtype: ir.DataType = ir.DataType.INT64) -> ir.Value:
    return ir.Value(name=name, shape=ir.Shape(dims), type=ir.TensorType(dtype))


def insert_paged_kv(model: ir.Model, block_size: int) -> PagedLayout:
    """Rewrite ``model`` (fused, with ``omforge.Attention`` nodes) into the step graph, in place."""
    graph = model.graph
    attn = [n for n in graph if n.domain == ops.DOMAIN and n.op_type == "Attention"]
    fused = bool(attn)  # False when the attention switch is off: the lowering then keeps plain-op attention
    if not attn:  # find attention anyway: it is where the cache goes
        attention.RULES.apply_to_model(model)
        attn = [n for n in graph if n.domain == ops.DOMAIN and n.op_type == "Attention"]
    if not attn:
        raise ValueError("paged-KV insertion found no attention to page (is this an omforge export?)")
    inputs = {v.name: v for v in graph.inputs}
    ids, pos = inputs["input_ids"], inputs["position_ids"]
    ids.shape = ir.Shape([1, "num_tokens"])
    pos.shape = ir.Shape([1, "num_tokens"])
    step = {
        "slot_mapping": _input("slot_mapping", ["num_tokens"]),
        "block_tables": _input("block_tables", ["num_seqs", "max_blocks"]),
        "query_index": _input("query_index", ["num_seqs", "max_query_len"]),
        "token_index": _input("token_index", ["num_tokens"]),
        "logits_indices": _input("logits_indices", ["num_logits"]),
    }
    graph.inputs.extend(step.values())

    kv_heads = int(attn[0].attributes["kv_heads"].value)
    head_dim = int(attn[0].inputs[0].shape[-1])
    for layer, node in enumerate(attn):
        caches = [_input(f"{kind}_cache.{layer}", ["num_slots", kv_heads, head_dim], ir.DataType.FLOAT)
                  for kind in ("key", "value")]
        graph.inputs.extend(caches)
        q, k, v = node.inputs
        paged = ir.node(
            "PagedAttention", [q, k, v, *caches, step["slot_mapping"], step["block_tables"], step["query_index"],
                               step["token_index"], pos],
            attributes={**{a: node.attributes[a].value for a in ("scale", "q_heads", "kv_heads", "window")
                           if a in node.attributes},
                        "block_size": block_size, "fused_attention": int(fused)},
            domain=ops.DOMAIN, num_outputs=3, name=f"paged_attention.{layer}")
        out, k_out, v_out = paged.outputs
        out.shape, out.dtype = node.outputs[0].shape, node.outputs[0].dtype
        for value, cache, kind in ((k_out, caches[0], "key"), (v_out, caches[1], "value")):
            value.name, value.shape, value.dtype = f"{kind}_cache_out.{layer}", cache.shape, cache.dtype
        graph.insert_before(node, paged)
        node.outputs[0].replace_all_uses_with(out)
        graph.remove(node, safe=True)
        graph.outputs.extend([k_out, v_out])

    _logits_only_where_needed(graph, step["logits_indices"])
    return PagedLayout(num_layers=len(attn), kv_heads=kv_heads, head_dim=head_dim, block_size=block_size)


def _logits_only_where_needed(graph: ir.Graph, logits_indices: ir.Value) -> None:
    """Gather the rows in ``logits_indices`` right before the LM head, so its GEMM runs on those rows only."""
    logits = next(o for o in graph.outputs if o.name == "logits")
    head = logits.producer()
    if head is None or head.op_type != "MatMul":
        raise ValueError("the logits are not produced by a MatMul (LM head); cannot select rows")
    hidden = head.inputs[0]
    gather = ir.node("Gather", [hidden, logits_indices], attributes={"axis": 1}, name="gather_logit_rows")
    gather.outputs[0].name = "hidden_for_logits"
    graph.insert_before(head, gather)
    head.replace_input_with(0, gather.outputs[0])
    logits.shape = ir.Shape([1, "num_logits", logits.shape[-1] if logits.shape else None])


def new_rows_as_outputs(graph: ir.Graph) -> tuple[list[str], list[str]]:
    """After an out-of-place lowering (the rewrite left the step's new rows under the pool outputs' names):
    rename ``key_cache_out.N`` / ``value_cache_out.N`` to ``key_new.N`` / ``value_new.N`` ``[num_tokens, kv, D]``
    and drop the then unused ``slot_mapping`` input (the runtime still uses it on the host). Returns the new
    output names and the removed inputs."""
    renamed, removed = [], []
    for value in graph.outputs:
        m = re.fullmatch(r"(key|value)_cache_out\.(\d+)", value.name or "")
        if m is None:
            continue
        value.name = f"{m[1]}_new.{m[2]}"
        value.shape = ir.Shape(["num_tokens", *value.shape[1:]])
        renamed.append(value.name)
    for value in list(graph.inputs):
        if value.name == "slot_mapping" and not value.uses():
            graph.inputs.remove(value)
            removed.append(value.name)
    return renamed, removed


def add_decode_group_inputs(graph: ir.Graph) -> tuple[ir.Value, ir.Value]:
    """Add the graph inputs :data:`DECODE_GROUP_INPUTS` (once) and return them."""
    have = {v.name: v for v in graph.inputs}
    if DECODE_GROUP_INPUTS[0] in have:
        return have[DECODE_GROUP_INPUTS[0]], have[DECODE_GROUP_INPUTS[1]]
    tables = _input(DECODE_GROUP_INPUTS[0], ["num_decodes", "max_decode_blocks"])
    qidx = _input(DECODE_GROUP_INPUTS[1], ["num_decodes", 1])
    graph.inputs.extend([tables, qidx])
    return tables, qidx

