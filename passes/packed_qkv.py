"""The kernel's attention takes its operands as the QKV projection leaves them (after the ORT kernel lowering).

Before: ``Split(qkv) → Reshape [1, T, H, D] → Transpose [1, H, T, D] → RotaryEmbedding`` for q and k (v without the
rotary), the kernel's ``PagedAttention*``, then ``Transpose → Reshape [1, T, Hq·D]`` into the output projection:
ten nodes per layer that only move data. After: one node, ``PagedAttention*(qkv, "", "", pools, step inputs…,
cos_cache, sin_cache)`` whose output is ``[1, T, Hq·D]`` (the kernel's packed form, runtime/ort/kernels/
custom_op.cpp: it rotates q and k itself with RotaryEmbedding's formula and writes rotated keys to the pools).

Where q, k and v do not come from one Split of one tensor (the qkv_merge fusion off), each keeps its own 3-D
``[1, T, H·D]`` input and only the reshapes, transposes and rotary go. A per-head RMSNorm between the head split and
the transpose (Qwen3's q/k norms: ``Transpose(RMSNormalization(Reshape(src) [1, T, H, D]))``) stays where it is and
a Reshape back to ``[1, T, H·D]`` (a view in ORT) feeds the kernel: q, k and v are then inputs of their own, and the
kernel still rotates q and k. Anything else — a value on the chain used elsewhere, another permutation, an
interleaved or partial rotary, q rotated and k not — leaves the layer as it was. Dead nodes (the Reshapes' shape
subgraphs) are left to the cleanup that follows the lowering.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from omforge.contract.kernel_abi import DOMAIN as KERNEL_DOMAIN
from omforge.passes.util import const_array

_HEAD_MAJOR = [0, 2, 1, 3]
_ROTARY_DEFAULTS = {"interleaved": 0, "rotary_embedding_dim": 0, "num_heads": 0}


def _only_use(value: ir.Value, op_type: str) -> ir.Node | None:
    """The node of type ``op_type`` (default domain) that is ``value``'s one use, else None."""
    uses = list(value.uses())
    if len(uses) != 1 or value.is_graph_output():
        return None
    node = uses[0].node
    return node if node.op_type == op_type and node.domain in ("", "ai.onnx") else None


def _producer(value: ir.Value | None, op_type: str) -> ir.Node | None:
    """``value``'s producer if it is an ``op_type`` node (default domain) and ``value`` has one use."""
    node = value.producer() if value is not None else None
    if node is None or node.op_type != op_type or node.domain not in ("", "ai.onnx"):
        return None
    return node if len(value.uses()) == 1 and not value.is_graph_output() else None


def _perm(node: ir.Node) -> list[int] | None:
    attr = node.attributes.get("perm")
    return list(attr.value) if attr is not None else None


def _heads_of(value: ir.Value, heads: int) -> tuple[ir.Value, list[ir.Node], ir.Node | None] | None:
    """``value = Transpose(Reshape(src) [1, T, heads, D], perm=[0, 2, 1, 3])``: (``src`` [1, T, heads·D], the two
    nodes, None) or None (ranks and the head count checked where the shapes are known). With a per-head norm
    between them, ``Transpose(RMSNormalization(Reshape(src)))`` over the last axis: (``src``, the Transpose alone,
    the norm), the norm and the Reshape kept."""
    transpose = _producer(value, "Transpose")
    if transpose is None or _perm(transpose) != _HEAD_MAJOR:
        return None
    norm = _producer(transpose.inputs[0], "RMSNormalization")
    if norm is not None and norm.attributes.get_int("axis", -1) not in (-1, 3):
        return None
    reshape = _producer(norm.inputs[0] if norm is not None else transpose.inputs[0], "Reshape")
    if reshape is None or reshape.inputs[0] is None:
        return None
    src, split = reshape.inputs[0], reshape.outputs[0].shape
    if src.shape is not None and src.shape.rank() != 3:
        return None
    if split is not None and (split.rank() != 4 or isinstance(split[2], int) and split[2] != heads):
        return None
    return (src, [transpose], norm) if norm is not None else (src, [transpose, reshape], None)


def _merged_heads(graph: ir.Graph, norm: ir.Node) -> ir.Node:
    """``Reshape(norm's output [1, T, H, D], [0, 0, -1])``: the normalized heads as the kernel's ``[1, T, H·D]``."""
    y = norm.outputs[0]
    dims = ir.Value(name=f"{norm.name}.merged_heads", const_value=ir.tensor(np.array([0, 0, -1], np.int64)))
    graph.register_initializer(dims)
    node = ir.node("Reshape", [y, dims], name=f"{norm.name}_merged_heads")
    node.outputs[0].dtype = y.dtype
    return node


def _rotary_of(value: ir.Value) -> tuple[ir.Value, ir.Value, ir.Value, ir.Node] | None:
    """``value = RotaryEmbedding(x, cos, sin)`` whole-head, rotate-half, no position ids: (x, cos, sin, node)."""
    node = _producer(value, "RotaryEmbedding")
    if node is None or len(node.inputs) > 3 and node.inputs[3] is not None:
        return None
    if any(node.attributes[name].value != default for name, default in _ROTARY_DEFAULTS.items()
           if name in node.attributes):
        return None
    return node.inputs[0], node.inputs[1], node.inputs[2], node


def _packed_source(sources: list[ir.Value], q_heads: int, kv_heads: int) -> tuple[ir.Value, ir.Node] | None:
    """The one tensor that q, k and v are, in that order, the outputs of a last-axis Split of (into q_heads·D,
    kv_heads·D and kv_heads·D): (it, the Split)."""
    split = sources[0].producer()
    if split is None or split.op_type != "Split" or split.domain not in ("", "ai.onnx") or len(split.outputs) != 3:
        return None
    if list(split.outputs) != sources or any(len(s.uses()) != 1 or s.is_graph_output() for s in sources):
        return None
    x = split.inputs[0]
    axis = split.attributes["axis"].value if "axis" in split.attributes else 0
    # a custom op's output (the GEMM kernels') has no inferred shape: then the Split's outputs tell the rank
    shaped = x if x.shape is not None else sources[0]
    if shaped.shape is None or shaped.shape.rank() != 3 or axis not in (-1, 2):
        return None
    sizes = const_array(split.inputs[1]) if len(split.inputs) > 1 and split.inputs[1] is not None else None
    if sizes is None or sizes.size != 3:
        return None
    head_dim = int(sizes.reshape(-1)[0]) // q_heads
    if [int(s) for s in sizes.reshape(-1)] != [q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]:
        return None
    return x, split


def fuse(graph: ir.Graph, kernel_ops: tuple[str, ...]) -> int:
    """Fold each kernel attention's operand and output plumbing into it (module docstring); returns how many."""
    count = 0
    for node in [n for n in graph if n.domain == KERNEL_DOMAIN and n.op_type in kernel_ops]:
        if len(node.inputs) != 12:
            continue
        q_heads, kv_heads = node.attributes["q_heads"].value, node.attributes["kv_heads"].value
        dead: list[ir.Node] = []
        rotary = [_rotary_of(node.inputs[i]) for i in (0, 1)]
        if all(r is not None for r in rotary):
            (q, cos, sin, rq), (k, cos_k, sin_k, rk) = rotary
            if cos_k is not cos or sin_k is not sin:
                continue
            dead += [rq, rk]
            caches = [cos, sin]
        elif all(r is None for r in rotary):
            q, k, caches = node.inputs[0], node.inputs[1], []
        else:
            continue
        heads = [_heads_of(x, h) for x, h in ((q, q_heads), (k, kv_heads), (node.inputs[2], kv_heads))]
        if any(h is None for h in heads):
            continue
        sources = [src for src, _, _ in heads]
        out_t = _only_use(node.outputs[0], "Transpose")
        out_r = _only_use(out_t.outputs[0], "Reshape") if out_t is not None and _perm(out_t) == _HEAD_MAJOR else None
        if out_r is None or out_r.outputs[0].shape is not None and out_r.outputs[0].shape.rank() != 3:
            continue  # the heads merged back into [1, T, Hq·D], or another reshape: left alone
        normed = [_merged_heads(graph, norm) if norm is not None else None for _, _, norm in heads]
        packed = _packed_source(sources, q_heads, kv_heads) if all(m is None for m in normed) else None
        operands = ([packed[0], None, None] if packed
                    else [src if m is None else m.outputs[0] for m, src in zip(normed, sources, strict=True)])
        dead += [n for _, nodes, _ in heads for n in nodes] + ([packed[1]] if packed else [])
        graph.insert_before(node, [m for m in normed if m is not None])
        fused = ir.node(node.op_type, [*operands, *node.inputs[3:], *caches],
                        attributes=dict(node.attributes), domain=node.domain, num_outputs=3)
        out, k_out, v_out = fused.outputs
        y = out_r.outputs[0]
        out.shape, out.dtype = y.shape, y.dtype
        graph.insert_before(node, fused)
        pools = [(old.name, old, new) for old, new in zip(node.outputs[1:], (k_out, v_out), strict=True)]
        for _, old, new in pools:  # the pools' outputs are graph outputs: the new node's take their places
            new.shape, new.dtype = old.shape, old.dtype
            graph.outputs[graph.outputs.index(old)] = new
        y_output, y_name = y.is_graph_output(), y.name
        y.replace_all_uses_with(out, replace_graph_outputs=True)
        name = node.name
        graph.remove([out_r, out_t, node], safe=True)
        for n in dead:  # nearest the attention first: each one's only use is gone before it goes
            graph.remove(n, safe=True)
        fused.name = name
        if y_output:  # a graph output keeps its name
            out.name = y_name
        for pool_name, _, new in pools:
            new.name = pool_name
        count += 1
    return count
