"""The ``TensorType`` expression of each prototype line the CANN matrix cites for its input dtypes
(:attr:`omforge.compile.ascend.cann_matrix.Row.dtypes_at`, first input), copied verbatim from the sources at the
commits of ``cann_matrix.REPOSITORIES`` (whitespace folded), so :mod:`.proto_types` can read what each compiles to.
Keyed by the cite's text ``<repo> <path>:<line>``. Regenerate by reading those lines again; never by hand-typing a
list: hicann/ops-math ``math/sqrt/op_graph/sqrt_proto.h:35`` shows why (a comma expression, complex128 only).
"""

LISTED: dict[str, str] = {
    "hicann/ops-math math/add/op_graph/add_proto.h:37":
        "TensorType( {DT_BOOL, DT_FLOAT, DT_INT32, DT_INT64, DT_FLOAT16, DT_BF16, DT_INT16, DT_INT8, "
        "DT_UINT8, DT_DOUBLE, DT_COMPLEX128, DT_COMPLEX64, DT_STRING, DT_COMPLEX32})",
    "hicann/ops-math math/cast/op_graph/cast_proto.h:53":
        "TensorType({DT_BOOL, DT_FLOAT16, DT_FLOAT, DT_INT8, DT_INT32, DT_UINT32, DT_UINT8, DT_INT64, "
        "DT_UINT64, DT_INT16, DT_UINT16, DT_DOUBLE, DT_COMPLEX64, DT_COMPLEX128, DT_QINT8, DT_QUINT8, "
        "DT_QINT16, DT_QUINT16, DT_QINT32, DT_BF16, DT_UINT1, DT_COMPLEX32, DT_HIFLOAT8, DT_FLOAT8_E5M2, "
        "DT_FLOAT8_E4M3FN, DT_FLOAT4_E1M2, DT_FLOAT4_E2M1})",
    "hicann/ops-math conversion/concat_d/op_graph/concat_d_proto.h:50":
        "TensorType({DT_BF16, DT_FLOAT, DT_FLOAT16, DT_INT8, DT_INT16, DT_BOOL, DT_INT32, DT_INT64, "
        "DT_UINT8, DT_UINT16, DT_UINT32, DT_UINT64, DT_DOUBLE, DT_COMPLEX64, DT_FLOAT8_E4M3FN, "
        "DT_FLOAT8_E5M2, DT_HIFLOAT8, DT_FLOAT8_E8M0, DT_FLOAT4_E1M2, DT_FLOAT4_E2M1})",
    "hicann/ops-math math/cos/op_graph/cos_proto.h:39":
        "TensorType::UnaryDataType()",
    "hicann/ops-math math/expand/op_graph/expand_proto.h:44":
        "TensorType({DT_FLOAT16, DT_FLOAT, DT_INT32,DT_INT64, DT_INT8, DT_UINT8, DT_BOOL, DT_BF16})",
    "hicann/ops-math math/logical_and/op_graph/logical_and_proto.h:42":
        "TensorType({DT_BOOL})",
    "hicann/ops-math math/logical_or/op_graph/logical_or_proto.h:42":
        "TensorType({DT_BOOL, DT_INT8, DT_UINT8, DT_INT16, DT_INT32, DT_INT64, DT_FLOAT16, DT_BF16, "
        "DT_FLOAT})",
    "hicann/ops-math math/equal/op_graph/equal_proto.h:40":
        "TensorType( {DT_FLOAT, DT_BF16, DT_FLOAT16, DT_INT32, DT_INT8, DT_UINT8, DT_DOUBLE, DT_INT16, "
        "DT_INT64, DT_COMPLEX64, DT_COMPLEX128, DT_QUINT8, DT_QINT8, DT_QINT32, DT_STRING, DT_BOOL})",
    "hicann/ops-math math/greater_equal/op_graph/greater_equal_proto.h:36":
        "TensorType::RealNumberType()",
    "hicann/ops-nn index/gather_v2/op_graph/gather_v2_proto.h:62":
        "TensorType({DT_COMPLEX128, DT_COMPLEX64, DT_DOUBLE, DT_FLOAT, DT_FLOAT16, DT_INT16, DT_INT32, "
        "DT_INT64, DT_INT8, DT_QINT16, DT_QINT32, DT_QINT8, DT_QUINT16, DT_QUINT8, DT_UINT16, DT_UINT32, "
        "DT_UINT64, DT_UINT8, DT_BOOL, DT_STRING, DT_BF16, DT_FLOAT8_E5M2, DT_FLOAT8_E8M0, DT_FLOAT8_E4M3FN})",
    "hicann/ops-math math/greater/op_graph/greater_proto.h:40":
        "TensorType::RealNumberType()",
    "hicann/ops-nn common/inc/op_graph/op_nn_proto_extend.h:727":
        "TensorType({DT_FLOAT, DT_FLOAT16, DT_INT32, DT_INT8, DT_INT4, DT_BF16, DT_HIFLOAT8})",
    "hicann/ops-math math/mul/op_graph/mul_proto.h:49":
        "TensorType({DT_BOOL, DT_FLOAT16, DT_FLOAT, DT_DOUBLE, DT_UINT8, DT_INT8, DT_UINT16, DT_INT16, "
        "DT_INT32, DT_INT64, DT_BF16, DT_COMPLEX64, DT_COMPLEX128, DT_COMPLEX32})",
    "hicann/ops-math math/neg/op_graph/neg_proto.h:38":
        "TensorType( {DT_BF16, DT_FLOAT16, DT_FLOAT, DT_DOUBLE, DT_INT8, DT_INT32, DT_INT64, DT_COMPLEX64, "
        "DT_COMPLEX128})",
    "hicann/ops-math math/pow/op_graph/pow_proto.h:42":
        "TensorType({DT_BF16, DT_FLOAT16, DT_FLOAT, DT_INT32, DT_INT64, DT_INT8, DT_INT16, DT_UINT8, "
        "DT_DOUBLE, DT_COMPLEX64, DT_COMPLEX128})",
    "hicann/ops-math math/range/op_graph/range_proto.h:56":
        "TensorType({DT_FLOAT16, DT_FLOAT, DT_INT32, DT_DOUBLE, DT_INT64, DT_BF16})",
    "hicann/ops-math math/reciprocal/op_graph/reciprocal_proto.h:38":
        "TensorType({DT_FLOAT, DT_DOUBLE, DT_FLOAT16, DT_COMPLEX64, DT_COMPLEX128, DT_BF16})",
    "hicann/ops-math math/reduce_mean/op_graph/reduce_mean_proto.h:55":
        "TensorType::NumberType()",
    "hicann/ops-math conversion/reshape/op_graph/reshape_proto.h:44":
        "TensorType::ALL()",
    "hicann/ops-math math/shape/op_graph/shape_proto.h:39":
        "TensorType::ALL()",
    "hicann/ops-nn activation/sigmoid/op_graph/sigmoid_proto.h:35":
        "TensorType::UnaryDataType()",
    "hicann/ops-math math/sin/op_graph/sin_proto.h:37":
        "TensorType::UnaryDataType()",
    "hicann/ops-math conversion/strided_slice_v2/op_graph/strided_slice_v2_proto.h:64":
        "TensorType({BasicType(), DT_BOOL, DT_HIFLOAT8, DT_FLOAT8_E5M2, DT_FLOAT8_E4M3FN, DT_FLOAT8_E8M0})",
    "hicann/ops-nn activation/softmax_v2/op_graph/softmax_v2_proto.h:53":
        "TensorType({DT_DOUBLE, DT_FLOAT16, DT_BF16, DT_FLOAT})",
    "hicann/ops-math conversion/split_v/op_graph/split_v_proto.h:49":
        "TensorType({DT_COMPLEX128, DT_COMPLEX64, DT_DOUBLE, DT_FLOAT, DT_FLOAT16, DT_INT16, DT_INT32, "
        "DT_INT64, DT_INT8, DT_QINT16, DT_QINT32, DT_QINT8, DT_QUINT16, DT_QUINT8, DT_UINT16, DT_UINT32, "
        "DT_UINT64, DT_UINT8, DT_BF16, DT_BOOL, DT_STRING})",
    "hicann/ops-math conversion/squeezev3/op_graph/squeezev3_proto.h:40":
        "TensorType::ALL()",
    "hicann/ops-math conversion/transpose/op_graph/transpose_proto.h:42":
        "TensorType({DT_BF16, DT_FLOAT16, DT_FLOAT, DT_DOUBLE, DT_INT64, DT_INT32, DT_UINT8, DT_UINT16, "
        "DT_UINT32, DT_UINT64, DT_INT8, DT_INT16, DT_COMPLEX32, DT_COMPLEX64, DT_COMPLEX128, DT_QINT8, "
        "DT_QUINT8, DT_QINT16, DT_QUINT16, DT_QINT32, DT_BOOL, DT_HIFLOAT8, DT_FLOAT8_E5M2, "
        "DT_FLOAT8_E4M3FN})",
    "hicann/ops-math conversion/unsqueezev3/op_graph/unsqueezev3_proto.h:39":
        "TensorType::ALL()",
    "hicann/ops-math math/select_v2/op_graph/select_v2_proto.h:44":
        "TensorType({DT_BOOL})",
    "hicann/ops-nn matmul/weight_quant_batch_matmul_v2/op_graph/weight_quant_batch_matmul_v2_proto.h:105":
        "TensorType({DT_FLOAT16, DT_BF16})",
    "hicann/ops-nn norm/rms_norm/op_graph/rms_norm_proto.h:41":
        "TensorType({DT_FLOAT, DT_FLOAT16, DT_BF16})",
    "hicann/ops-nn norm/add_rms_norm/op_graph/add_rms_norm_proto.h:45":
        "TensorType({DT_FLOAT, DT_FLOAT16, DT_BF16})",
    "hicann/ops-nn activation/swi_glu/op_graph/swi_glu_proto.h:44":
        "TensorType({DT_BF16, DT_FLOAT16, DT_FLOAT})",
    "hicann/ops-transformer posembedding/rotary_position_embedding/op_graph/rotary_position_embedding_proto.h:54":
        "TensorType({DT_FLOAT16, DT_FLOAT, DT_BFLOAT16})",
    "hicann/ops-transformer moe/moe_gating_top_k_softmax/op_graph/moe_gating_top_k_softmax_proto.h:38":
        "TensorType({DT_FLOAT, DT_FLOAT16, DT_BF16})",
    "hicann/ops-transformer moe/moe_init_routing/op_graph/moe_init_routing_proto.h:46":
        "TensorType({DT_FLOAT, DT_FLOAT16, DT_BF16})",
    "hicann/ops-transformer moe/moe_compute_expert_tokens/op_graph/moe_compute_expert_tokens_proto.h:35":
        "TensorType({DT_INT32})",
    "hicann/ops-transformer moe/moe_finalize_routing_v2/op_graph/moe_finalize_routing_v2_proto.h:53":
        "TensorType({DT_FLOAT, DT_FLOAT16, DT_BF16})",
    "hicann/ops-math math/sqrt/op_graph/sqrt_proto.h:35":
        "TensorType{(DT_BF16, DT_FLOAT, DT_FLOAT16, DT_DOUBLE, DT_COMPLEX64, DT_COMPLEX128)}",
}
