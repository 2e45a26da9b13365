"""The lowered step graph in float16 (``compile.weights: float16`` / ``int8`` on the ascend target).

ATC compiles an already-float16 ONNX graph with ``--precision_mode=must_keep_origin_dtype``: nothing is
down-cast behind the graph's back and the float32 islands the graph itself holds stay float32 (reference
ascend.md §1.4; the LLM ports do the same). This pass makes that graph:

- every float32 tensor becomes float16 — weights (read lazily, one at a time), activations, the KV pools
  (graph inputs ``key_cache.N`` / ``value_cache.N`` and the new rows the graph returns), Constant / Cast /
  ConstantOfShape attributes;
- float32 islands where float16 overflows or loses the result (ascend.md §5: fp16 overflow in RMSNorm's sum
  of squares and in softmax): RMSNorm's ``x² → mean → + eps → sqrt → reciprocal`` chain (x² overflows float16
  from |x| = 256), every Softmax, and the rotary angles ``position · inv_freq`` up to Cos/Sin (float16 holds
  2048 only to ±1, a whole radian); a Cast to float32 enters each island and a Cast to float16 leaves it;
- the logits stay float32 (one Cast at the output): the runtime's sampler and the step ABI read float32;
- marked islands: a lowering that needs float32 math names the Casts entering it ``<ISLAND_IN>…`` and the Cast
  leaving it ``<ISLAND_OUT>…`` (the readonly paged attention's log-sum-exp merge, passes/ascend/readonly.py): every
  node reached forward from the entries, up to the exit, stays float32; an output a kernel produces in float32
  whatever its inputs (:data:`F32_OUTPUTS`) keeps its type.

Invariant (``ensures``): no float32 value is left outside the islands, the logits output and the Casts that
bound them. Plugin ops (NPURmsNorm …) take float16 in and out; their internal precision is CANN's.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from omforge.passes.util import read_weight

F32, F16 = ir.DataType.FLOAT, ir.DataType.FLOAT16
ISLAND_TAG = "omforge.precision"  # metadata on the nodes of a float32 island
ISLAND_IN, ISLAND_OUT = "f32_island_in.", "f32_island_out."  # value-name prefixes of a marked island's bounds
F32_OUTPUTS: dict[str, tuple[int, ...]] = {"OmFusedInferAttentionScoreLse": (1,)}
"""Outputs that are float32 whatever the graph: FIA's softmax_lse (DT_FLOAT only, hicann/ops-transformer c29bc10
``fused_infer_attention_score_def.cpp:544``)."""
# what follows RMSNorm's ReduceMean up to 1/rms (Pow: the ascend form without Sqrt, passes/ascend/lower.py)
_CHAIN = ("Add", "Sqrt", "Pow", "Reciprocal", "Div")


def _rms_island(mean: ir.Node) -> list[ir.Node] | None:
    """``Pow(x, 2) → ReduceMean → Add(eps) → Sqrt → Reciprocal`` (the plain RMSNorm decomposition) from its
    ReduceMean; None when ``mean`` is not one."""
    pow_ = mean.inputs[0].producer() if mean.inputs[0] is not None else None
    if pow_ is None or pow_.op_type != "Pow":
        return None
    nodes = [pow_, mean]
    while True:
        uses = list(nodes[-1].outputs[0].uses())
        if len(uses) != 1 or uses[0].node.op_type not in _CHAIN:
            break
        nodes.append(uses[0].node)
    return nodes


_ANGLE_OPS = ("Cast", "Mul", "MatMul", "Unsqueeze", "Reshape", "Transpose", "Concat", "Expand", "Gather", "Slice")


def _angle_island(trig: list[ir.Node]) -> list[ir.Node] | None:
    """Cos/Sin and the float math before them back to the Cast of the integer positions; None when the walk
    leaves the rotary angle math (more than 16 nodes, or an op that is not index/angle math)."""
    nodes: dict[int, ir.Node] = {id(n): n for n in trig}
    todo = list(trig)
    found_cast = False
    while todo:
        node = todo.pop()
        for value in node.inputs:
            producer = value.producer() if value is not None else None
            if producer is None or id(producer) in nodes or value.dtype != F32:
                continue
            if producer.op_type not in _ANGLE_OPS or len(nodes) >= 16:
                return None
            nodes[id(producer)] = producer
            if producer.op_type == "Cast" and producer.inputs[0] is not None \
                    and producer.inputs[0].dtype in (ir.DataType.INT64, ir.DataType.INT32):
                found_cast = True
                continue
            todo.append(producer)
    return list(nodes.values()) if found_cast else None


def islands(graph: ir.Graph) -> list[tuple[str, list[ir.Node]]]:
    """The float32 islands of a lowered float32 graph, as (kind, nodes)."""
    found: list[tuple[str, list[ir.Node]]] = []
    for node in graph:
        if node.op_type == "ReduceMean" and (chain := _rms_island(node)) is not None:
            found.append(("rms", chain))
        elif node.op_type == "Softmax":
            found.append(("softmax", [node]))
    trig = [n for n in graph if n.op_type in ("Cos", "Sin")]
    if trig and (angles := _angle_island(trig)) is not None:
        found.append(("rotary", angles))
    found.extend(("marked", chain) for chain in _marked_islands(graph))
    return found


def _marked_islands(graph: ir.Graph) -> list[list[ir.Node]]:
    """The marked islands (module docstring) as one node list (empty: none): the nodes reached forward from the
    Casts whose outputs are named ``ISLAND_IN…``, not past a Cast whose output is named ``ISLAND_OUT…``."""
    def named(node: ir.Node, prefix: str) -> bool:
        return node.op_type == "Cast" and (node.outputs[0].name or "").startswith(prefix)

    chain: list[ir.Node] = []
    seen: set[int] = set()
    todo = [n for n in graph if named(n, ISLAND_IN)]
    while todo:
        node = todo.pop()
        if id(node) in seen or named(node, ISLAND_OUT):
            continue
        seen.add(id(node))
        chain.append(node)
        todo.extend(use.node for out in node.outputs for use in out.uses())
    return [chain] if chain else []


_INT_OUT = {"Shape": ir.DataType.INT64, "Size": ir.DataType.INT64, "NonZero": ir.DataType.INT64,
            "ArgMax": ir.DataType.INT64, "ArgMin": ir.DataType.INT64}
_BOOL_OUT = ("Equal", "Greater", "Less", "GreaterOrEqual", "LessOrEqual", "Not", "And", "Or", "IsNaN", "IsInf")


def annotate_dtypes(graph: ir.Graph) -> None:
    """Give every untyped node output its element type, in graph (topological) order: Cast's ``to``, a
    Constant's tensor, int64 for Shape-like ops, bool for comparisons, Where's branch type, else the type of
    the first typed input (element-wise, layout and reduction ops; plugin ops pass their input type through)."""
    for node in graph:
        for out in node.outputs:
            if out.dtype is not None:
                continue
            dtype = None
            if node.op_type == "Cast":
                dtype = ir.DataType(node.attributes.get_int("to"))
            elif node.op_type in ("Constant", "ConstantOfShape") and "value" in node.attributes:
                dtype = node.attributes["value"].value.dtype
            elif node.op_type == "Constant":
                dtype = ir.DataType.INT64 if any(k in node.attributes for k in ("value_int", "value_ints")) else F32
            elif node.op_type in _INT_OUT:
                dtype = _INT_OUT[node.op_type]
            elif node.op_type in _BOOL_OUT:
                dtype = ir.DataType.BOOL
            else:
                inputs = node.inputs[1:] if node.op_type == "Where" else node.inputs
                dtype = next((v.dtype for v in inputs if v is not None and v.dtype is not None), None)
            if dtype is not None:
                out.type = ir.TensorType(dtype)


def _f16_tensor(t: ir.TensorProtocol) -> ir.TensorProtocol:
    if t.dtype != F32:
        return t

    def convert() -> ir.Tensor:
        return ir.tensor(read_weight(t).astype(np.float16), name=t.name)

    return ir.LazyTensor(convert, dtype=F16, shape=t.shape, name=t.name)


def _retype(value: ir.Value, dtype: ir.DataType) -> None:
    if value.dtype == F32 or value.dtype is None and value.const_value is not None and value.const_value.dtype == F32:
        value.type = ir.TensorType(dtype)


def _f16(values: object) -> np.ndarray:
    """float16 with out-of-range values saturated (a mask's float32 minimum becomes float16's, not -inf)."""
    f16 = np.finfo(np.float16)
    return np.clip(np.asarray(values, np.float32), f16.min, f16.max).astype(np.float16)


def _convert_attributes(node: ir.Node) -> None:
    attrs = node.attributes
    if node.op_type == "Cast" and attrs.get_int("to") == F32.value:
        attrs["to"] = ir.AttrInt64("to", F16.value)
    elif node.op_type in ("Constant", "ConstantOfShape"):
        if "value" in attrs and attrs["value"].value.dtype == F32:
            attrs["value"] = ir.AttrTensor("value", ir.tensor(_f16(attrs["value"].value.numpy())))
        elif "value_float" in attrs:
            v = attrs.pop("value_float").value
            attrs["value"] = ir.AttrTensor("value", ir.tensor(_f16(v)))
        elif "value_floats" in attrs:
            v = attrs.pop("value_floats").value
            attrs["value"] = ir.AttrTensor("value", ir.tensor(_f16(v)))


class CastToFloat16(ir.passes.InPlacePass):
    """See the module docstring. ``islands_made``: how many float32 islands, by kind (``rms``, ``softmax``)."""

    def __init__(self, logits: str = "logits"):
        super().__init__()
        self.logits = logits
        self.islands_made: dict[str, int] = {"rms": 0, "softmax": 0, "rotary": 0, "marked": 0}

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        annotate_dtypes(graph)
        found = islands(graph)
        inside = {id(n) for _, chain in found for n in chain}

        def island_only(value: ir.Value) -> bool:
            uses = list(value.uses())
            return bool(uses) and all(id(u.node) in inside for u in uses)

        # constants read only inside islands stay float32; shared ones are converted (an island casts them up)
        for node in list(graph):
            if id(node) in inside:
                continue
            if node.op_type == "Constant" and island_only(node.outputs[0]):
                node.metadata_props[ISLAND_TAG] = "float32"
                continue
            _convert_attributes(node)
            for i, out in enumerate(node.outputs):
                if i not in F32_OUTPUTS.get(node.op_type, ()):
                    _retype(out, F16)
        for value in graph.inputs:
            _retype(value, F16)
        for value in list(graph.initializers.values()):
            if value.const_value is not None and value.const_value.dtype == F32:
                if island_only(value):
                    continue
                value.const_value = _f16_tensor(value.const_value)
                value.type = ir.TensorType(F16)
        for kind, chain in found:
            self._bound(graph, chain)
            self.islands_made[kind] += 1
        self._logits_float32(graph)
        return ir.passes.PassResult(model, modified=True)

    @staticmethod
    def _bound(graph: ir.Graph, nodes: list[ir.Node]) -> None:
        """Cast the island's float16 inputs up, and each float32 output read outside it down."""
        ids = {id(n) for n in nodes}
        for node in nodes:
            node.metadata_props[ISLAND_TAG] = "float32"
            for i, value in enumerate(node.inputs):
                if value is None or value.dtype != F16:
                    continue
                up = ir.node("Cast", [value], attributes={"to": F32.value}, name=f"{node.name}_in{i}_f32")
                up.outputs[0].type, up.outputs[0].shape = ir.TensorType(F32), value.shape
                graph.insert_before(node, up)
                node.replace_input_with(i, up.outputs[0])
        for node in nodes:
            for out in node.outputs:
                outside = [u for u in out.uses() if id(u.node) not in ids]
                if out.dtype not in (F32, None) or not (outside or out.is_graph_output()):
                    continue  # an island's ops are float ops: an untyped output of one is float32
                out.type = ir.TensorType(F32)
                down = ir.node("Cast", [out], attributes={"to": F16.value}, name=f"{node.name}_out_f16")
                down.outputs[0].type, down.outputs[0].shape = ir.TensorType(F16), out.shape
                graph.insert_after(node, down)
                for use in outside:
                    use.node.replace_input_with(use.idx, down.outputs[0])

    def _logits_float32(self, graph: ir.Graph) -> None:
        for i, out in enumerate(graph.outputs):
            if out.name != self.logits or out.dtype != F16:
                continue
            cast = ir.node("Cast", [out], attributes={"to": F32.value}, name="logits_f32")
            result = cast.outputs[0]
            result.type, result.shape = ir.TensorType(F32), out.shape
            out.name, result.name = f"{self.logits}_f16", self.logits
            graph.append(cast)
            graph.outputs[i] = result

    def ensures(self, model: ir.Model) -> None:
        for node in model.graph:
            if node.metadata_props.get(ISLAND_TAG) == "float32" or node.name in ("logits_f32",) \
                    or (node.op_type == "Cast" and node.name.endswith("_f32")):
                continue
            for i, out in enumerate(node.outputs):
                if out.dtype == F32 and i not in F32_OUTPUTS.get(node.op_type, ()):
                    raise ir.passes.PostconditionError(f"{node.op_type} {node.name!r}: float32 output {out.name!r} "
                                                       "outside a float32 island")
