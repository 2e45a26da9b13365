"""Pooling insertion: the full-sequence graph becomes a pooling bundle's step graph (contract/pooling.py's ABI).

No KV pool and no paging: ``B`` whole sequences, right-padded to ``Q`` tokens, run as the export's batch (its
causal attention keeps padding out of every real position). The final-norm hidden state ``[B, Q, H]`` is flattened
and the row ``pool_index[b]`` (``b * Q + len_b - 1``, the runtime's) of each sequence gathered:

  embed — that row is the output ``pooled [B, H]``; the LM head is dropped.
  score — that row times the LM head's columns of the ``[no, yes]`` tokens only (a ``[H, 2]`` constant cut from
          the head's weight): ``logits [B, 2]``; the ``[H, vocab]`` GEMM is never run.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from omforge.contract.pooling import POOLED_OUTPUT


def insert_pooling(model: ir.Model, task: str, score_token_ids: tuple[int, int] | None = None) -> int:
    """Rewrite ``model`` (an export, fused or not: its ``logits`` come from a MatMul LM head) in place; returns the
    width of the pooled output (hidden size, or 2)."""
    graph = model.graph
    logits = next(o for o in graph.outputs if o.name == "logits")
    head = logits.producer()
    if head is None or head.op_type != "MatMul":
        raise ValueError("the logits are not produced by a MatMul (LM head); cannot pool")
    hidden, weight = head.inputs
    width = int(weight.shape[0])
    inputs = {v.name: v for v in graph.inputs}
    for name in ("input_ids", "position_ids"):
        inputs[name].shape = ir.Shape(["num_seqs", "max_query_len"])
    index = ir.Value(name="pool_index", shape=ir.Shape(["num_seqs"]), type=ir.TensorType(ir.DataType.INT64))
    graph.inputs.append(index)
    flat_shape = ir.node("Constant", [], attributes={"value": ir.tensor(np.array([-1, width], np.int64))},
                         name="pool_flat_shape")
    flat = ir.node("Reshape", [hidden, flat_shape.outputs[0]], name="pool_flatten")
    rows = ir.node("Gather", [flat.outputs[0], index], attributes={"axis": 0}, name="pool_last_rows")
    new = [flat_shape, flat, rows]
    if task == "embed":
        out = rows.outputs[0]
    elif task == "score":
        if score_token_ids is None:
            raise ValueError("task score needs the [no, yes] token ids")
        cut = ir.Value(name="score_head.weight", shape=ir.Shape([width, 2]), type=ir.TensorType(ir.DataType.FLOAT),
                       const_value=ir.tensor(_head_columns(weight, score_token_ids), name="score_head.weight"))
        graph.register_initializer(cut)
        score = ir.node("MatMul", [rows.outputs[0], cut], name="score_head")
        new.append(score)
        out = score.outputs[0]
    else:
        raise ValueError(f"task {task!r} is not a pooling task")
    graph.insert_before(head, new)
    out.name, out.dtype = POOLED_OUTPUT[task], ir.DataType.FLOAT
    out.shape = ir.Shape(["num_seqs", width if task == "embed" else 2])
    graph.outputs[graph.outputs.index(logits)] = out
    graph.remove(head, safe=True)
    return width if task == "embed" else 2


def _head_columns(weight: ir.Value, token_ids: tuple[int, int]) -> np.ndarray:
    """The LM head's ``[H, vocab]`` weight columns ``token_ids``: from an initializer, or from the transpose of
    one (the export's ``lm_head.weight.T``, tied or not)."""
    if weight.const_value is not None:
        return np.ascontiguousarray(weight.const_value.numpy()[:, list(token_ids)], dtype=np.float32)
    node = weight.producer()
    if node is not None and node.op_type == "Transpose" and node.inputs[0].const_value is not None:
        return np.ascontiguousarray(node.inputs[0].const_value.numpy()[list(token_ids), :].T, dtype=np.float32)
    raise ValueError("the LM head's weight is neither an initializer nor the transpose of one")
