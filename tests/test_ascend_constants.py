"""Issue 44 item 1: no ascend step graph carries a ``Constant`` in a form ATC's parser does not read.

CANN's ONNX constant parser reads only ``value`` (hicann/ge onnx_constant_parser.cc; reference/ascend.md §5.2): a
``value_int(s)`` / ``value_float(s)`` Constant becomes an empty tensor that nothing rejects. The large-model path
(onnxsim skipped above ``ONNXSIM_LIMIT`` bytes of weights, i.e. any Llama >= 1B) held 22 such nodes on the tiny
recipe before the fix, the onnxsim path 2.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from helpers import TINY_RECIPE
from omforge.cli import main
from omforge.compile.ascend import stages as ascend
from omforge.compile.ascend.atc_forms import constants_as_value, shape_slices_as_slice, short_form_constants


@pytest.mark.parametrize("weights", ["float32", "float16"])
@pytest.mark.parametrize("onnxsim", [True, False], ids=["onnxsim", "large-model-path"])
def test_ascend_step_graph_holds_only_value_constants(weights: str, onnxsim: bool, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMFORGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no atc: the bundle stops before the ATC step (exit 3)
    if not onnxsim:
        monkeypatch.setattr(ascend, "ONNXSIM_LIMIT", 0)  # as for a model whose weights pass ~1.94 GiB
    recipe = tmp_path / "r.yaml"
    recipe.write_text(TINY_RECIPE.read_text() + f"  target: ascend\n  weights: {weights}\n")
    assert main(["compile", str(recipe), "-o", str(tmp_path / "b")]) == 3
    step = onnx.load(str(tmp_path / "b" / "ascend" / "step.onnx"), load_external_data=False)
    assert short_form_constants(step.graph) == []
    assert not [n.name for n in step.graph.node if n.op_type == "Shape" and n.attribute]  # CANN reads no start/end
    if not onnxsim:  # the path that carried them: the Constants are still there, in the value form
        assert sum(n.op_type == "Constant" for n in step.graph.node) > 5


def test_rewrite_keeps_each_constant_exactly() -> None:
    """Every short form becomes the tensor ONNX defines for it: the graph computes the same thing on ORT."""
    consts = [helper.make_node("Constant", [], ["shape"], value_ints=[2, -1]),
              helper.make_node("Constant", [], ["scale"], value_float=0.125),
              helper.make_node("Constant", [], ["offs"], value_floats=[1.0, 2.0, 3.0]),
              helper.make_node("Constant", [], ["axis"], value_int=0)]
    body = [helper.make_node("Reshape", ["x", "shape"], ["r"]),
            helper.make_node("Mul", ["r", "scale"], ["m"]),
            helper.make_node("Add", ["m", "offs"], ["a"]),
            helper.make_node("Unsqueeze", ["a", "axis"], ["y"])]
    graph = helper.make_graph(consts + body, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    x = np.arange(6, dtype=np.float32)
    before = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]
    assert len(short_form_constants(model.graph)) == 4
    assert constants_as_value(model.graph) == 4 and short_form_constants(model.graph) == []
    onnx.checker.check_model(model, full_check=True)
    after = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]
    np.testing.assert_array_equal(before, after)
    assert after.shape == (1, 2, 3)


def test_sparse_constant_is_refused() -> None:
    sparse = helper.make_sparse_tensor(helper.make_tensor("v", TensorProto.FLOAT, [1], [1.0]),
                                       helper.make_tensor("i", TensorProto.INT64, [1], [0]), [4])
    node = helper.make_node("Constant", [], ["c"], sparse_value=sparse)
    graph = helper.make_graph([node], "g", [], [helper.make_tensor_value_info("c", TensorProto.FLOAT, [4])])
    with pytest.raises(ValueError, match="sparse_value.*only 'value'"):
        constants_as_value(graph)


def test_shape_with_start_and_end_becomes_shape_then_slice() -> None:
    """CANN's Shape plugin reads no attribute (ops-math shape_onnx_plugin.cpp): Shape(start, end) → Shape → Slice."""
    nodes = [helper.make_node("Shape", ["x"], ["s"], name="mid", start=1, end=2),
             helper.make_node("Shape", ["x"], ["t"], name="tail", start=-1),
             helper.make_node("Concat", ["s", "t"], ["y"], axis=0)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 5])],
                              [helper.make_tensor_value_info("y", TensorProto.INT64, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    x = np.zeros((2, 3, 5), np.float32)
    before = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]
    assert shape_slices_as_slice(model.graph) == 2 and constants_as_value(model.graph) == 0
    assert not [n for n in model.graph.node if n.op_type == "Shape" and n.attribute]
    onnx.checker.check_model(model, full_check=True)
    after = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]
    np.testing.assert_array_equal(before, after)
    assert after.tolist() == [3, 5]
