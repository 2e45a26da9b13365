"""The CANN matrix's input dtypes are read from what each prototype line compiles to (issue 60 item 6), not from
its text: ``TensorType{(A, B, C)}`` is one type, C (the comma operator). hicann/ops-math c419332
``math/sqrt/op_graph/sqrt_proto.h:35`` is ``TensorType{(DT_BF16, DT_FLOAT, DT_FLOAT16, DT_DOUBLE, DT_COMPLEX64,
DT_COMPLEX128)}``: Sqrt takes complex128 only, so the ascend graphs hold no Sqrt and a float Sqrt is refused."""

from __future__ import annotations

from dataclasses import replace

import pytest
from onnx import TensorProto, helper

from omforge.compile.ascend import cann_matrix
from omforge.compile.ascend.proto_types import compiled_types, onnx_types, text_types
from omforge.compile.ascend.prototypes import LISTED
from omforge.compile.ascend.step_usage import Use, uses

SQRT = LISTED[str(cann_matrix.SQRT_AT)]


@pytest.mark.parametrize(("expr", "types"), [
    ("TensorType{(DT_BF16, DT_FLOAT, DT_COMPLEX128)}", ("DT_COMPLEX128",)),  # one value: the comma expression
    ("TensorType({DT_BF16, DT_FLOAT})", ("DT_BF16", "DT_FLOAT")),  # an initializer list
    ("TensorType{DT_FLOAT, DT_INT8}", ("DT_FLOAT", "DT_INT8")),  # list-initialization
    ("TensorType( {DT_BOOL, DT_INT64})", ("DT_BOOL", "DT_INT64")),
    ("TensorType(DT_INT64)", ("DT_INT64",)),
    ("TensorType({(DT_INT32, DT_INT64), DT_BOOL})", ("DT_INT64", "DT_BOOL")),
    ("TensorType::ALL()", None), ("TensorType({BasicType(), DT_BOOL})", None),  # named sets: not resolved
])
def test_a_tensor_type_reads_as_cpp_compiles_it(expr: str, types: tuple[str, ...] | None) -> None:
    assert compiled_types(expr) == types


def test_the_sqrt_prototype_is_complex128_only_though_its_text_lists_float() -> None:
    assert SQRT.startswith("TensorType{(DT_BF16, DT_FLOAT,")  # the line as hicann/ops-math writes it
    assert "DT_FLOAT" in text_types(SQRT)  # the old reading
    assert onnx_types(SQRT) == ("COMPLEX128",)


def test_a_float_sqrt_row_fails_the_compiled_reading() -> None:
    """The Sqrt row as it was (float32 at sqrt_proto.h:35, right by the old reading) is caught; the matrix now has no
    Sqrt row, so the FAKE atc refuses a float Sqrt, and every row's input 0 is within its compiled prototype."""
    old = cann_matrix.Row("", "Sqrt", (8, 18), "Sqrt", cann_matrix.at(cann_matrix.MATH, cann_matrix._SIMILAR, 611),
                          (), (("FLOAT",),), cann_matrix.SQRT_AT)
    assert cann_matrix.listing_gaps(old) == [f"Sqrt: input 0 FLOAT is not among what {cann_matrix.SQRT_AT} compiles "
                                             "to (COMPLEX128)"]
    assert cann_matrix.listing_gaps(replace(old, dtypes=(("COMPLEX128",),))) == []
    graph = helper.make_graph([helper.make_node("Sqrt", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
    found = uses(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    assert Use("", "Sqrt", 18, (), ("FLOAT",)) in found
    assert cann_matrix.violations(found) == ["ai.onnx::18::Sqrt: no row (no CANN source checked for this op type at "
                                             "this opset)"]


def test_every_row_is_within_what_its_cited_prototype_compiles_to() -> None:
    assert [g for row in cann_matrix.ROWS for g in cann_matrix.listing_gaps(row)] == []
    transcribed = [r for r in cann_matrix.ROWS if str(r.dtypes_at) in LISTED]
    assert len(transcribed) >= 25  # every row citing a hicann ops prototype line has its text here
