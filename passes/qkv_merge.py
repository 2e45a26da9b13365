"""Q/K/V projection merge: three MatMuls of one activation → one MatMul over ``[Wq | Wk | Wv]`` and a Split.

A multi-output rewrite, so written directly on onnx-ir rather than as a single-output pattern rule, in the
same three steps: *match* groups of exactly three MatMuls reading the same activation with constant 2-D
weights of equal rows (each optionally followed by an Add of a constant bias, Qwen2); *check* that either
all three or none carry a bias; *rewrite* to ``Split(MatMul(x, Wqkv) [+ bqkv])`` whose outputs replace the
three originals. The order of the three follows the graph's node order (q, k, v as exported).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from omforge.passes.util import concat_lazy, const_array, const_shape


@dataclass
class _Proj:
    matmul: ir.Node
    weight: tuple[int, ...]  # the weight's shape: its data is read only when the merged weight is
    bias_add: ir.Node | None
    bias: np.ndarray | None

    @property
    def output(self) -> ir.Value:
        return (self.bias_add or self.matmul).outputs[0]


def _projection(node: ir.Node) -> _Proj | None:
    w = const_shape(node.inputs[1])
    if w is None or len(w) != 2:
        return None
    users = node.outputs[0].uses()
    if len(users) == 1 and users[0].node.op_type == "Add":
        add = users[0].node
        other = add.inputs[1 - users[0].idx]
        b = const_array(other)
        if b is not None and b.ndim == 1 and b.shape[0] == w[1]:
            return _Proj(node, w, add, b)
    return _Proj(node, w, None, None)


def match(graph: ir.Graph) -> list[list[_Proj]]:
    groups: dict[int, list[ir.Node]] = {}
    for node in graph:
        if node.op_type == "MatMul" and node.domain in ("", "ai.onnx") and node.inputs[0] is not None:
            groups.setdefault(id(node.inputs[0]), []).append(node)
    found = []
    for nodes in groups.values():
        if len(nodes) != 3:
            continue
        projs = [_projection(n) for n in nodes]
        if all(p is not None for p in projs) and check(projs):  # type: ignore[arg-type]
            found.append(projs)
    return found


def check(projs: list[_Proj]) -> bool:
    rows = {p.weight[0] for p in projs}
    biased = {p.bias is not None for p in projs}
    return len(rows) == 1 and len(biased) == 1


def rewrite(graph: ir.Graph, projs: list[_Proj]) -> None:
    x = projs[0].matmul.inputs[0]
    first = projs[0].matmul
    wname = first.inputs[1].name
    name = wname.replace("q_proj", "qkv_proj") if "q_proj" in wname else wname + ".qkv"
    weight = concat_lazy([p.matmul.inputs[1] for p in projs], axis=1, name=name)
    graph.register_initializer(weight)
    matmul = ir.node("MatMul", [x, weight], name=f"{first.name}_qkv")
    new_nodes = [matmul]
    out = matmul.outputs[0]
    if projs[0].bias is not None:
        bname = name.replace(".weight.T", ".bias") if name.endswith(".weight.T") else f"{name}.bias"
        bias = ir.Value(name=bname, const_value=ir.tensor(np.concatenate([p.bias for p in projs]), name=bname))
        graph.register_initializer(bias)
        add = ir.node("Add", [out, bias], name=f"{first.name}_qkv_bias")
        new_nodes.append(add)
        out = add.outputs[0]
    sizes = ir.Value(name=f"{name}.split",
                     const_value=ir.tensor(np.array([p.weight[1] for p in projs], np.int64)))
    graph.register_initializer(sizes)
    split = ir.node("Split", [out, sizes], attributes={"axis": -1}, num_outputs=3, name=f"{first.name}_qkv_split")
    new_nodes.append(split)
    graph.insert_before(first, new_nodes)
    for proj, new_out in zip(projs, split.outputs):  # the name too: a projection may be a graph output
        new_out.shape, new_out.dtype, new_out.name = proj.output.shape, proj.output.dtype, proj.output.name
        proj.output.replace_all_uses_with(new_out, replace_graph_outputs=True)
        for old in (proj.bias_add, proj.matmul):
            if old is not None:
                graph.remove(old, safe=True)


def apply(model: ir.Model) -> int:
    """Merge every Q/K/V group in the main graph; returns the number of merges."""
    groups = match(model.graph)
    for projs in groups:
        rewrite(model.graph, projs)
    return len(groups)
