"""The CANN conformance matrix: every (domain, op type, opset range) our ascend step graphs hold, with the
attribute forms and input dtypes we emit, each cited to the CANN source that parses, maps or lists it.

How ATC reads an ONNX node (hicann/ge ``parser/parser/onnx/onnx_parser.cc``): ``Constant`` (and ``Input`` /
``FileConstant``) go straight to the parser's own op map ``kOnnxOpMap``; every other node is keyed
``<domain>::<opset>::<op_type>`` (ConstructOriType) and needs a plugin registered under that exact key
(``REGISTER_CUSTOM_OP(<GE op>).FrameworkType(ONNX).OriginOpType({...})``; E16002 otherwise). The plugin's
``ParseParamsFn`` reads the ``NodeProto``'s attributes by name and, in most plugins, by ``AttributeProto`` type: an
attribute in another form is skipped (so a required one fails the parse, an optional one silently takes its
default). The GE op's prototype (``REG_OP(...).INPUT(x, TensorType({...}))``, the ``op_graph/*_proto.h`` of the ops
repositories) lists the dtypes each input accepts.

A :class:`Row` holds only what our graphs use: the attributes in the form we emit them and the input dtype
signatures we emit, each checked against what the cited prototype line compiles to (its text in
:mod:`.prototypes`, read by :mod:`.proto_types`: ``TensorType{(A, B)}`` is B alone; :func:`listing_gaps`).
``value_int``, ``value_ints``,
``value_float(s)`` and ``value_string(s)`` of ``Constant`` have no row: ``ParseConstFromInput`` reads only
``value`` (reference/ascend.md §5.2). Rows for our own op types cite our plugin sources (compile/ascend/atc_plugins.py,
compile/ascend/templates/) and the CANN prototype of the GE op they map to. :func:`violations` is what the FAKE atc
enforces (compile/ascend/atc_conformance.py); docs/ascend-conformance.md is generated from these rows
(:mod:`omforge.compile.ascend.conformance_doc`). Nothing here has run through a real ATC.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from omforge.compile.ascend.proto_types import onnx_types
from omforge.compile.ascend.prototypes import LISTED
from omforge.compile.ascend.step_usage import INITIALIZER, Use, file_uses

GE, MATH, NN, TRANSFORMER = "hicann/ge", "hicann/ops-math", "hicann/ops-nn", "hicann/ops-transformer"
TRANSFORMER_MIRROR, METADEF, OURS = "yuanfang-chen/ops-transformer", "hicann/metadef", "omforge"
REPOSITORIES: dict[str, str] = {
    GE: "ffdcbc9f7496c17a98c1d12762c61ed608ef3503",
    MATH: "c41933244c31e44fd496e3bb3212164f8c48c214",
    NN: "e5c3fa9327ea95ba26d06227e746923580d10921",
    TRANSFORMER: "c29bc1069d3252c641e2aa059ec88f392d3f05ac",
    TRANSFORMER_MIRROR: "d42d3a4b1c44fd75b429e2b0fb9009fc92922665",
    METADEF: "786891c02e5a7f509c6ffffd854e33ddefe3527c",
}
"""The commit of each repository read. hicann/ops-transformer's snapshot has no ``framework/`` (ONNX plugin)
folders; the rotary plugin is read from its GitHub mirror (reference/ascend.md §2.1 names it)."""


@dataclass(frozen=True)
class Cite:
    """A line of a source file: in a CANN repository (:data:`REPOSITORIES`) or in this one (``omforge``)."""

    repo: str
    path: str
    line: int

    def __str__(self) -> str:
        return f"{self.repo} {self.path}:{self.line}"


@dataclass(frozen=True)
class Attr:
    """An attribute in the form we emit it (``AttributeProto`` type name) and where CANN reads it in that form."""

    name: str
    form: str
    read_at: Cite


@dataclass(frozen=True)
class Row:
    """One op type over a range of opsets: what parses it, the attributes and input dtype signatures it takes."""

    domain: str  # "" = ai.onnx
    op_type: str
    opsets: tuple[int, int]  # inclusive: the versions whose key a plugin registers (or any, for kOnnxOpMap ops)
    ge_type: str
    parsed_at: Cite
    attrs: tuple[Attr, ...]
    dtypes: tuple[tuple[str, ...], ...]  # per signature, one ONNX dtype per input ("..." = the same, repeated)
    dtypes_at: Cite
    note: str = ""

    @property
    def key_text(self) -> str:
        lo, hi = self.opsets
        return f"{self.domain or 'ai.onnx'}::{lo}..{hi}::{self.op_type}"

    def matches(self, use: Use) -> bool:
        lo, hi = self.opsets
        return (use.domain, use.op_type) == (self.domain, self.op_type) and lo <= use.opset <= hi

    def gaps(self, use: Use) -> list[str]:
        """What in ``use`` (of this row's op and opset) this row lacks: attribute forms, the dtype signature."""
        forms = {(a.name, a.form) for a in self.attrs}
        out = [f"attribute {n}: {f}" for n, f in use.attrs if (n, f) not in forms]
        if use.dtypes not in self.dtypes:
            out.append(f"input dtypes ({', '.join(d or '-' for d in use.dtypes)})")
        return out


def at(repo: str, path: str, line: int) -> Cite:
    return Cite(repo, path, line)


_SIMILAR = "common/src/framework/similar_opp_onnx_plugin.cpp"
_UNARY = at(METADEF, "inc/external/graph/types.h", 400)  # TensorType::UnaryDataType(): …, DT_FLOAT, DT_FLOAT16, …
F32, F16, I64, I8, B = "FLOAT", "FLOAT16", "INT64", "INT8", "BOOL"
_PLUGIN = at(OURS, "compile/ascend/templates/onnx_plugin.cc.j2", 46)  # our parser plugins' registration
_ATTR_LINES = {"INT": 57, "FLOAT": 41, "STRING": 73}  # where omforge_onnx_attrs.h.j2 reads each attribute kind


def _our_attr(name: str, kind: str = "INT") -> Attr:
    """An attribute one of our parser plugins copies (omforge_onnx_attrs.h.j2, cited at its kind's reader)."""
    return Attr(name, kind, at(OURS, "compile/ascend/templates/omforge_onnx_attrs.h.j2", _ATTR_LINES[kind]))


def _plain(op: str, ge: str, line: int, dtypes: tuple[tuple[str, ...], ...], dtypes_at: Cite, note: str = "") -> Row:
    """An op of similar_opp_onnx_plugin.cpp: registered for ai.onnx 8..18 with a ParseParamsFn that reads no
    attribute (the REGISTER_CUSTOM_ONNX_OP macro at its line 14-30)."""
    return Row("", op, (8, 18), ge, at(MATH, _SIMILAR, line), (), dtypes, dtypes_at, note)


def _reduce(op: str, folder: str, plugin_line: int, keepdims_line: int, proto_line: int, note: str = "",
            dtypes: tuple[tuple[str, ...], ...] = ((F32, I64),)) -> Row:
    """A ReduceXxx of ai.onnx 13..18 through its own ONNX plugin (``keepdims`` read as INT), ``x`` a NumberType and
    ``axes`` an input (opset 18) of IndexNumberType (the proto line after ``x``'s)."""
    plugin = f"math/{folder}/framework/{folder}_onnx_plugin.cpp"
    return Row("", op, (13, 18), op, at(MATH, plugin, plugin_line),
               (Attr("keepdims", "INT", at(MATH, plugin, keepdims_line)),),
               dtypes, at(MATH, f"math/{folder}/op_graph/{folder}_proto.h", proto_line),
               f"x: NumberType() ({at(METADEF, 'inc/external/graph/types.h', 365)}); axes as input 1 (opset 18), "
               f"IndexNumberType (line {proto_line + 1}){note}")


ROWS: tuple[Row, ...] = (
    Row("", INITIALIZER, (1, 18), "Const / FileConstant", at(GE, "parser/parser/onnx/onnx_parser.cc", 359), (),
        ((F32,), (F16,), (I64,), (I8,), (B,)), at(GE, "parser/parser/onnx/onnx_util.cc", 17),
        "ParseInitializer makes each initializer a node with `value` (FileConstant when stored as external data, "
        "onnx_parser.cc:372); its dtype must be in ConvertOnnxDataType's map (onnx_util.cc:17-32: FLOAT, INT8, INT64, "
        "BOOL, FLOAT16 at lines 17, 19, 23, 25, 26; BOOL: the in-place graph's FIA causal mask)"),
    Row("", "Constant", (1, 18), "Const", at(GE, "parser/parser/onnx/onnx_parser.cc", 176),
        (Attr("value", "TENSOR", at(GE, "parser/parser/onnx/onnx_constant_parser.cc", 223)),),
        ((F32,), (F16,), (I64,)), at(GE, "parser/parser/onnx/onnx_constant_parser.cc", 110),
        "kOnnxOpMap (no opset key); ParseConstFromInput skips every attribute not named kAttrNameValue = \"value\" "
        "(onnx_util.h:46), so value_int(s)/value_float(s)/value_string(s) give an empty Const: no row. Dtypes: "
        "ParseConvertDataElements' cases FLOAT16 (line 118), INT64 (123), FLOAT (136)"),
    _plain("Add", "Add", 577, ((F32, F32), (F16, F16), (I64, I64)), at(MATH, "math/add/op_graph/add_proto.h", 37)),
    Row("", "Cast", (8, 18), "Cast", at(MATH, "math/cast/framework/cast_onnx_plugin.cpp", 59),
        (Attr("to", "INT", at(MATH, "math/cast/framework/cast_onnx_plugin.cpp", 27)),),
        ((F32,), (F16,), (I64,), ("INT32",)), at(MATH, "math/cast/op_graph/cast_proto.h", 53),
        "`to` is read with attr.i() (no type check) and mapped by GetOmDtypeFromOnnxDtype (onnx_common.h); INT32: "
        "MoeComputeExpertTokens' int32 counts to GroupedMatmul's int64 group_list (passes/ascend/moe.py)"),
    Row("", "Concat", (8, 18), "PartitionedCall → ConcatD",
        at(MATH, "conversion/concat/framework/concat_onnx_plugin.cpp", 115),
        (Attr("axis", "INT", at(MATH, "conversion/concat/framework/concat_onnx_plugin.cpp", 34)),),
        ((F32, "..."), (F16, "..."), (I64, "..."), (B, "...")),
        at(MATH, "conversion/concat_d/op_graph/concat_d_proto.h", 50),
        "a dynamic input (any count, one dtype; DT_BOOL at line 50: the gather path's masks)"),
    _plain("Cos", "Cos", 584, ((F32,),), at(MATH, "math/cos/op_graph/cos_proto.h", 39),
           f"UnaryDataType() ({_UNARY})"),
    _plain("Exp", "Exp", 591, ((F32,),), at(MATH, "math/exp/op_graph/exp_proto.h", 45),
           f"UnaryDataType() ({_UNARY}); the readonly paged attention's log-sum-exp (passes/ascend/readonly.py)"),
    _plain("Expand", "Expand", 592, ((F32, I64), (F16, I64), (B, I64)),
           at(MATH, "math/expand/op_graph/expand_proto.h", 44),
           "shape: int32 or int64 (line 45)"),
    _plain("And", "LogicalAnd", 578, ((B, B),), at(MATH, "math/logical_and/op_graph/logical_and_proto.h", 42),
           "x1 and x2 DT_BOOL only (lines 42-43)"),
    _plain("Or", "LogicalOr", 603, ((B, B),), at(MATH, "math/logical_or/op_graph/logical_or_proto.h", 42)),
    _plain("Equal", "Equal", 589, ((I64, I64), (F32, F32)), at(MATH, "math/equal/op_graph/equal_proto.h", 40),
           "x1 and x2 list DT_INT64 and DT_FLOAT (lines 40-47); y DT_BOOL (line 48). FLOAT: the plain MoE's top-k "
           "rounds (passes/ascend/moe.py routing_weights, a float32 island)"),
    Row("", "GreaterOrEqual", (12, 18), "GreaterEqual", at(MATH, _SIMILAR, 622), (), ((I64, I64),),
        at(MATH, "math/greater_equal/op_graph/greater_equal_proto.h", 36),
        f"registered for ai.onnx 8 and 12..18 ({_SIMILAR}:125, 278, 319, 373, 428, 484, 559, 622), no attribute read; "
        f"x1/x2 RealNumberType() ({at(METADEF, 'inc/external/graph/types.h', 371)})"),
    Row("", "Gather", (8, 18), "PartitionedCall → GatherV2",
        at(NN, "index/gather_v2/framework/gather_onnx_plugin.cpp", 92),
        (Attr("axis", "INT", at(NN, "index/gather_v2/framework/gather_onnx_plugin.cpp", 40)),),
        ((F32, I64), (F16, I64), (I64, I64)), at(NN, "index/gather_v2/op_graph/gather_v2_proto.h", 62),
        "indices: IndexNumberType (line 66: int32, int64); the subgraph sets negative_index_support (line 74)"),
    _plain("Greater", "Greater", 595, ((I64, I64),), at(MATH, "math/greater/op_graph/greater_proto.h", 40),
           f"RealNumberType() ({at(METADEF, 'inc/external/graph/types.h', 371)})"),
    _plain("Log", "Log", 599, ((F32,),), at(MATH, "math/log/op_graph/log_proto.h", 53),
           "x: FLOAT among lines 53-55; the readonly paged attention's log-sum-exp"),
    Row("", "MatMul", (8, 18), "BatchMatMulV2", at(NN, "matmul/mat_mul_v3/framework/matmul_onnx_plugin.cpp", 64),
        (), ((F32, F32), (F16, F16)), at(NN, "common/inc/op_graph/op_nn_proto_extend.h", 727),
        "the plugin reads only transA/transB/fixed_shift_value, which we never emit"),
    _plain("Mul", "Mul", 600, ((F32, F32), (F16, F16), (I64, I64)), at(MATH, "math/mul/op_graph/mul_proto.h", 49)),
    _plain("Neg", "Neg", 601, ((F32,), (F16,)), at(MATH, "math/neg/op_graph/neg_proto.h", 38)),
    _plain("Pow", "Pow", 604, ((F32, F32),), at(MATH, "math/pow/op_graph/pow_proto.h", 42)),
    _plain("Range", "Range", 626, ((I64, I64, I64),), at(MATH, "math/range/op_graph/range_proto.h", 56)),
    _plain("Reciprocal", "Reciprocal", 605, ((F32,),), at(MATH, "math/reciprocal/op_graph/reciprocal_proto.h", 38)),
    _reduce("ReduceMean", "reduce_mean", 237, 121, 55),
    _reduce("ReduceMax", "reduce_max", 236, 124, 59, "; the readonly paged attention's log-sum-exp"),
    _reduce("ReduceSum", "reduce_sum", 225, 113, 56, "; the readonly paged attention's log-sum-exp; float16: the "
            "plain MoE's combine of the experts (passes/ascend/moe.py plain_moe)", ((F32, I64), (F16, I64))),
    Row("", "Reshape", (8, 18), "Reshape", at(MATH, "conversion/reshape/framework/reshape_onnx_plugin.cpp", 41),
        (Attr("allowzero", "INT", at(MATH, "conversion/reshape/framework/reshape_onnx_plugin.cpp", 20)),),
        ((F32, I64), (F16, I64), (I64, I64)), at(MATH, "conversion/reshape/op_graph/reshape_proto.h", 44),
        "x: TensorType::ALL(); shape: int32 or int64 (line 45)"),
    Row("", "Shape", (8, 18), "Shape", at(MATH, "math/shape/framework/shape_onnx_plugin.cpp", 38), (),
        ((F32,), (F16,), (I64,), (B,)), at(MATH, "math/shape/op_graph/shape_proto.h", 39),
        "the plugin sets dtype int64 (line 21); start/end attributes are not read, and we never emit them"),
    _plain("Sigmoid", "Sigmoid", 607, ((F32,), (F16,)), at(NN, "activation/sigmoid/op_graph/sigmoid_proto.h", 35),
           f"UnaryDataType() ({_UNARY})"),
    _plain("Sin", "Sin", 609, ((F32,),), at(MATH, "math/sin/op_graph/sin_proto.h", 37), f"UnaryDataType() ({_UNARY})"),
    Row("", "Slice", (10, 18), "StridedSliceV2",
        at(MATH, "conversion/strided_slice_v2/framework/slice_onnx_plugin.cpp", 131), (),
        ((F32, I64, I64, I64, I64), (F16, I64, I64, I64, I64), (I64, I64, I64), (I64, I64, I64, I64),
         (I64, I64, I64, I64, I64)),
        at(MATH, "conversion/strided_slice_v2/op_graph/strided_slice_v2_proto.h", 64),
        "begin/end/axes/strides: IndexNumberType (lines 65-68)"),
    Row("", "Softmax", (13, 18), "SoftmaxV2", at(NN, "activation/softmax_v2/framework/softmax_onnx_plugin.cpp", 75),
        (Attr("axis", "INT", at(NN, "activation/softmax_v2/framework/softmax_onnx_plugin.cpp", 23)),),
        ((F32,),), at(NN, "activation/softmax_v2/op_graph/softmax_v2_proto.h", 53)),
    Row("", "Split", (8, 18), "PartitionedCall → SplitV / Split",
        at(MATH, "conversion/split_d/framework/split_onnx_plugin.cpp", 214),
        (Attr("axis", "INT", at(MATH, "conversion/split_d/framework/split_onnx_plugin.cpp", 32)),
         Attr("num_outputs", "INT", at(MATH, "conversion/split_d/framework/split_onnx_plugin.cpp", 39))),
        ((F32, I64), (F16, I64), (F32,), (F16,)), at(MATH, "conversion/split_v/op_graph/split_v_proto.h", 49),
        "axis and num_outputs are read with attr.i() (no type check); with a `split` input the subgraph is SplitV "
        "(line 188; size_splits IndexNumberType, split_v_proto.h:53), without it Split / SplitV from num_outputs "
        "(lines 127, 151; split_proto.h:45 lists FLOAT and FLOAT16)"),
    Row("", "Squeeze", (13, 18), "SqueezeV3", at(MATH, "conversion/squeeze/framework/squeeze_onnx_plugin.cpp", 65), (),
        ((F32, I64), (F16, I64), (I64, I64)), at(MATH, "conversion/squeezev3/op_graph/squeezev3_proto.h", 40),
        "axes as input 1 (opset ≥ 13): DT_INT64 only (line 41)"),
    Row("", "Transpose", (8, 18), "PartitionedCall → Transpose",
        at(MATH, "conversion/transpose/framework/transpose_onnx_plugin.cpp", 91),
        (Attr("perm", "INTS", at(MATH, "conversion/transpose/framework/transpose_onnx_plugin.cpp", 30)),),
        ((F32,), (F16,)), at(MATH, "conversion/transpose/op_graph/transpose_proto.h", 42),
        "perm is read with attr.ints() (line 30): required (line 61)"),
    Row("", "Unsqueeze", (13, 18), "UnsqueezeV3",
        at(MATH, "conversion/unsqueeze/framework/unsequeeze_onnx_plugin.cpp", 71), (),
        ((F32, I64), (F16, I64), (I64, I64), (B, I64)),
        at(MATH, "conversion/unsqueezev3/op_graph/unsqueezev3_proto.h", 39),
        "axes as input 1 (opset ≥ 13): DT_INT64 only (line 40)"),
    _plain("Where", "SelectV2", 616, ((B, F32, F32), (B, F16, F16)),
           at(MATH, "math/select_v2/op_graph/select_v2_proto.h", 44)),
    Row("", "NPUWeightQuantBatchMatmulV2", (11, 19), "WeightQuantBatchMatmulV2",
        at(NN, "matmul/weight_quant_batch_matmul_v2/framework/npu_weight_quant_batchmatmul_v2_onnx_plugin.cpp", 59),
        (Attr("antiquant_group_size", "INT",
              at(NN, "matmul/weight_quant_batch_matmul_v2/framework/npu_weight_quant_batchmatmul_v2_onnx_plugin.cpp",
                 32)),),
        ((F16, I8, F16),),
        at(NN, "matmul/weight_quant_batch_matmul_v2/op_graph/weight_quant_batch_matmul_v2_proto.h", 105),
        "x float16 (line 105), weight int8 (106), antiquant_scale float16 (107); the plugin forces transpose_x / "
        "transpose_weight false (lines 42-43)"),
    Row("", "OmRmsNorm", (11, 18), "RmsNorm", _PLUGIN,
        (_our_attr("epsilon", "FLOAT"),),
        ((F32, F32), (F16, F16)), at(NN, "norm/rms_norm/op_graph/rms_norm_proto.h", 41),
        "our plugin (compile/ascend/atc_plugins.py:44), registered for the graph's own key "
        "ai.onnx::<opset>::OmRmsNorm; GetFloat reads the Pb2Json `f` field, i.e. a FLOAT attribute. GE RmsNorm is "
        "declared at rms_norm_proto.h:40; rstd is float32 (line 44). [unverified] compiled only against stub headers"),
    Row("", "OmAddRmsNorm", (11, 18), "AddRmsNorm", _PLUGIN,
        (_our_attr("epsilon", "FLOAT"),),
        ((F32, F32, F32), (F16, F16, F16)), at(NN, "norm/add_rms_norm/op_graph/add_rms_norm_proto.h", 45),
        "our plugin (compile/ascend/atc_plugins.py:48); GE AddRmsNorm declared at add_rms_norm_proto.h:44. "
        "[unverified] compiled only against stub headers"),
    Row("", "SwiGlu", (11, 18), "SwiGlu", _PLUGIN,
        (_our_attr("dim"),),
        ((F32,), (F16,)), at(NN, "activation/swi_glu/op_graph/swi_glu_proto.h", 44),
        "our plugin (compile/ascend/atc_plugins.py:53); GE SwiGlu declared at swi_glu_proto.h:41 (attr dim, line 45). "
        "[unverified] compiled only against stub headers"),
    Row("", "OmRotaryPositionEmbedding", (11, 18), "RotaryPositionEmbedding",
        _PLUGIN,
        (_our_attr("mode"),),
        ((F32, F32, F32), (F16, F16, F16)),
        at(TRANSFORMER, "posembedding/rotary_position_embedding/op_graph/rotary_position_embedding_proto.h", 54),
        "our plugin (compile/ascend/atc_plugins.py PLUGINS): CANN's NPURotaryPositionEmbedding plugin is in "
        "third-party mirrors only (issue 60). Kernel: ascend910b / ascend910_93 only (passes/ascend/kernels.py). "
        "[unverified] compiled only against stub headers"),
    Row("", "OmScatterPaKvCache", (11, 18), "ScatterPaKvCache",
        _PLUGIN,
        (_our_attr("cache_mode", "STRING"),),
        ((F16, F16, "INT32", F16, F16),),
        at(TRANSFORMER_MIRROR, "attention/scatter_pa_kv_cache/op_host/scatter_pa_kv_cache_def.cpp", 20),
        "inputs key, key_cache, slot_mapping, value, value_cache (IR 0-4); 910B/910_93 combinations key float16 + "
        "slot int32 (def.cpp:20-23, 202-210 in libochao-huawei/ops-transformer 5778144; the yuanfang-chen mirror's "
        "proto lists the same inputs); slots unique and in range (proto constraint text). Kernel: ascend910b / "
        "ascend910_93 only (def.cpp:331-332). [unverified] compiled only against stub headers"),
    Row("", "OmFusedInferAttentionScore", (11, 18), "FusedInferAttentionScore",
        _PLUGIN,
        tuple(_our_attr(n, f)
              for n, f in (("block_size", "INT"), ("inner_precise", "INT"), ("input_layout", "STRING"),
                           ("num_heads", "INT"), ("num_key_value_heads", "INT"), ("scale", "FLOAT"),
                           ("sparse_mode", "INT"))),
        ((F16, F16, F16, "", B, I64, I64, *[""] * 7, "INT32"),),
        at(TRANSFORMER, "attention/fused_infer_attention_score/op_host/fused_infer_attention_score_def.cpp", 27),
        "every input at its IR index (pse_shift and quant inputs empty); atten_mask bool (proto), lengths int64 "
        "(def.cpp:137-146), block_table int32 (def.cpp:282); query float16/bfloat16 (def.cpp:27-48). Kernel: "
        "ascend910b / ascend910_93 only (def.cpp:570-571): a 310B or 310P bundle must not hold it. [unverified] "
        "compiled only against stub headers; the dynamic key/value inputs mapped by position"),
    Row("", "OmMoeGatingTopKSoftmax", (11, 18), "MoeGatingTopKSoftmax",
        _PLUGIN,
        (_our_attr("k"),),
        ((F32,), (F16,)),
        at(TRANSFORMER, "moe/moe_gating_top_k_softmax/op_graph/moe_gating_top_k_softmax_proto.h", 38),
        "the MoE chain (passes/ascend/moe.py): x = the router logits [T, E], the optional `finished` (line 39) "
        "omitted; outputs y (x's dtype), expert_idx and row_idx int32 (lines 40-42); k a required Int (line 43). "
        "CANN's own plugin for NPUMoeGatingTopKSoftmax is in a 2026 mirror only (libochao-huawei/ops-transformer "
        "5778144 moe/moe_gating_top_k_softmax/framework/npu_moe_gating_top_k_softmax_onnx_plugin.cpp:29, 41-51, "
        "added 2025-12-31 in 70c7cdd): ours carries the key. Kernel: ascend910b / ascend910_93 (def.cpp:51-52). "
        "[unverified] compiled only against stub headers"),
    Row("", "OmMoeInitRouting", (11, 18), "MoeInitRouting",
        _PLUGIN,
        (_our_attr("active_num"),),
        ((F32, "INT32", "INT32"), (F16, "INT32", "INT32")),
        at(TRANSFORMER, "moe/moe_init_routing/op_graph/moe_init_routing_proto.h", 46),
        "inputs x (\"T1\", line 40: DATATYPE line 46), row_idx and expert_idx (\"T2\" = DT_INT32, lines 41-42, 47); "
        "active_num a required Int (line 48), 2^31 - 1 here: expanded_x keeps min(T, active_num)·k rows "
        "(op_host/moe_init_routing_infershape.cpp:197). CANN's NPUMoeInitRouting plugin: the 2026 mirror only "
        "(npu_moe_init_routing_onnx_plugin.cpp:30, 45-55). Kernel: ascend910b / ascend910_93 (def.cpp:63-64). "
        "[unverified] compiled only against stub headers"),
    Row("", "OmMoeComputeExpertTokens", (11, 18), "MoeComputeExpertTokens",
        _PLUGIN,
        (_our_attr("num_experts"),),
        (("INT32",),), at(TRANSFORMER, "moe/moe_compute_expert_tokens/op_graph/moe_compute_expert_tokens_proto.h", 35),
        "sorted_experts (MoeInitRouting's expanded_expert_idx) and the output int32 (\"T\", lines 32-35); "
        "num_experts a required Int (line 34). CANN's plugin: the 2026 mirror only "
        "(npu_moe_compute_expert_tokens_onnx_plugin.cpp:26, 43-53). Kernel: ascend910b / ascend910_93 "
        "(def.cpp:45-46). [unverified] compiled only against stub headers"),
    Row("", "OmGroupedMatmul", (11, 18), "GroupedMatmul",
        _PLUGIN,
        tuple(_our_attr(n)
              for n in ("group_list_type", "group_type", "split_item")),
        ((F32, F32, "", "", "", "", "", I64), (F16, F16, "", "", "", "", "", I64)),
        at(TRANSFORMER, "gmm/grouped_matmul/op_host/grouped_matmul_def.cpp", 24),
        "every input at its IR index: x 0 and weight 1 (DYNAMIC, one tensor each: [T·k, K] and [E, K, N]), bias, "
        "scale, offset, antiquant_scale, antiquant_offset empty, group_list 7 int64 (def.cpp:22-112); the 910B/910_93 "
        "combinations (x, weight, y) = (FLOAT16 ×3) at column 1 and (FLOAT ×3) at column 6 of def.cpp:24-40, 131; "
        "split_item 2 (one y), group_type 0 (grouped along M), group_list_type 0 (cumulative) (def.cpp:141-152; "
        "vllm-ascend 936c1021 vllm_ascend/ops/fused_moe.py:782-801 calls it so). No ONNX plugin exists in any source "
        "read. Kernel: ascend910b / ascend910_93 (def.cpp:167-168); 310P float16 with FRACTAL_NZ weights only "
        "(170-222). [unverified] compiled only against stub headers; the dynamic inputs mapped by position, as "
        "OmFusedInferAttentionScore's"),
    Row("", "OmMoeFinalizeRoutingV2", (11, 18), "MoeFinalizeRoutingV2",
        _PLUGIN,
        (_our_attr("drop_pad_mode"),),
        ((F32, "INT32", "", "", "", F32), (F16, "INT32", "", "", "", F16)),
        at(TRANSFORMER, "moe/moe_finalize_routing_v2/op_graph/moe_finalize_routing_v2_proto.h", 53),
        "every input at its IR index: expanded_x 0, expanded_row_idx 1 int32 (line 54), x1, x2, bias empty "
        "(optional, lines 55-57), scales 5 (expanded_x's dtype, line 58), expert_idx omitted (needed with a bias "
        "only, line 42-43); drop_pad_mode 0 (dropless, column order, lines 47-50; line 61). CANN's "
        "NPUMoeFinalizeRoutingV2 plugin: the 2026 mirror only (npu_moe_finalize_routing_v2_onnx_plugin.cpp:25, 34-44). "
        "Kernel: ascend910b / ascend910_93 (def.cpp:82-83). [unverified] compiled only against stub headers"),
    Row("", "OmFusedInferAttentionScoreLse", (11, 18), "FusedInferAttentionScore",
        _PLUGIN,
        tuple(_our_attr(n, f)
              for n, f in (("block_size", "INT"), ("inner_precise", "INT"), ("input_layout", "STRING"),
                           ("num_heads", "INT"), ("num_key_value_heads", "INT"), ("scale", "FLOAT"),
                           ("softmax_lse_flag", "INT"), ("sparse_mode", "INT"))),
        ((F16, F16, F16, "", "", I64, I64, *[""] * 7, "INT32"),),
        at(TRANSFORMER, "attention/fused_infer_attention_score/op_host/fused_infer_attention_score_def.cpp", 27),
        "the readonly paged attention's FIA (passes/ascend/readonly.py): as OmFusedInferAttentionScore without the "
        "mask (sparse_mode 0), plus softmax_lse_flag (a GE Bool, def.cpp:555: our plugin sets it from the ONNX int) "
        "and the second output softmax_lse float32 (def.cpp:544). Kernel: ascend910b / ascend910_93 only "
        "(def.cpp:570-571). [unverified] compiled only against stub headers"),
)
"""Every row (see the module docstring); the FAKE atc refuses a graph with a use none of them covers."""


SQRT_AT = at(MATH, "math/sqrt/op_graph/sqrt_proto.h", 35)
"""Why ``Sqrt`` has no row: its prototype's ``TensorType{(…, DT_COMPLEX128)}`` compiles to complex128 only (the
ascend lowering writes ``Pow(·, 0.5)`` instead, passes/ascend/lower.py ``plain_rms_norm``)."""


def listed_dtypes(cite: Cite) -> tuple[str, ...] | None:
    """The ONNX dtypes the prototype line at ``cite`` compiles to (:mod:`.proto_types` over its verbatim text in
    :data:`.prototypes.LISTED`); None when the line names a set the reader does not resolve or is not transcribed."""
    text = LISTED.get(str(cite))
    return None if text is None else onnx_types(text)


def listing_gaps(row: Row) -> list[str]:
    """The first-input dtypes of ``row``'s signatures that its cited prototype line does not compile to (empty when
    they all are, or when the line is a named set or not transcribed)."""
    listed = listed_dtypes(row.dtypes_at)
    if listed is None:
        return []
    return [f"{row.op_type}: input 0 {sig[0]} is not among what {row.dtypes_at} compiles to ({', '.join(listed)})"
            for sig in row.dtypes if sig and sig[0] and sig[0] not in listed]


_NOT_KERNELS = frozenset({"PartitionedCall", "Const", "FileConstant", "TensorMove"})


def ge_ops(row: Row) -> tuple[str, ...]:
    """The GE op types ``row``'s ONNX op can become (its ``ge_type`` text: ``A``, ``PartitionedCall → A + B``,
    ``A | B``), less the plumbing (PartitionedCall, Const, FileConstant, TensorMove)."""
    names = re.findall(r"[A-Za-z_][A-Za-z0-9_]*", row.ge_type)
    return tuple(n for n in dict.fromkeys(names) if n not in _NOT_KERNELS)


def row_for(use: Use) -> Row | None:
    """The row of ``use``'s op type and opset, or None."""
    return next((r for r in ROWS if r.matches(use)), None)


def violations(uses: Iterable[Use]) -> list[str]:
    """One line per use the matrix lacks: its key with no row, or the attribute forms / dtypes its row lacks."""
    out = []
    for use in sorted(set(uses)):
        row = row_for(use)
        if row is None:
            out.append(f"{use.key}: no row (no CANN source checked for this op type at this opset)")
            continue
        gaps = row.gaps(use)
        if gaps:
            out.append(f"{use.key}: {'; '.join(gaps)} not in its row")
    return out


def rows_for(uses: Iterable[Use]) -> list[Row]:
    """The rows ``uses`` rely on, in matrix order (uses without a row are left out: see :func:`violations`)."""
    used = {row_for(u) for u in uses}
    return [r for r in ROWS if r in used]


def bundle_rows(bundle: Path) -> tuple[list[Row], list[str]]:
    """The rows an ascend bundle's step graph (``ascend/step.onnx``, read without weights) relies on, and its
    violations: what ``omforge inspect`` prints."""
    uses = file_uses(Path(bundle) / "ascend" / "step.onnx")
    return rows_for(uses), violations(uses)
