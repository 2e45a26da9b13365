"""The MatMulNBits weight layout (passes/quant.py): GGUF Q4_0 / Q4_1 / Q8_0 blocks taken value for value,
round-to-nearest quantization within its error bound, rows stacked losslessly, and ONNX Runtime's MatMulNBits
computing exactly ``x @ dequantize(p).T`` (plus the affine ``block_min`` term) at accuracy level 0."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from omforge.passes import quant

RNG = np.random.default_rng(0)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_are_taken_value_for_value(kind: str) -> None:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    qtype = GGMLQuantizationType[kind]
    w = RNG.standard_normal((24, 96)).astype(np.float32)
    w[3, 32:64] = 0.5  # a constant block: Q4_1's d = 0, the block is all m
    blocks = quantize(w, qtype)
    p = quant.from_gguf(kind, blocks, 96)
    assert (p.bits, p.block, p.n, p.k) == (8 if kind == "Q8_0" else 4, 32, 24, 96)
    assert np.array_equal(quant.dequantize(p), dequantize(blocks, qtype))
    assert (p.block_min is not None) == (kind == "Q4_1")


@pytest.mark.parametrize(("bits", "symmetric"), [(4, True), (4, False), (8, True), (8, False)])
def test_round_to_nearest_within_half_a_step(bits: int, symmetric: bool) -> None:
    w = RNG.standard_normal((16, 100)).astype(np.float32) * np.linspace(0.1, 3, 100, dtype=np.float32)
    p = quant.quantize(w, bits, 32, symmetric)
    assert p.k_blocks == 4 and p.blocks.shape == (16, 4, 32 * bits // 8)  # K padded to whole blocks
    err = np.abs(quant.dequantize(p) - w).reshape(16, -1)
    step = np.repeat(p.scales.reshape(16, 4), 32, axis=1)[:, :100]
    assert (err <= step / 2 + 1e-6).all()


def test_rows_stack_losslessly() -> None:
    a = quant.quantize(RNG.standard_normal((8, 64)).astype(np.float32), 4, 32, True)
    b = quant.quantize(RNG.standard_normal((4, 64)).astype(np.float32), 4, 32, False)
    both = quant.concat_rows([a, b])
    assert np.array_equal(quant.dequantize(both), np.concatenate([quant.dequantize(a), quant.dequantize(b)]))
    with pytest.raises(ValueError, match="different bits"):
        quant.concat_rows([a, quant.quantize(np.ones((2, 64), np.float32), 8, 32)])


@pytest.mark.parametrize(("bits", "symmetric"), [(4, True), (4, False), (8, True)])
def test_ort_matmulnbits_computes_the_layout(bits: int, symmetric: bool) -> None:
    """The contract with ONNX Runtime: MatMulNBits (no zero-point input) + the block_min MatMul equal
    ``x @ dequantize(p).T`` to float32 rounding at accuracy level 0."""
    k, n = 96, 40
    p = quant.quantize(RNG.standard_normal((n, k)).astype(np.float32), bits, 32, symmetric)
    inits = [numpy_helper.from_array(p.blocks, "B"), numpy_helper.from_array(p.scales, "S")]
    nodes = [helper.make_node("MatMulNBits", ["x", "B", "S"], ["y0"], domain="com.microsoft", K=k, N=n, bits=bits,
                              block_size=32, accuracy_level=0)]
    if p.block_min is not None:
        member = np.zeros((k, p.k_blocks), np.float32)
        member[np.arange(k), np.arange(k) // 32] = 1
        inits += [numpy_helper.from_array(member, "M"), numpy_helper.from_array(p.block_min.T.copy(), "Bm")]
        nodes += [helper.make_node("MatMul", ["x", "M"], ["s"]), helper.make_node("MatMul", ["s", "Bm"], ["c"]),
                  helper.make_node("Add", ["y0", "c"], ["y"])]
    else:
        nodes.append(helper.make_node("Identity", ["y0"], ["y"]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, n])], inits)
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    x = RNG.standard_normal((5, k)).astype(np.float32)
    y = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    want = x.astype(np.float64) @ quant.dequantize(p).T.astype(np.float64)
    assert np.abs(y - want).max() <= 1e-5 * np.abs(want).max()


def test_chunked_rows_equal_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    w = RNG.standard_normal((70, 64)).astype(np.float32)
    whole = quant.quantize(w, 4, 32, symmetric=False)
    monkeypatch.setattr(quant, "ROWS_PER_CHUNK", 16)
    chunked = quant.quantize(w, 4, 32, symmetric=False)
    assert np.array_equal(chunked.blocks, whole.blocks) and np.array_equal(chunked.scales, whole.scales)
    assert np.array_equal(chunked.block_min, whole.block_min) and chunked.source == whole.source
