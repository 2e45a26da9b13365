"""What an ATC input graph asks of CANN's ONNX parser: every (domain, op type, opset), attribute form and dtype.

Read from the ``GraphProto`` alone (``onnx.load(..., load_external_data=False)``), so a graph of any size costs
what its node list costs. A :class:`Use` is one distinct way a node is written: its parser key (the domain, ``""``
as ATC's ``ai.onnx``, and the opset ATC keys it with: the model's opset_import of that domain, hicann/ge
``parser/parser/onnx/onnx_parser.cc`` ConstructOriType), its attributes as ``name: AttributeProto type`` (the form,
not the value), and the ONNX dtype of each input (``""`` for an omitted optional input). A ``Constant`` has no
inputs: its ``value`` tensor's dtype stands in its place, and initializers appear as the pseudo op
:data:`INITIALIZER` (the parser turns each into a ``Const`` or ``FileConstant``, ``ParseInitializer``).

Input dtypes come from the graph's inputs, initializers and value_info, then ONNX's own type inference node by
node; the op types ONNX does not define (CANN's ``NPU*`` and ours) follow :data:`OUTPUT_DTYPES`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import onnx
from onnx import AttributeProto, TensorProto, TypeProto, helper

INITIALIZER = "(initializer)"
"""The pseudo op type of a graph initializer (its dtype is the only input dtype it has)."""

_FLOAT = TensorProto.FLOAT
_CONSTANT_FORMS = {"value_int": TensorProto.INT64, "value_ints": TensorProto.INT64, "value_float": _FLOAT,
                   "value_floats": _FLOAT, "value_string": TensorProto.STRING, "value_strings": TensorProto.STRING}
"""The dtype ONNX gives a Constant's short forms (onnx/defs/generator/defs.cc): for typing what they feed."""
OUTPUT_DTYPES: dict[str, tuple[int | None, ...]] = {
    "OmRmsNorm": (None, _FLOAT),
    "NPURmsNorm": (None, _FLOAT),
    "OmAddRmsNorm": (None, _FLOAT, None),
    "NPUAddRmsNorm": (None, _FLOAT, None),
    "NPURotaryPositionEmbedding": (None,),
    "OmRotaryPositionEmbedding": (None,),
    "OmScatterPaKvCache": (None, None),  # key_cache, value_cache (input 0's dtype: one dtype, the proto's "T")
    "SwiGlu": (None,),
    "NPUWeightQuantBatchMatmulV2": (None,),
    "NPUPromptFlashAttention": (None,),
    "OmFusedInferAttentionScore": (None,),
    # the MoE chain (passes/ascend/moe.py): int32 indices (hicann/ops-transformer c29bc10 op_graph protos)
    "OmMoeGatingTopKSoftmax": (None, TensorProto.INT32, TensorProto.INT32),
    "OmMoeInitRouting": (None, TensorProto.INT32, TensorProto.INT32),
    "OmMoeComputeExpertTokens": (TensorProto.INT32,),
    "OmGroupedMatmul": (None,),
    "OmMoeFinalizeRoutingV2": (None,),
}
"""Output dtypes of the op types ONNX does not define: None = input 0's dtype; rstd is float32 whatever x is
(ops-nn ``norm/rms_norm/op_graph/rms_norm_proto.h`` and ``add_rms_norm_proto.h``: ``OUTPUT(rstd, DT_FLOAT…)``)."""


VARIADIC = frozenset({"Concat"})
"""Op types whose input count is the graph's business (the ``kv_new`` Concat has 2 inputs per layer): recorded as
``(dtype, "...")`` when every input has one dtype, so the layer count does not change the use."""


@dataclass(frozen=True, order=True)
class Use:
    """One distinct way the graph writes a node (see the module docstring)."""

    domain: str
    op_type: str
    opset: int
    attrs: tuple[tuple[str, str], ...]  # (name, AttributeProto type name), sorted by name
    dtypes: tuple[str, ...]  # ONNX dtype name per input ("" where an optional input is omitted)

    @property
    def key(self) -> str:
        """The key ATC's parser looks a plugin up by: ``<domain>::<opset>::<op_type>``."""
        return f"{self.domain or 'ai.onnx'}::{self.opset}::{self.op_type}"

    def to_json(self) -> list:
        return [self.domain, self.op_type, self.opset, [list(a) for a in self.attrs], list(self.dtypes)]

    @classmethod
    def from_json(cls, item: list) -> Use:
        domain, op_type, opset, attrs, dtypes = item
        return cls(domain, op_type, opset, tuple(tuple(a) for a in attrs), tuple(dtypes))


def _dtype_name(elem_type: int) -> str:
    return TensorProto.DataType.Name(elem_type)


def _tensor_type(elem_type: int) -> TypeProto:
    return helper.make_tensor_type_proto(elem_type, None)


def _elem(types: dict[str, TypeProto], name: str) -> int | None:
    t = types.get(name)
    return t.tensor_type.elem_type if t is not None and t.tensor_type.elem_type else None


def _infer(node: onnx.NodeProto, types: dict[str, TypeProto], model: onnx.ModelProto) -> None:
    """Type ``node``'s outputs in ``types`` (in place); leaves them untyped when nothing says their dtype."""
    if node.op_type == "Constant":
        attr = next(iter(node.attribute), None)
        dtype = attr.t.data_type if attr is not None and attr.name == "value" else _CONSTANT_FORMS.get(
            attr.name if attr is not None else "")
        if dtype is not None:
            types[node.output[0]] = _tensor_type(dtype)
        return
    if node.op_type in OUTPUT_DTYPES and node.domain in ("", "ai.onnx"):
        first = _elem(types, node.input[0]) if node.input else None
        for out, fixed in zip(node.output, OUTPUT_DTYPES[node.op_type]):
            dtype = fixed if fixed is not None else first
            if out and dtype is not None:
                types[out] = _tensor_type(dtype)
        return
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, node.domain)
        known = {x: types[x] for x in node.input if x in types}
        inferred = onnx.shape_inference.infer_node_outputs(schema, node, known, opset_imports=list(model.opset_import))
    except (onnx.defs.SchemaError, onnx.shape_inference.InferenceError, onnx.checker.ValidationError, RuntimeError,
            KeyError):  # a node ONNX itself rejects is still recorded, as written
        return
    for out, t in inferred.items():
        if t.tensor_type.elem_type:
            types[out] = _tensor_type(t.tensor_type.elem_type)


def uses(model: onnx.ModelProto) -> set[Use]:
    """Every distinct :class:`Use` of ``model``'s main graph (ATC parses subgraphs only for If/Loop, which our
    step graphs do not hold). Raises ``ValueError`` when an input's dtype cannot be told."""
    graph = model.graph
    opsets = {("ai.onnx" if o.domain == "" else o.domain): o.version for o in model.opset_import}
    types: dict[str, TypeProto] = {}
    for v in (*graph.input, *graph.value_info, *graph.output):
        if v.type.tensor_type.elem_type:
            types[v.name] = _tensor_type(v.type.tensor_type.elem_type)
    found: set[Use] = set()
    default = opsets.get("ai.onnx", 0)
    for t in graph.initializer:
        types[t.name] = _tensor_type(t.data_type)
        found.add(Use("", INITIALIZER, default, (), (_dtype_name(t.data_type),)))
    for node in graph.node:
        _infer(node, types, model)
        attrs = tuple(sorted((a.name, AttributeProto.AttributeType.Name(a.type)) for a in node.attribute))
        if node.op_type == "Constant":
            dtypes = tuple(_dtype_name(a.t.data_type) for a in node.attribute if a.type == AttributeProto.TENSOR)
        else:
            dtypes = []
            for x in node.input:
                elem = _elem(types, x) if x else None
                if x and elem is None:
                    raise ValueError(f"node '{node.name}' ({node.op_type}): the dtype of input '{x}' is unknown")
                dtypes.append(_dtype_name(elem) if elem else "")
            dtypes = tuple(dtypes)
        if node.op_type in VARIADIC and len(set(dtypes)) == 1:
            dtypes = (dtypes[0], "...")
        domain = "" if node.domain == "ai.onnx" else node.domain
        found.add(Use(domain, node.op_type, opsets.get(domain or "ai.onnx", 0), attrs, dtypes))
    return found


def file_uses(path: Path) -> set[Use]:
    """:func:`uses` of the ONNX file at ``path``, read without its external data."""
    return uses(onnx.load(str(path), load_external_data=False))


def sorted_uses(items: Iterable[Use]) -> list[Use]:
    return sorted(set(items))
