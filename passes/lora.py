"""LoRA insertion (docs/lora.md): each targeted projection of the fused graph gets ``omforge.LoraAdd`` on its output.

Runs after the fusions and their cleanup (a projection may then be fused: ``qkv`` = ``[q | k | v]`` columns,
``gate_up`` = ``[gate | up]``) and before the paged-KV insertion. A projection is a default-domain ``MatMul`` whose
weight is the export's initializer ``model.layers.{i}.self_attn.{q,k,v,qkv,o}_proj.weight.T`` or
``model.layers.{i}.mlp.{gate,up,gate_up,down}_proj.weight.T`` (``[in, out]``; the fusions name merged weights so,
passes/qkv_merge.py and gate_up_swiglu.py). Of its parts (contract/lora.py ``PROJECTIONS``, column widths from the
model config: q = heads·head_dim, k = v = kv_heads·head_dim, gate = up = intermediate) those the recipe targets are
kept, in column order; a projection with none is left alone.

  LoraAdd(y, x, lora_a, lora_b, lora_slots) -> y'     y [..., out], x [..., in] (the projection's input), lora_a
      [S, P·R, in], lora_b [S, out, P·R], lora_slots [1, T] int64 with T = the element count of x's leading dims:
      y'[t] = y[t] + lora_b[slot_t] · (lora_a[slot_t] · x[t])

The term is added after a constant bias Add (Qwen2) and before anything reads the projection (Split, SwiGLU, the
residual Add): every use of the old output is rewired. Graph inputs (float32): ``lora_a.{layer}.{name}``,
``lora_b.{layer}.{name}`` per projection and one ``lora_slots [1, num_tokens]`` (the token dim the paged-KV
insertion gives ``input_ids``). :func:`lower_plain` is the plain-op form any target runs (ORT without the kernel
library, Ascend); :func:`lower_kernel` the kernel library's ``omforge.kernels.LoraAdd``, same operands.

Postcondition: every targeted module has a part in at least one layer (else a one-line error naming
``compile.lora.target_modules``), and the section lists the projections in layer order.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from omforge.contract.kernel_abi import DOMAIN as KERNEL_DOMAIN
from omforge.contract.lora import PROJECTIONS, SLOTS_INPUT, TARGET_MODULES, pool_a, pool_b
from omforge.contract.manifest import LoraPart, LoraProjection, LoraSection, ModelConfig
from omforge.errors import OmforgeError
from omforge.passes import ops
from omforge.passes.options import LoraOptions
from omforge.passes.util import const_array, const_shape

OP = "LoraAdd"
TOKEN_DIM = "num_tokens"
"""The packed token dim of the step ABI (passes/paged_kv.py gives ``input_ids`` ``[1, num_tokens]``)."""

_WEIGHT = re.compile(r"model\.layers\.(\d+)\.(?:self_attn\.(qkv|q|k|v|o)|mlp\.(gate_up|gate|up|down))_proj\.weight\.T")


class LoraTargetMissing(ir.passes.PostconditionError, OmforgeError):
    """A targeted module is part of no projection of the graph (one line naming ``compile.lora.target_modules``)."""


@dataclass(frozen=True)
class _Found:
    layer: int
    name: str
    matmul: ir.Node
    output: ir.Value  # the projection's output (after its bias Add, if any)
    in_features: int
    out_features: int


def part_widths(name: str, out_features: int, config: ModelConfig | None) -> list[int]:
    """The output columns of each module of projection ``name`` (``PROJECTIONS[name]`` order): from the model
    config when given, else an unfused projection's whole width and a fused one's by its known split (qkv: the
    config is needed unless q, k and v are equal; gate_up: halves)."""
    modules = PROJECTIONS[name]
    if len(modules) == 1:
        return [out_features]
    if config is not None:
        q, kv, inter = (config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim,
                        config.intermediate_size)
        widths = {"q_proj": q, "k_proj": kv, "v_proj": kv, "gate_proj": inter, "up_proj": inter}
        return [widths[m] for m in modules]
    if out_features % len(modules):
        raise ValueError(f"LoRA insertion: {name}_proj of {out_features} columns does not split evenly; pass the "
                         "model config")
    return [out_features // len(modules)] * len(modules)


def _output(matmul: ir.Node, out_features: int) -> ir.Value:
    """The MatMul's output, or that of the constant 1-D bias Add that is its one use (Qwen2's q/k/v)."""
    y = matmul.outputs[0]
    uses = list(y.uses())
    if len(uses) == 1 and uses[0].node.op_type == "Add" and uses[0].node.domain in ("", "ai.onnx") \
            and not y.is_graph_output():
        add = uses[0].node
        bias = const_array(add.inputs[1 - uses[0].idx])
        if bias is not None and bias.ndim == 1 and bias.shape[0] == out_features:
            return add.outputs[0]
    return y


def find_projections(graph: ir.Graph) -> list[_Found]:
    """Every projection MatMul of the graph (by its weight's name), in layer order then graph order."""
    found = []
    for node in graph:
        if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
            continue
        w = node.inputs[1]
        m = _WEIGHT.fullmatch(w.name or "") if w is not None else None
        shape = const_shape(w)
        if m is None or shape is None or len(shape) != 2:
            continue
        found.append(_Found(int(m[1]), m[2] or m[3], node, _output(node, shape[1]), shape[0], shape[1]))
    return sorted(found, key=lambda f: f.layer)  # stable: graph order within a layer


def _input(name: str, dims: Sequence[int | str], dtype: ir.DataType) -> ir.Value:
    return ir.Value(name=name, shape=ir.Shape(list(dims)), type=ir.TensorType(dtype))


def insert_lora(model: ir.Model, max_loras: int, max_rank: int, target_modules: Sequence[str],
                config: ModelConfig | None = None) -> LoraSection:
    """Insert ``LoraAdd`` on every targeted projection of ``model`` in place; returns the manifest section."""
    unknown = sorted(set(target_modules) - set(TARGET_MODULES))
    if unknown:
        raise ValueError(f"LoRA insertion: unknown target modules {unknown}")
    graph = model.graph
    slots_dim = max_loras + 1
    slots: ir.Value | None = None
    projections = []
    for f in find_projections(graph):
        starts = np.cumsum([0, *part_widths(f.name, f.out_features, config)])
        if starts[-1] != f.out_features:
            raise ValueError(f"LoRA insertion: layer {f.layer} {f.name}_proj has {f.out_features} columns, its parts "
                             f"{list(PROJECTIONS[f.name])} {int(starts[-1])} by the model config")
        parts = tuple(LoraPart(module, int(starts[i]), int(starts[i + 1]))
                      for i, module in enumerate(PROJECTIONS[f.name]) if module in target_modules)
        if not parts:
            continue
        if slots is None:
            slots = _input(SLOTS_INPUT, [1, TOKEN_DIM], ir.DataType.INT64)
            graph.inputs.append(slots)
        rank_rows = len(parts) * max_rank
        a = _input(pool_a(f.layer, f.name), [slots_dim, rank_rows, f.in_features], ir.DataType.FLOAT)
        b = _input(pool_b(f.layer, f.name), [slots_dim, f.out_features, rank_rows], ir.DataType.FLOAT)
        graph.inputs.extend([a, b])
        y = f.output
        node = ir.node(OP, [y, f.matmul.inputs[0], a, b, slots], domain=ops.DOMAIN, name=f"lora.{f.layer}.{f.name}")
        out = node.outputs[0]
        out.shape, out.type = y.shape, y.type
        graph.insert_after(y.producer(), node)
        for use in list(y.uses()):
            if use.node is not node:
                use.node.replace_input_with(use.idx, out)
        if y.is_graph_output():
            out.name, y.name = y.name, f"{y.name}.base"
            graph.outputs[graph.outputs.index(y)] = out
        projections.append(LoraProjection(f.layer, f.name, f.in_features, f.out_features, parts))
    if projections:
        model.opset_imports.setdefault(ops.DOMAIN, ops.VERSION)
    return LoraSection(max_loras, max_rank, tuple(target_modules), tuple(projections))


def check_targets(section: LoraSection) -> None:
    """Every targeted module has a part somewhere: else :class:`LoraTargetMissing`."""
    have = {p.target for proj in section.projections for p in proj.parts}
    missing = [m for m in section.target_modules if m not in have]
    if missing:
        raise LoraTargetMissing(f"compile.lora.target_modules: {', '.join(missing)} found in no layer of the graph "
                                "(no projection MatMul with that weight); drop it from the list")


class InsertLora(ir.passes.InPlacePass):
    """:func:`insert_lora` with its :class:`LoraOptions`; ``section``: the :class:`LoraSection` it made (the
    manifest's ``lora``), ``count``: LoraAdd nodes."""

    def __init__(self, options: LoraOptions):
        super().__init__()
        self.options = options
        self.section: LoraSection | None = None
        self.count = 0

    def requires(self, model: ir.Model) -> None:
        if any(n.op_type == "PagedAttention" and n.domain == ops.DOMAIN for n in model.graph):
            raise ir.passes.PreconditionError("LoRA insertion runs before the paged-KV insertion")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        o = self.options
        self.section = insert_lora(model, o.max_loras, o.max_rank, o.target_modules, o.config)
        self.count = len(self.section.projections)
        return ir.passes.PassResult(model, modified=self.count > 0)

    def ensures(self, model: ir.Model) -> None:
        assert self.section is not None
        check_targets(self.section)


def _const(name: str, values: Sequence[int]) -> ir.Node:
    return ir.node("Constant", [], attributes={"value": ir.tensor(np.array(values, np.int64))}, name=name)


def lower_plain(graph: ir.Graph) -> int:
    """Every ``LoraAdd`` as plain ops: ``Gather(lora_a, slots [T])`` ``[T, P·R, in]`` · ``x [T, in, 1]``, then
    ``Gather(lora_b, slots)`` ``[T, out, P·R]`` · that, reshaped to ``y``'s shape and added (batched 3-D MatMuls,
    int64 indices, constants in the ``value`` form). Returns the nodes lowered."""
    nodes = [n for n in graph if n.op_type == OP and n.domain == ops.DOMAIN]
    for node in nodes:
        y, x, a, b, slots = node.inputs
        n = node.name or "lora"
        in_features = a.shape[-1] if a.shape is not None else None
        if not isinstance(in_features, int):
            raise ValueError(f"{n}: lora_a's in_features must be static")
        flat, x3 = _const(f"{n}.flat", [-1]), _const(f"{n}.x_shape", [-1, in_features, 1])
        idx = ir.node("Reshape", [slots, flat.outputs[0]], name=f"{n}.slots")
        ga = ir.node("Gather", [a, idx.outputs[0]], attributes={"axis": 0}, name=f"{n}.gather_a")
        xr = ir.node("Reshape", [x, x3.outputs[0]], name=f"{n}.x")
        h = ir.node("MatMul", [ga.outputs[0], xr.outputs[0]], name=f"{n}.a_x")
        gb = ir.node("Gather", [b, idx.outputs[0]], attributes={"axis": 0}, name=f"{n}.gather_b")
        d = ir.node("MatMul", [gb.outputs[0], h.outputs[0]], name=f"{n}.b_ax")
        shape = ir.node("Shape", [y], name=f"{n}.y_shape")
        dr = ir.node("Reshape", [d.outputs[0], shape.outputs[0]], name=f"{n}.term")
        add = ir.node("Add", [y, dr.outputs[0]], name=f"{n}.add")
        _replace(graph, node, [flat, x3, idx, ga, xr, h, gb, d, shape, dr, add])
    return len(nodes)


def lower_kernel(graph: ir.Graph) -> int:
    """Every ``LoraAdd`` as the kernel library's ``omforge.kernels.LoraAdd`` (same operands; the session registers
    the library). Returns the nodes lowered."""
    nodes = [n for n in graph if n.op_type == OP and n.domain == ops.DOMAIN]
    for node in nodes:
        _replace(graph, node, [ir.node(OP, list(node.inputs), domain=KERNEL_DOMAIN, name=node.name)])
    return len(nodes)


def _replace(graph: ir.Graph, node: ir.Node, new: list[ir.Node]) -> None:
    old, out = node.outputs[0], new[-1].outputs[0]
    out.shape = old.shape
    if old.type is not None and old.dtype is not None:
        out.type = old.type
    graph.insert_before(node, new)
    name = old.name
    old.replace_all_uses_with(out, replace_graph_outputs=True)
    graph.remove(node, safe=True)
    out.name = name
