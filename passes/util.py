"""Small helpers shared by the passes: reading constants off onnx-ir values."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir


def const_array(value: ir.Value | None) -> np.ndarray | None:
    """The constant behind ``value`` (initializer or Constant node output) as numpy, else None."""
    if value is None:
        return None
    if value.const_value is None:
        producer = value.producer()
        if producer is None or producer.op_type != "Constant" or producer.domain not in ("", "ai.onnx"):
            return None
        attr = producer.attributes.get("value")
        if attr is None:
            return None
        return np.asarray(attr.value.numpy())
    return np.asarray(value.const_value.numpy())


def const_shape(value: ir.Value | None) -> tuple[int, ...] | None:
    """The shape of the initializer behind ``value`` without reading its data (None if it is not one)."""
    if value is None or value.const_value is None:
        return None
    return tuple(int(d) for d in value.const_value.shape)


def read_weight(tensor: ir.TensorProtocol) -> np.ndarray:
    """A weight's array; from external data, read into a private array (no memory map is left behind): a pass
    that reads a model's weights one by one holds one at a time, never the mapped file."""
    dtype = tensor.dtype.numpy()
    if isinstance(tensor, ir.ExternalTensor) and tensor.dtype.bitwidth % 8 == 0 and tensor.size > 0:
        count = tensor.size
        array = np.fromfile(tensor.path, dtype=dtype.newbyteorder("<"), count=count, offset=tensor.offset or 0)
        return array.astype(dtype, copy=False).reshape(tensor.shape.numpy())
    return tensor.numpy()


def concat_lazy(values: list[ir.Value], axis: int, name: str) -> ir.Value:
    """The initializer ``name``: ``values``' constants concatenated along ``axis``, computed when it is read
    (saved, quantized) rather than now, so merging every layer's weights holds no merged copy in memory."""
    tensors = [v.const_value for v in values]
    shapes = [tuple(int(d) for d in t.shape) for t in tensors]
    shape = list(shapes[0])
    shape[axis] = sum(s[axis] for s in shapes)

    def merged() -> ir.Tensor:
        return ir.tensor(np.concatenate([read_weight(t) for t in tensors], axis=axis), name=name)

    lazy = ir.LazyTensor(merged, dtype=tensors[0].dtype, shape=ir.Shape(shape), name=name)
    return ir.Value(name=name, shape=ir.Shape(shape), type=ir.TensorType(tensors[0].dtype), const_value=lazy)


def weight_matmuls(graph: ir.Graph) -> list[ir.Node]:
    """The graph's standard-domain MatMul nodes (a snapshot: a pass may replace them while it walks)."""
    return [n for n in graph if n.op_type == "MatMul" and n.domain in ("", "ai.onnx")]


def drop_unused_initializers(graph: ir.Graph) -> None:
    """Remove initializers nothing reads any more (the float weights a quantizing pass replaced)."""
    for name, value in list(graph.initializers.items()):
        if not value.uses() and not value.is_graph_output():
            del graph.initializers[name]


def const_scalar(value: ir.Value | None) -> float | None:
    """A constant of exactly one element as a Python float, else None."""
    arr = const_array(value)
    if arr is None or arr.size != 1:
        return None
    return float(arr.reshape(()))


def dims_agree(a: ir.Shape, b: ir.Shape, axes: tuple[int, ...] | None = None) -> bool:
    """Equal rank, and equal dims (on ``axes``, default all) wherever both are known: a static size, or a
    symbolic one with a name (one name is one size)."""
    if a.rank() != b.rank():
        return False

    def known(d: int | ir.SymbolicDim) -> bool:
        return isinstance(d, int) or d.value is not None

    return all(a[i] == b[i] for i in (range(a.rank()) if axes is None else axes) if known(a[i]) and known(b[i]))
