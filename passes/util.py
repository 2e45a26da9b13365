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
