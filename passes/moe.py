"""Mixture-of-experts fusion: the exported sparse MoE block → ``omforge.MoE(x, router_logits, gate_up, down)``.

Pattern (the export of :class:`omforge.models.llama.SparseMoeBlock`, E experts)::

    p       = Softmax(router_logits, axis -1)                 (router_logits: the router MatMul, left as it is)
    (w, i)  = TopK(p, k, axis -1, largest)
    w'      = Div(w, ReduceSum(w, [-1], keepdims))            (normalize 1; w' = w without it: normalize 0)
    routing = ScatterElements(zeros [.., E], i, w', axis -1)  (zeros: Expand / ConstantOfShape of a constant 0)
    y_e     = MatMul(silu(MatMul(x, Wg_e)) · MatMul(x, Wu_e), Wd_e)            for e = 0 … E-1
    y       = ReduceSum(Unsqueeze(routing, [-1]) · Concat(Unsqueeze(y_e, [-2]) …, axis -2), [-2])

A multi-node rewrite written on onnx-ir (the expert count varies), in :mod:`omforge.passes.qkv_merge`'s three steps:
*match* from each ``ReduceSum`` whose input multiplies an unsqueezed ``ScatterElements`` (the candidates);
*check* the rest of the pattern, giving a one-line reason for a candidate that fails (:class:`NoMatch`); *rewrite*
to one ``omforge.MoE`` (attributes ``top_k``, ``normalize``) whose weights are the experts' constants stacked
lazily (read when saved or quantized): ``gate_up_weight [E, H, 2F]`` (each expert's gate columns, then its up
columns: ``GateUpSwiGLU``'s merge) named ``….experts.gate_up_proj.weight.T`` and ``down_weight [E, F, H]`` named
``….experts.down_proj.weight.T``. The MoE's nodes that nothing else reads are removed.

Runs before ``gate_up_swiglu`` (passes/manager.py), which would otherwise fuse every expert's gate/up on its own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from omforge.passes import ops
from omforge.passes.util import const_array, const_shape, read_weight


@dataclass
class Expert:
    """One expert's three weights (constants, MatMul layout: ``x @ W``) as the graph reads them."""

    gate: ir.Value  # [H, F]
    up: ir.Value  # [H, F]
    down: ir.Value  # [F, H]


@dataclass
class Block:
    """A matched MoE block: its inputs, attributes, the node whose output it replaces and the nodes it covers."""

    x: ir.Value
    router_logits: ir.Value
    experts: list[Expert]
    top_k: int
    normalize: bool
    anchor: ir.Node  # the final ReduceSum
    nodes: list[ir.Node]


@dataclass
class NoMatch:
    """A candidate (a ``ReduceSum`` of routing-weighted expert outputs) that is not the pattern, and why."""

    node: ir.Node
    reason: str


class _Fail(Exception):
    pass


def _producer(value: ir.Value | None, op_type: str, what: str) -> ir.Node:
    node = value.producer() if value is not None else None
    if node is None or node.op_type != op_type or node.domain not in ("", "ai.onnx"):
        raise _Fail(f"{what} is not a {op_type}")
    return node


def _axes(node: ir.Node, what: str) -> list[int]:
    """The constant axes of an Unsqueeze / ReduceSum (input 1), else a failure."""
    axes = const_array(node.inputs[1]) if len(node.inputs) > 1 else None
    if axes is None:
        raise _Fail(f"{what}: axes are not constant")
    return [int(a) for a in axes.reshape(-1)]


def _rank(value: ir.Value) -> int | None:
    return value.shape.rank() if value.shape is not None else None


def _is_axis(axis: int, want: int, rank: int | None) -> bool:
    """``axis`` names dimension ``want`` (negative) of a tensor of ``rank`` (None: only the negative spelling)."""
    return axis == want or (rank is not None and axis == rank + want)


def _int_attr(node: ir.Node, name: str, default: int) -> int:
    attr = node.attributes.get(name)
    return default if attr is None else int(attr.value)


def _candidate(node: ir.Node) -> tuple[ir.Node, ir.Node, ir.Node] | None:
    """``(Mul, Unsqueeze of ScatterElements, the Mul's other producer)`` when ``node`` is a ReduceSum of routing
    weights times something, else None (not a MoE candidate: no reason is given)."""
    if node.op_type != "ReduceSum" or node.domain not in ("", "ai.onnx") or node.inputs[0] is None:
        return None
    mul = node.inputs[0].producer()
    if mul is None or mul.op_type != "Mul" or mul.domain not in ("", "ai.onnx"):
        return None
    for a, b in (mul.inputs, reversed(mul.inputs)):
        un = a.producer() if a is not None else None
        if un is not None and un.op_type == "Unsqueeze" and un.inputs[0] is not None:
            scatter = un.inputs[0].producer()
            if scatter is not None and scatter.op_type == "ScatterElements":
                return mul, un, b.producer() if b is not None else None
    return None


def _routing(scatter: ir.Node, nodes: list[ir.Node]) -> tuple[ir.Value, int, bool]:
    """``(router_logits, top_k, normalize)`` behind the routing matrix ``scatter``."""
    if _int_attr(scatter, "axis", 0) not in (-1, (_rank(scatter.outputs[0]) or 0) - 1):
        raise _Fail("the routing scatter is not along the last axis")
    reduction = scatter.attributes.get("reduction")
    if reduction is not None and reduction.value != "none":
        raise _Fail(f"the routing scatter reduces ({reduction.value})")
    zeros, index, updates = scatter.inputs
    topk = _producer(index, "TopK", "the routing scatter's indices")
    if index is not topk.outputs[1]:
        raise _Fail("the routing scatter's indices are not TopK's indices")
    if _int_attr(topk, "axis", -1) not in (-1, (_rank(topk.outputs[0]) or 0) - 1) or not _int_attr(topk, "largest", 1):
        raise _Fail("TopK does not pick the largest along the last axis")
    k = const_array(topk.inputs[1])
    if k is None or k.size != 1:
        raise _Fail("TopK's k is not a constant")
    normalize = updates is not topk.outputs[0]
    if normalize:
        div = _producer(updates, "Div", "the routing weights")
        total = _producer(div.inputs[1], "ReduceSum", "the routing weights' divisor")
        if (div.inputs[0] is not topk.outputs[0] or total.inputs[0] is not topk.outputs[0]
                or _axes(total, "the weights' sum") not in ([-1], [(_rank(topk.outputs[0]) or 0) - 1])
                or not _int_attr(total, "keepdims", 1)):
            raise _Fail("the routing weights are not TopK's weights over their sum")
        nodes += [div, total]
    softmax = _producer(topk.inputs[0], "Softmax", "TopK's input")
    if _int_attr(softmax, "axis", -1) not in (-1, (_rank(softmax.outputs[0]) or 0) - 1):
        raise _Fail("the router softmax is not over the last axis")
    nodes += [softmax, topk, *_zeros_like(zeros, softmax.outputs[0])]
    return softmax.inputs[0], int(k.reshape(())), normalize


def _zeros_like(zeros: ir.Value | None, probs: ir.Value) -> list[ir.Node]:
    """The nodes of the scatter's data, checked to be torch's ``zeros_like(probs)``: ``Expand(0, Shape(probs))`` or
    ``ConstantOfShape(Shape(probs))`` of value 0."""
    fill = zeros.producer() if zeros is not None else None
    shape = fill.inputs[-1].producer() if fill is not None and fill.inputs and fill.inputs[-1] is not None else None
    if fill is not None and fill.op_type == "Expand":
        value = const_array(fill.inputs[0])
    elif fill is not None and fill.op_type == "ConstantOfShape":
        attr = fill.attributes.get("value")
        value = np.asarray(attr.value.numpy()) if attr is not None else np.zeros(1, np.float32)
    else:
        value = None
    if (value is None or np.any(value != 0) or shape is None or shape.op_type != "Shape" or shape.inputs[0] is not probs
            or _int_attr(shape, "start", 0) != 0 or shape.attributes.get("end") is not None):
        raise _Fail("the routing scatter does not start from zeros shaped like the router's probabilities")
    return [fill, shape]


def _expert(stacked: ir.Value | None, nodes: list[ir.Node]) -> tuple[ir.Value, Expert]:
    """``(x, weights)`` of one ``Unsqueeze(MatMul(silu(x·Wg)·(x·Wu), Wd), [-2])`` of the stack."""
    un = _producer(stacked, "Unsqueeze", "an expert's stacked output")
    if _axes(un, "an expert's unsqueeze") not in ([-2], [(_rank(un.outputs[0]) or 0) - 2]):
        raise _Fail("an expert's output is not stacked on axis -2")
    down = _producer(un.inputs[0], "MatMul", "an expert's output")
    mul = _producer(down.inputs[0], "Mul", "an expert's down projection input")
    for act, up_out in (mul.inputs, reversed(mul.inputs)):
        silu, up = act.producer() if act is not None else None, up_out.producer() if up_out is not None else None
        if silu is None or up is None or silu.op_type != "Mul" or up.op_type != "MatMul":
            continue
        for g, s in (silu.inputs, reversed(silu.inputs)):
            sig = s.producer() if s is not None else None
            gate = g.producer() if g is not None else None
            if (sig is not None and sig.op_type == "Sigmoid" and sig.inputs[0] is g and gate is not None
                    and gate.op_type == "MatMul"):
                if gate.inputs[0] is not up.inputs[0]:
                    raise _Fail("an expert's gate and up read different activations")
                nodes += [un, down, mul, silu, sig, gate, up]
                return gate.inputs[0], Expert(gate.inputs[1], up.inputs[1], down.inputs[1])
    raise _Fail("an expert is not silu(x·Wg)·(x·Wu)·Wd")


def _check_weights(experts: list[Expert]) -> None:
    shapes = {(const_shape(e.gate), const_shape(e.up), const_shape(e.down)) for e in experts}
    if len(shapes) != 1:
        raise _Fail("the experts' weights are not constants of one shape")
    ((gate, up, down),) = shapes
    if gate is None or up is None or down is None or len(gate) != 2 or gate != up or down != gate[::-1]:
        raise _Fail(f"the experts' weights are not [H, F], [H, F], [F, H] constants (got {gate}, {up}, {down})")


def check(anchor: ir.Node) -> Block | NoMatch | None:
    """The MoE block ending in ``anchor`` (a ReduceSum); a :class:`NoMatch` with the reason for a candidate that
    is not one; None when ``anchor`` is no candidate."""
    found = _candidate(anchor)
    if found is None:
        return None
    mul, routing_un, stack = found
    nodes = [anchor, mul, routing_un]
    try:
        if _int_attr(anchor, "keepdims", 1) or _axes(anchor, "the combine") not in (
                [-2], [(_rank(mul.outputs[0]) or 0) - 2]):
            raise _Fail("the combine is not a sum over axis -2 without keepdims")
        if _axes(routing_un, "the routing unsqueeze") not in ([-1], [(_rank(routing_un.outputs[0]) or 0) - 1]):
            raise _Fail("the routing weights are not unsqueezed on the last axis")
        logits, k, normalize = _routing(routing_un.inputs[0].producer(), nodes)
        nodes.append(routing_un.inputs[0].producer())
        if stack is None or stack.op_type != "Concat" or _int_attr(stack, "axis", 0) not in (
                -2, (_rank(stack.outputs[0]) or 0) - 2):
            raise _Fail("the expert outputs are not stacked by a Concat on axis -2")
        pairs = [_expert(v, nodes) for v in stack.inputs]
        nodes.append(stack)
        xs = {id(x) for x, _ in pairs}
        if len(xs) != 1:
            raise _Fail("the experts read different activations")
        experts = [e for _, e in pairs]
        _check_weights(experts)
        num = logits.shape[-1] if logits.shape is not None and logits.shape.rank() else None
        if isinstance(num, int) and num != len(experts):
            raise _Fail(f"the router scores {num} experts but {len(experts)} are stacked")
        if not 1 <= k <= len(experts):
            raise _Fail(f"top_k {k} is not between 1 and the {len(experts)} experts")
    except _Fail as e:
        return NoMatch(anchor, str(e))
    return Block(pairs[0][0], logits, experts, k, normalize, anchor, nodes)


def match(graph: ir.Graph) -> tuple[list[Block], list[NoMatch]]:
    """Every MoE block of the main graph, and every candidate that failed its check (with the reason)."""
    blocks, misses = [], []
    for node in list(graph):
        result = check(node)
        if isinstance(result, Block):
            blocks.append(result)
        elif isinstance(result, NoMatch):
            misses.append(result)
    return blocks, misses


def stacked_name(weight: ir.Value, proj: str, merged: str) -> str:
    """``model.layers.N.mlp.experts.0.<proj>.weight.T`` → ``model.layers.N.mlp.experts.<merged>.weight.T``."""
    name = weight.name or ""
    m = re.fullmatch(rf"(.*\.experts)\.\d+\.{proj}(\..*)?", name)
    return f"{m.group(1)}.{merged}{m.group(2) or ''}" if m else f"{name}.experts_{merged}"


def stack_lazy(parts: list[list[ir.Value]], name: str) -> ir.Value:
    """The initializer ``name``: for each expert its constants concatenated along their last axis, the experts
    stacked on a new axis 0; computed when read (saved, quantized), so stacking every layer's experts holds no
    stacked copy in memory (as :func:`omforge.passes.util.concat_lazy`)."""
    tensors = [[v.const_value for v in row] for row in parts]
    first = [int(d) for d in tensors[0][0].shape]
    shape = [len(tensors), *first[:-1], sum(int(t.shape[-1]) for t in tensors[0])]
    dtype = tensors[0][0].dtype

    def stacked() -> ir.Tensor:
        out = np.empty(shape, dtype=dtype.numpy())
        for e, row in enumerate(tensors):
            out[e] = np.concatenate([read_weight(t) for t in row], axis=-1)
        return ir.tensor(out, name=name)

    lazy = ir.LazyTensor(stacked, dtype=dtype, shape=ir.Shape(shape), name=name)
    return ir.Value(name=name, shape=ir.Shape(shape), type=ir.TensorType(dtype), const_value=lazy)


def rewrite(graph: ir.Graph, block: Block) -> ir.Node:
    """Replace ``block`` by one ``omforge.MoE`` node (returned) before its final ReduceSum."""
    first = block.experts[0]
    gate_up = stack_lazy([[e.gate, e.up] for e in block.experts], stacked_name(first.gate, "gate_proj", "gate_up_proj"))
    down = stack_lazy([[e.down] for e in block.experts], stacked_name(first.down, "down_proj", "down_proj"))
    for w in (gate_up, down):
        graph.register_initializer(w)
    anchor = block.anchor
    node = ir.node("MoE", [block.x, block.router_logits, gate_up, down], domain=ops.DOMAIN,
                   attributes={"top_k": block.top_k, "normalize": int(block.normalize)}, name=f"{anchor.name}_moe",
                   metadata_props=dict(anchor.metadata_props))
    graph.insert_before(anchor, node)
    old, new = anchor.outputs[0], node.outputs[0]
    new.shape, new.dtype, new.name = old.shape, old.dtype, old.name  # the name too: the block may be a graph output
    old.replace_all_uses_with(new, replace_graph_outputs=True)
    _remove_dead(graph, block.nodes)
    return node


def _remove_dead(graph: ir.Graph, nodes: list[ir.Node]) -> None:
    """Remove the block's nodes nothing reads any more (outputs read elsewhere keep theirs), consumers first."""
    order = {id(n): i for i, n in enumerate(graph)}
    for node in sorted({id(n): n for n in nodes}.values(), key=lambda n: order.get(id(n), -1), reverse=True):
        if node.graph is graph and not any(o.uses() or o.is_graph_output() for o in node.outputs):
            graph.remove(node, safe=True)


def apply(model: ir.Model) -> int:
    """Fuse every MoE block of the main graph; returns the number fused."""
    blocks, _ = match(model.graph)
    for block in blocks:
        rewrite(model.graph, block)
    if blocks:
        model.opset_imports.setdefault(ops.DOMAIN, ops.VERSION)
    return len(blocks)
