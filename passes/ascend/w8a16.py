"""W8A16 for the ascend target (``compile.weights: int8``): int8 weights, float16 activations.

CANN's weight-only quantized matmul is ``WeightQuantBatchMatmulV2`` (aclnnWeightQuantBatchMatmulV2; ONNX node
``NPUWeightQuantBatchMatmulV2``, a built-in plugin for ai.onnx 11–19, reference ascend.md §2.1–2.2):
``y = x @ ((weight + antiquant_offset) · antiquant_scale)`` with ``x`` float16 ``[m, k]`` (2-D), ``weight``
int8 ``[k, n]`` (ND) and ``k, n ≤ 65535`` on Atlas A2/A3 (ops-nn
``matmul/weight_quant_batch_matmul_v2/docs/aclnnWeightQuantBatchMatmulV2.md``). ``antiquant_scale`` is float16,
either

  per channel (``quantization.group_size: 0``, ``antiquant_group_size=0``): ``[1, n]``, one scale per output
      column — **the default**, because it is the form every CANN version's op accepts for int8;
  per group (``group_size`` g = 32 / 64 / 128, ``antiquant_group_size=g``): ``[⌈k / g⌉, n]``, g a multiple of 32
      in [32, k − 1]. More accurate, but one version of the op definition allowed only group size 0 for int8:
      it needs a CANN whose WeightQuantBatchMatmulV2 takes ``antiquant_group_size > 0`` with int8 weights
      (reference ascend.md §5.1; which version first does is **[unverified]**), and the lowering report says so
      (:data:`PER_GROUP_CANN_NOTE`). A matrix with k ≤ g gets one group, i.e. per channel.

Per SoC (``compile.soc_version``, reference ascend.md §5.1, from the op's doc; :func:`soc_refusal`, checked when
the recipe is loaded): Atlas A2/A3 (``Ascend910B*``, ``Ascend910_93*``) take ND int8 weights with per-channel
or per-group scales — built; Atlas 300I/310P (``Ascend310P*``) needs FRACTAL_NZ int8 weights,
``transpose_weight`` true, per-channel scales and group size 0 — refused, since omforge does not build NZ weights
(the reference documents no NZ byte layout) and the plugin forces the transpose flags false (§2.2); Atlas
200I/500 A2 (``Ascend310B*``) has no such op — refused; any other SoC (the Atlas training series
``Ascend910A`` / ``Ascend910ProB`` …) is not in the op's list — refused.

This pass, run on the float16 graph (:mod:`omforge.passes.float16`), quantizes each chosen MatMul weight
symmetrically per group of ``group_size`` along k, or per column (round to nearest, no offset), and emits

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

from omforge.contract import cdiv
from omforge.passes.quantize_weights import group_of, weight_source
from omforge.passes.util import drop_unused_initializers, read_weight, weight_matmuls

OP = "NPUWeightQuantBatchMatmulV2"
MAX_DIM = 65535
DEFAULT_GROUP = 0
"""``quantization.group_size`` on ascend when the recipe does not set it: per channel, accepted by every CANN."""
A2_A3 = ("Ascend910B", "Ascend910_93")
"""``--soc_version`` prefixes of Atlas A2 (910B) and A3 (910_93): ND int8 weights, per-channel or per-group."""
PER_GROUP_CANN_NOTE = ("per-group int8 antiquant (antiquant_group_size > 0) needs a CANN version whose "
                       "WeightQuantBatchMatmulV2 accepts antiquant_group_size > 0 for int8 weights (one version of "
                       "the op definition allowed only 0; reference ascend.md §5.1); which version first does is "
                       "[unverified]. quantization.group_size: 0 (per channel) runs on every CANN")


def soc_refusal(soc: str) -> str | None:
    """Why ``compile.weights: int8`` is not built for ``--soc_version`` ``soc``; None for Atlas A2/A3, where it
    is (reference ascend.md §5.1, from ops-nn's aclnnWeightQuantBatchMatmulV2 doc)."""
    if soc.startswith(A2_A3):
        return None
    if soc.startswith("Ascend310P"):
        return (f"W8A16 is not built for soc_version {soc} (Atlas 300I/310P): its WeightQuantBatchMatmulV2 needs "
                "FRACTAL_NZ int8 weights with transpose_weight true, per-channel scales and group size 0, and "
                "omforge does not build NZ weights (ops-nn's aclnnWeightQuantBatchMatmulV2 doc); use weights: float16")
    if soc.startswith("Ascend310B"):
        return (f"W8A16 is not built for soc_version {soc} (Atlas 200I/500 A2): WeightQuantBatchMatmulV2 is not "
                "supported there (ops-nn's aclnnWeightQuantBatchMatmulV2 doc); use weights: float16")
    return (f"W8A16 is not built for soc_version {soc}: ops-nn's aclnnWeightQuantBatchMatmulV2 doc lists only "
            "Atlas A2/A3 (Ascend910B*, Ascend910_93*) and Atlas inference 310P; use weights: float16, or an "
            "Ascend910B* / Ascend910_93* soc_version")


def lowering_note(group: int) -> dict[str, str]:
    """What the manifest's ``weights.w8a16`` says about the lowering of ``quantization.group_size`` ``group``:
    the op, the SoCs it is built for, the scales, and which CANN versions take them."""
    return {"op": OP, "soc": "Atlas A2/A3 (Ascend910B*, Ascend910_93*): ND int8 weights [k, n]",
            "antiquant": "per channel: float16 scales [1, n], antiquant_group_size 0" if group == 0 else
                         f"per group of {group} along k: float16 scales [⌈k/{group}⌉, n], antiquant_group_size "
                         f"{group} (a matrix with k ≤ {group}: per channel)",
            "cann": "per channel (antiquant_group_size 0): accepted by every CANN version of the op" if group == 0
                    else PER_GROUP_CANN_NOTE,
            "verified": "not run on an NPU; from the reference (ascend.md §2.1, §2.2, §5.1)"}


def quantize_kn(w_kn: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 per group along k: ``(codes int8 [k, n], scales float16 [⌈k/g⌉, n])`` with
    ``w ≈ codes · scales[i // g]``; ``group`` 0 is per channel (one group of k: scales ``[1, n]``). The scale is
    computed in float32, then rounded to float16, and the codes are rounded against the float16 scale (what the
    kernel multiplies by)."""
    k, n = w_kn.shape
    group = group or k
    groups = cdiv(k, group)
    pad = groups * group - k
    w = np.pad(w_kn, ((0, pad), (0, 0))) if pad else w_kn
    w = w.reshape(groups, group, n).astype(np.float32, copy=False)
    scales = (np.abs(w).max(axis=1) / 127.0).astype(np.float16)
    safe = np.where(scales == 0, np.float16(1), scales).astype(np.float32)
    codes = np.clip(np.rint(w / safe[:, None, :]), -127, 127).astype(np.int8)
    return codes.reshape(groups * group, n)[:k], scales


class QuantizeW8A16(ir.passes.InPlacePass):
    """``report``: per weight, bits / group / bytes, or why it stayed float16."""

    def __init__(self, group_size: int = DEFAULT_GROUP, matrices: Sequence[str] = ("attention", "mlp", "lm_head"),
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
        group = self.group if 0 < self.group < k else 0  # antiquant_group_size is in [32, k − 1], or 0
        codes, scales = quantize_kn(w_kn, group)
        self.report[source] = {"bits": 8, "group": group, "scales": list(scales.shape),
                               "bytes": codes.nbytes + scales.nbytes}

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

        if self.plain and group == 0:  # [k, n] codes · [1, n] scales (broadcast over k)
            y = add("MatMul", [x, add("Mul", [add("Cast", [q], to=ir.DataType.FLOAT16.value), s])])
        elif self.plain:
            deq = add("Mul", [add("Reshape", [add("Cast", [q], to=ir.DataType.FLOAT16.value),
                                              init(f"w8a16.groups_g{group}_n{n}", np.array([-1, group, n], np.int64))])
                              if k % group == 0 else add("Cast", [q], to=ir.DataType.FLOAT16.value),
                              self._group_scale(init, source, scales, k, group)])
            y = add("MatMul", [x, add("Reshape", [deq, init(f"w8a16.kn_{k}_{n}", np.array([k, n], np.int64))])])
        else:
            x2 = add("Reshape", [x, init(f"w8a16.rows_k{k}", np.array([-1, k], np.int64))])
            y2 = add(OP, [x2, q, s, None, None, None, None], antiquant_group_size=group)
            shape = add("Concat", [add("Slice", [add("Shape", [x]), init("w8a16.zero", np.array([0], np.int64)),
                                                 init("w8a16.minus1", np.array([-1], np.int64))]),
                                   init(f"w8a16.n{n}", np.array([n], np.int64))], axis=0)
            y = add("Reshape", [y2, shape])
        graph.insert_before(node, new)
        y.name, y.type, y.shape = out.name, out.type, out.shape
        out.replace_all_uses_with(y, replace_graph_outputs=True)
        graph.remove(node, safe=True)
        return True

    @staticmethod
    def _group_scale(init, source: str, scales: np.ndarray, k: int, group: int) -> ir.Value:  # noqa: ANN001
        """The scales in the shape the plain dequantization multiplies: ``[k/g, 1, n]`` per group, or expanded to
        ``[k, n]`` rows when k is not a multiple of g."""
        if k % group == 0:
            return init(f"{source}.w8_scale_g", scales[:, None, :])
        return init(f"{source}.w8_scale_k", np.repeat(scales, group, axis=0)[:k])
