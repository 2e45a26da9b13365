"""W8A16 for the ascend target (``compile.weights: int8``): int8 weights, float16 activations.

CANN's weight-only quantized matmul is ``WeightQuantBatchMatmulV2`` (aclnnWeightQuantBatchMatmulV2; ONNX node
``NPUWeightQuantBatchMatmulV2``, a built-in plugin for ai.onnx 11–19, reference ascend.md §2.1–2.2):
``y = x @ ((weight + antiquant_offset) · antiquant_scale)`` with ``x`` float16 ``[m, k]`` (2-D), ``weight``
int8 ``[k, n]`` (ND), ``antiquant_scale`` float16 ``[⌈k / g⌉, n]`` per group (``antiquant_group_size`` g, a
multiple of 32 in [32, k − 1]) and ``k, n ≤ 65535`` on Atlas A2/A3 (ops-nn
``matmul/weight_quant_batch_matmul_v2/docs/aclnnWeightQuantBatchMatmulV2.md``). This pass, run on the float16
graph (:mod:`omforge.passes.float16`), quantizes each chosen MatMul weight symmetrically per group of
``group_size`` along k (round to nearest, no offset) and emits

  plugin (default): Reshape(x → [m, k]) → NPUWeightQuantBatchMatmulV2(x, weight, antiquant_scale, "", "", "",
                    ""; antiquant_group_size=g) → Reshape back;
  ``plain=True``:   the same numbers in standard ops — ``MatMul(x, Reshape(Cast(weight) · scale))`` — the graph
                    the tests' fake pyACL runs on ONNX Runtime.

A matrix with n or k above 65535 (Llama-3's 128256-row lm_head) stays float16 and the report says so.
Unverified on hardware: the plugin's input order and attribute are from the reference, not from a run.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx_ir as ir

from omforge.passes.quantize_weights import group_of, weight_source
from omforge.passes.util import drop_unused_initializers, read_weight, weight_matmuls

OP = "NPUWeightQuantBatchMatmulV2"
MAX_DIM = 65535


def quantize_kn(w_kn: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 per group along k: ``(codes int8 [k, n], scales float16 [⌈k/g⌉, n])`` with
    ``w ≈ codes · scales[i // g]``. The scale is computed in float32, then rounded to float16, and the codes
    are rounded against the float16 scale (what the kernel multiplies by)."""
    k, n = w_kn.shape
    groups = -(-k // group)
    pad = groups * group - k
    w = np.pad(w_kn, ((0, pad), (0, 0))) if pad else w_kn
    w = w.reshape(groups, group, n).astype(np.float32, copy=False)
    scales = (np.abs(w).max(axis=1) / 127.0).astype(np.float16)
    safe = np.where(scales == 0, np.float16(1), scales).astype(np.float32)
    codes = np.clip(np.rint(w / safe[:, None, :]), -127, 127).astype(np.int8)
    return codes.reshape(groups * group, n)[:k], scales


class QuantizeW8A16(ir.passes.InPlacePass):
    """``report``: per weight, bits / group / bytes, or why it stayed float16."""

    def __init__(self, group_size: int = 32, matrices: Sequence[str] = ("attention", "mlp", "lm_head"),
                 plain: bool = False, **_ignored: object):
        super().__init__()
        self.group, self.matrices, self.plain = group_size, set(matrices), plain
        self.report: dict[str, dict[str, object]] = {}

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        modified = False
        for node in weight_matmuls(graph):
            modified |= self._matmul(graph, node)
        drop_unused_initializers(graph)
        return ir.passes.PassResult(model, modified=modified)

    def _matmul(self, graph: ir.Graph, node: ir.Node) -> bool:
        x, w = node.inputs
        source, const, transposed = weight_source(w)
        if source is None or group_of(source) not in self.matrices:
            return False
        array = read_weight(const.const_value)
        w_kn = array if transposed else np.ascontiguousarray(array.T)
        k, n = w_kn.shape
        if k > MAX_DIM or n > MAX_DIM:
            self.report[source] = {"bits": 16, "why": f"[{k}, {n}]: WeightQuantBatchMatmulV2 takes k, n ≤ {MAX_DIM}"}
            return False
        codes, scales = quantize_kn(w_kn, self.group)
        self.report[source] = {"bits": 8, "group": self.group, "bytes": codes.nbytes + scales.nbytes}

        def init(name: str, arr: np.ndarray) -> ir.Value:
            value = graph.initializers.get(name)
            if value is None:
                value = ir.Value(name=name, const_value=ir.tensor(arr, name=name))
                graph.register_initializer(value)
            return value

        q, s = init(f"{source}.w8", codes), init(f"{source}.w8_scale", scales)
        out = node.outputs[0]
        new: list[ir.Node] = []

        def add(op: str, inputs: list[ir.Value | None], **attrs: object) -> ir.Value:
            n_ = ir.node(op, inputs, attributes=attrs, name=f"{node.name}_{op}_{len(new)}")
            new.append(n_)
            return n_.outputs[0]

        if self.plain:
            deq = add("Mul", [add("Reshape", [add("Cast", [q], to=ir.DataType.FLOAT16.value),
                                              init(f"w8a16.groups_n{n}", np.array([-1, self.group, n], np.int64))])
                              if k % self.group == 0 else add("Cast", [q], to=ir.DataType.FLOAT16.value),
                              self._group_scale(init, source, scales, k)])
            y = add("MatMul", [x, add("Reshape", [deq, init(f"w8a16.kn_{k}_{n}", np.array([k, n], np.int64))])])
        else:
            x2 = add("Reshape", [x, init(f"w8a16.rows_k{k}", np.array([-1, k], np.int64))])
            y2 = add(OP, [x2, q, s, None, None, None, None], antiquant_group_size=self.group)
            shape = add("Concat", [add("Slice", [add("Shape", [x]), init("w8a16.zero", np.array([0], np.int64)),
                                                 init("w8a16.minus1", np.array([-1], np.int64))]),
                                   init(f"w8a16.n{n}", np.array([n], np.int64))], axis=0)
            y = add("Reshape", [y2, shape])
        graph.insert_before(node, new)
        y.name, y.type, y.shape = out.name, out.type, out.shape
        out.replace_all_uses_with(y, replace_graph_outputs=True)
        graph.remove(node, safe=True)
        return True

    def _group_scale(self, init, source: str, scales: np.ndarray, k: int) -> ir.Value:  # noqa: ANN001
        """The scales in the shape the plain dequantization multiplies: ``[k/g, 1, n]`` per group, or expanded to
        ``[k, n]`` rows when k is not a multiple of g."""
        if k % self.group == 0:
            return init(f"{source}.w8_scale_g", scales[:, None, :])
        return init(f"{source}.w8_scale_k", np.repeat(scales, self.group, axis=0)[:k])
