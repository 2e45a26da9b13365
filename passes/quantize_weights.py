"""Weight-only quantization of a lowered ORT graph: constant-weight MatMuls → ``com.microsoft.MatMulNBits``, and
the token embedding gathered from a quantized table and dequantized in the graph (plain ONNX ops).

Which weights: a MatMul whose weight is an export initializer ``<name>.T`` (``[K, N]``, the transposed torch
weight ``<name>``) or ``Transpose(<name>)`` (a tied lm_head reading the embedding), grouped by the source name:
``attention`` (``self_attn``), ``mlp`` (``mlp``), ``lm_head`` (``lm_head`` or the tied ``embed_tokens``). The
fusions' merged weights are named for their parts (``qkv_proj`` = q, k, v rows; ``gate_up_proj`` = gate, up
rows): that naming is the contract that lets GGUF blocks of the parts be stacked into the merged matrix.

Where the weights come from (``blocks``): the export's GGUF blocks (Q4_0, Q4_1, Q8_0, by source name) are used
as they are — the published weights, not a re-quantization of their dequantized copy — when every part of a
matrix has them in one bit width; each such matrix keeps its own width (a Q8_0 lm_head stays 8-bit in an int4
bundle). Every other matrix is quantized by round to nearest to ``bits`` per ``group_size`` along K. A GGUF
matrix is checked against the graph's float weight before it is used (the export dequantized the same blocks).
Which op (``gemm``): ``"nbits"`` — ``com.microsoft.MatMulNBits`` (an affine block's offsets as one extra
``blocksum(x) @ block_minᵀ`` MatMul); ``"kernel"`` — omforge's ``MatMulQ`` (int8 activations, the offsets folded
into the kernel), its weights packed at compile time (:mod:`omforge.passes.gemm_pack`); ``"kernel_bf16"`` —
omforge's ``MatMulQBF16``, the same packed weights × bfloat16 activations. ``bits`` 16 and 32 quantize nothing: every
weight MatMul becomes omforge's ``MatMulBF16`` (weights rounded to bfloat16) or ``MatMulF32`` (the float32 weights
as they are, in column panels); an untied embedding's gather stays float32, a tied one reads the lm_head's panels
(the table held once). The compile stage decides (compile/ort.py) and
hands the choice in.
Postcondition: no quantized group's MatMul is left, and ``report`` names the source and width of every weight.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import onnx_ir as ir

from omforge.contract import cdiv
from omforge.contract.kernel_abi import DOMAIN as KERNEL_DOMAIN
from omforge.contract.kernel_abi import WEIGHT_LAYOUT
from omforge.passes import gemm_pack, quant
from omforge.passes.util import drop_unused_initializers, read_weight, weight_matmuls

MS_DOMAIN = "com.microsoft"


@dataclass(frozen=True)
class _FloatOp:
    """Float weights of one width: the kernel op they become, how their panels are packed and named."""

    op: str
    tag: str  # in the panels' initializer name and the node's
    pack: Callable[[np.ndarray], np.ndarray]
    source: str  # the report's description


_FLOAT_OPS = {16: _FloatOp("MatMulBF16", "bf16", gemm_pack.pack_bf16, "bfloat16 (round to nearest even)"),
              32: _FloatOp("MatMulF32", "f32", gemm_pack.pack_f32, "float32 (column panels)")}
_MERGED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def group_of(source: str) -> str | None:
    """The recipe's matrix group of a torch weight name (``quantization.matrices``); None: never quantized — a
    mixture of experts' router (``mlp.gate.weight``, [E, H]) stays float as llama.cpp keeps it (src/llama-quant.cpp:
    "do not quantize expert gating tensors", ``ffn_gate_inp``): a rounded router picks other experts."""
    if source.endswith(".mlp.gate.weight"):
        return None
    if ".self_attn." in source:
        return "attention"
    if ".mlp." in source:
        return "mlp"
    if source.startswith(("lm_head.", "model.embed_tokens.")):
        return "lm_head"
    return None


def parts_of(source: str) -> list[str]:
    """The torch weights a (possibly merged) weight is stacked from, in row order."""
    prefix, _, leaf = source.rpartition(".")  # "model.layers.0.self_attn.qkv_proj", "weight"
    head, _, proj = prefix.rpartition(".")
    return [f"{head}.{p}.{leaf}" for p in _MERGED[proj]] if proj in _MERGED else [source]


class QuantizeWeights(ir.passes.InPlacePass):
    def __init__(self, bits: int, group_size: int = 32, symmetric: bool = True,
                 matrices: Sequence[str] = ("attention", "mlp", "lm_head"), embedding: str = "quantized",
                 accuracy_level: int = 0, blocks: Mapping[str, tuple[str, np.ndarray, int]] | None = None,
                 gemm: str = "nbits"):
        super().__init__()
        if gemm not in ("nbits", "kernel", "kernel_bf16"):
            raise ValueError(f"gemm must be 'nbits', 'kernel' or 'kernel_bf16', got {gemm!r}")
        if bits in _FLOAT_OPS and (gemm != "kernel" or embedding != "float"):
            raise ValueError(f"bits {bits} is the kernel's {_FLOAT_OPS[bits].op}, with a float32 embedding")
        self.gemm = gemm
        self.bits, self.group_size, self.symmetric = bits, group_size, symmetric
        self.matrices, self.embedding, self.accuracy_level = set(matrices), embedding, accuracy_level
        self.blocks = blocks or {}
        self.report: dict[str, dict[str, object]] = {}
        self._packed: dict[str, quant.Packed | None] = {}
        self._float: dict[str, tuple[int, int]] = {}  # bits 16 / 32: the (N, K) of each source packed so far

    # --- the weights -------------------------------------------------------------------------------------------

    def _pack(self, source: str, rows: Callable[[], np.ndarray]) -> quant.Packed | None:
        """The packed form of ``source`` (``rows()``: its float weight ``[N, K]``, read only the first time), made
        once per source; None when it stays float: 8-bit at ``accuracy_level`` 0, a slow ORT CPU path
        (benchmarks/RESULTS.md, "MatMulNBits on this CPU") — a GGUF Q8_0 matrix then runs as its exact float32
        dequantization."""
        if source in self._packed:
            return self._packed[source]
        w_nk = rows()
        packed = self._from_blocks(source, w_nk)
        if packed is None:
            packed = quant.quantize(w_nk, self.bits, self.group_size, self.symmetric)
        if packed.bits == 8 and self.accuracy_level == 0:
            self.report[source] = {"bits": 32, "block": None, "source": f"float32 ({packed.source} dequantized: "
                                   "8-bit at accuracy_level 0 is slow)", "bytes": w_nk.nbytes}
            packed = None
        else:
            self.report[source] = {"bits": packed.bits, "block": packed.block, "source": packed.source,
                                   "bytes": packed.nbytes}
        self._packed[source] = packed
        return packed

    def _from_blocks(self, source: str, w_nk: np.ndarray) -> quant.Packed | None:
        return quant.from_gguf_parts(self.blocks, parts_of(source), w_nk, source)

    @staticmethod
    def _const(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
        """The initializer ``name`` (made once: a tied table's parts serve its MatMul and its Gather)."""
        value = graph.initializers.get(name)
        if value is None:
            value = ir.Value(name=name, const_value=ir.tensor(array, name=name))
            graph.register_initializer(value)
        return value

    # --- the graph ---------------------------------------------------------------------------------------------

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        modified = False
        for node in weight_matmuls(graph):
            modified |= self._matmul(graph, node)
        if self.embedding == "quantized" or self.bits in _FLOAT_OPS:
            gather = self._gather_panels if self.bits in _FLOAT_OPS else (
                lambda g, n: self._gather_q_panels(g, n) or self._gather(g, n))
            for node in list(graph):
                if node.op_type == "Gather" and node.domain in ("", "ai.onnx"):
                    modified |= gather(graph, node)
        if modified:
            model.opset_imports.setdefault(MS_DOMAIN, 1)
            if self.gemm != "nbits":
                model.opset_imports.setdefault(KERNEL_DOMAIN, 1)
            drop_unused_initializers(graph)
        return ir.passes.PassResult(model, modified=modified)

    def ensures(self, model: ir.Model) -> None:
        """No MatMul of a chosen group is left on a float weight, unless it was kept float on purpose (_pack)."""
        for node in model.graph:
            if node.op_type == "MatMul" and len(node.inputs) > 1:
                source, _, _ = weight_source(node.inputs[1])
                if source is not None and group_of(source) in self.matrices and (
                        self.bits in _FLOAT_OPS or self._packed.get(source) is not None):
                    raise ir.passes.PostconditionError(f"{source}: its MatMul was not quantized")

    def _matmul(self, graph: ir.Graph, node: ir.Node) -> bool:
        x, w = node.inputs
        source, const, transposed = weight_source(w)
        if source is None or group_of(source) not in self.matrices:
            return False
        if self.bits in _FLOAT_OPS:
            return self._matmul_float(graph, node, source, lambda: _rows(const, transposed))
        p = self._pack(source, lambda: _rows(const, transposed))
        if p is None:
            return False
        q = f"{source}.q{p.bits}"
        meta = dict(node.metadata_props)
        if self.gemm != "nbits" and p.block in gemm_pack.BLOCKS:
            return self._matmul_q(graph, node, p, q, meta)
        weights = [self._const(graph, q, p.blocks), self._const(graph, f"{q}.scales", p.scales)]
        attrs = {"K": p.k, "N": p.n, "bits": p.bits, "block_size": p.block, "accuracy_level": self.accuracy_level}
        nbits = ir.node("MatMulNBits", [x, *weights], domain=MS_DOMAIN, attributes=attrs, name=f"{node.name}_nbits",
                        metadata_props=meta)
        new = [nbits]
        if p.block_min is not None:  # the affine part: blocksum(x) @ block_minᵀ (quant.py)
            member = np.zeros((p.k, p.k_blocks), np.float32)  # x @ member: the sums of x over each block
            member[np.arange(p.k), np.arange(p.k) // p.block] = 1
            sums = ir.node("MatMul", [x, self._const(graph, f"block_sum.k{p.k}.b{p.block}", member)])
            mins = self._const(graph, f"{q}.block_min", np.ascontiguousarray(p.block_min.T))
            new.append(sums)
            corr = ir.node("MatMul", [sums.outputs[0], mins], name=f"{node.name}_block_min", metadata_props=meta)
            total = ir.node("Add", [nbits.outputs[0], corr.outputs[0]], name=f"{node.name}_affine", metadata_props=meta)
            new += [corr, total]
        ir.convenience.replace_nodes_and_values(graph, node, [node], new, node.outputs, new[-1].outputs)
        return True

    def _matmul_q(self, graph: ir.Graph, node: ir.Node, p: quant.Packed, q: str, meta: dict[str, str]) -> bool:
        """``MatMulQ`` (``MatMulQBF16`` for gemm "kernel_bf16") over the panel16 form of ``p`` (made once per source:
        a tied table's MatMul shares it)."""
        name = f"{q}.panel{WEIGHT_LAYOUT}"
        if graph.initializers.get(f"{name}.codes") is None:
            w = gemm_pack.pack(p)
            self._const(graph, f"{name}.codes", w.codes)
            self._const(graph, f"{name}.scales", w.scales)
            if w.offsets is not None:
                self._const(graph, f"{name}.offsets", w.offsets)
        inputs = [node.inputs[0], graph.initializers[f"{name}.codes"], graph.initializers[f"{name}.scales"]]
        if p.block_min is not None:
            inputs.append(graph.initializers[f"{name}.offsets"])
        attrs = {"K": p.k, "N": p.n, "bits": p.bits, "block_size": p.block, "layout": WEIGHT_LAYOUT}
        op = "MatMulQBF16" if self.gemm == "kernel_bf16" else "MatMulQ"
        gemm = ir.node(op, inputs, domain=KERNEL_DOMAIN, attributes=attrs, name=f"{node.name}_q",
                       metadata_props=meta)
        ir.convenience.replace_nodes_and_values(graph, node, [node], [gemm], node.outputs, gemm.outputs)
        return True

    def _matmul_float(self, graph: ir.Graph, node: ir.Node, source: str, rows: Callable[[], np.ndarray]) -> bool:
        """``MatMulBF16`` over the bfloat16 panels of ``source`` (round to nearest even), or ``MatMulF32`` over its
        float32 panels (values unchanged); the panels made once per source."""
        f = _FLOAT_OPS[self.bits]
        name = f"{source}.{f.tag}.panel{WEIGHT_LAYOUT}"
        if source not in self._float:
            w_nk = rows()
            panels = f.pack(w_nk)  # bfloat16 bits typed as such: the tied table's Gather reads them (_gather_panels)
            self._const(graph, name, panels.view(ml_dtypes.bfloat16) if self.bits == 16 else panels)
            self._float[source] = w_nk.shape
            self.report[source] = {"bits": self.bits, "block": None, "source": f.source, "bytes": panels.nbytes}
        n, k = self._float[source]
        gemm = ir.node(f.op, [node.inputs[0], graph.initializers[name]], domain=KERNEL_DOMAIN,
                       attributes={"K": k, "N": n, "layout": WEIGHT_LAYOUT}, name=f"{node.name}_{f.tag}",
                       metadata_props=dict(node.metadata_props))
        ir.convenience.replace_nodes_and_values(graph, node, [node], [gemm], node.outputs, gemm.outputs)
        return True

    def _gather(self, graph: ir.Graph, node: ir.Node) -> bool:
        table, ids = node.inputs
        if table is None or table.const_value is None or not (table.name or "").endswith("embed_tokens.weight"):
            return False
        if node.attributes.get_int("axis", 0) != 0:
            return False
        p = self._pack(table.name, table.const_value.numpy)
        if p is None:
            return False
        blocks = self._const(graph, f"{table.name}.q{p.bits}", p.blocks)
        kb = p.k_blocks
        b = _Replacement(self, graph, node, f"{node.name}_", f"{table.name}.q{p.bits}")
        add, const = b.add, b.const

        last = const("last_axis", np.array([-1], np.int64))
        rows = add("Gather", [blocks, ids], axis=0)  # [.., kb, bytes]
        if p.bits == 4:
            lo = add("BitwiseAnd", [rows, const("mask", np.array(15, np.uint8))])
            hi = add("BitShift", [rows, const("shift", np.array(4, np.uint8))], direction="RIGHT")
            pairs = add("Concat", [add("Unsqueeze", [lo, last]), add("Unsqueeze", [hi, last])], axis=-1)
            rows = add("Reshape", [pairs, const("codes_shape", np.array([0, 0, kb, p.block], np.int64))])
        codes = add("Cast", [rows], to=ir.DataType.FLOAT)
        scale = add("Unsqueeze", [add("Gather", [const("scales_2d", p.scales.reshape(p.n, kb)), ids], axis=0), last])
        zp = const("zero_point", np.array(1 << (p.bits - 1), np.float32))
        rows = add("Mul", [add("Sub", [codes, zp]), scale])
        if p.block_min is not None:
            rows = add("Add", [rows, add("Unsqueeze", [add("Gather", [const("block_min_rows", p.block_min), ids],
                                                                axis=0), last])])
        rows = add("Reshape", [rows, const("rows_shape", np.array([0, 0, kb * p.block], np.int64))])
        if kb * p.block != p.k:
            zero, k, axis = (const(n, np.array([v], np.int64)) for n, v in (("zero", 0), ("k", p.k), ("axis", -1)))
            rows = add("Slice", [rows, zero, k, axis])
        return b.replace(rows)

    def _gather_q_panels(self, graph: ir.Graph, node: ir.Node) -> bool:
        """gemm "kernel": a tied table's Gather reads the lm_head's MatMulQ panel16 codes, scales and offsets
        (:func:`_panel_column`) instead of a second copy of its blocks — the same dequantization as :meth:`_gather`,
        ``(code - zero) · scale (+ offset)`` in that order, so the same rows; the table is held once (164 MB less at
        Llama-3.2-1B's int4)."""
        table, ids = node.inputs
        if table is None or ids is None or node.attributes.get_int("axis", 0) != 0:
            return False
        p = self._packed.get(table.name or "")
        name = f"{table.name}.q{p.bits}.panel{WEIGHT_LAYOUT}" if p is not None else ""
        if p is None or graph.initializers.get(f"{name}.codes") is None:
            return False
        codes, scales = graph.initializers[f"{name}.codes"], graph.initializers[f"{name}.scales"]
        offsets = graph.initializers.get(f"{name}.offsets")
        kb, chunks = p.k_blocks, p.k_blocks * p.block // gemm_pack.CHUNK
        groups = 8 if p.bits == 8 else 4  # bytes of one column in a chunk come in groups of 4 (qgemm.h)
        b = _Replacement(self, graph, node, f"{node.name}_panels_", f"{name}.gather")
        panel, column = _panel_of(b, ids)
        g = _panel_column(b, codes, panel, column, (chunks, groups, None, 4), "bytes")
        if p.bits == 4:  # [T, chunk, h, 1, e]: low nibble k = 8h + e, high k = 8h + 4 + e
            lo = b.add("BitwiseAnd", [g, b.const("mask", np.array(15, np.uint8))])
            hi = b.add("BitShift", [g, b.const("shift", np.array(4, np.uint8))], direction="RIGHT")
            g = b.add("Concat", [lo, hi], axis=3)
        values = b.add("Reshape", [b.add("Cast", [g], to=ir.DataType.FLOAT), b.i64("blocks", 0, kb, p.block)])
        zero = b.const("zero_point", np.array(1 << (p.bits - 1), np.float32))
        scale = b.add("Cast", [_panel_column(b, scales, panel, column, (kb, None), "scales")], to=ir.DataType.FLOAT)
        rows = b.add("Mul", [b.add("Sub", [values, zero]), scale])  # float16 scales: exact in float32
        if offsets is not None:
            rows = b.add("Add", [rows, _panel_column(b, offsets, panel, column, (kb, None), "offsets")])
        return b.replace(_rows_of(b, rows, kb * p.block, p.k, ids))

    def _gather_panels(self, graph: ir.Graph, node: ir.Node) -> bool:
        """A tied embedding's Gather (bits 16 / 32) reads its rows from the lm_head's panels (:func:`_panel_column`),
        so the bundle and the session hold the table once (Llama-3.2-1B's 128k × 2048: 1 GB less in float32, 1 GB →
        0.5 GB in bfloat16): MatMulF32's ``[P, K, 16]`` holds the float32 values themselves; MatMulBF16's
        ``[P, Kp/2, 32]`` (bfloat16, the pair ``2c, 2c+1`` of each k pair is column ``c``) the bfloat16 rounding
        every other weight of the bundle has, Cast to float32. An untied table stays."""
        table, ids = node.inputs
        if table is None or ids is None or table.name not in self._float or node.attributes.get_int("axis", 0) != 0:
            return False
        f = _FLOAT_OPS[self.bits]
        _, k = self._float[table.name]
        panels = graph.initializers[f"{table.name}.{f.tag}.panel{WEIGHT_LAYOUT}"]
        pairs = 2 if self.bits == 16 else 1  # k values per panel column entry: bf16 pairs, f32 single
        steps = cdiv(k, pairs)  # [P, steps, 16 * pairs]
        b = _Replacement(self, graph, node, f"{node.name}_panels_", f"{table.name}.{f.tag}.panel_gather")
        panel, column = _panel_of(b, ids)
        rows = _panel_column(b, panels, panel, column, (steps, None, pairs), "columns")
        if self.bits == 16:
            rows = b.add("Cast", [rows], to=ir.DataType.FLOAT)
        return b.replace(_rows_of(b, rows, steps * pairs, k, ids))


class _Replacement:
    """The nodes that replace one Gather, named ``<infix><op>_<i>``, and the constants they read, made once per name
    under ``prefix`` (:meth:`QuantizeWeights._const`: a tied table's MatMul and Gather share them)."""

    def __init__(self, qpass: QuantizeWeights, graph: ir.Graph, node: ir.Node, infix: str, prefix: str) -> None:
        self.qpass, self.graph, self.node, self.infix, self.prefix = qpass, graph, node, infix, prefix
        self.nodes: list[ir.Node] = []

    def add(self, op: str, inputs: list[ir.Value], **attrs: object) -> ir.Value:
        new = ir.node(op, inputs, attributes=attrs or None, name=f"{self.infix}{op.lower()}_{len(self.nodes)}")
        self.nodes.append(new)
        return new.outputs[0]

    def const(self, name: str, array: np.ndarray) -> ir.Value:
        return self.qpass._const(self.graph, f"{self.prefix}.{name}", array)

    def i64(self, name: str, *values: int) -> ir.Value:
        return self.const(name, np.array(values, np.int64))

    def replace(self, rows: ir.Value) -> bool:
        """The Gather's output is ``rows`` from now on."""
        ir.convenience.replace_nodes_and_values(self.graph, self.node, [self.node], self.nodes, self.node.outputs,
                                                [rows])
        return True


def _panel_of(b: _Replacement, ids: ir.Value) -> tuple[ir.Value, ir.Value]:
    """Where token ``v``'s row lives in a 16-column panel layout: panel ``v // 16``, column ``v % 16`` (ids flat)."""
    flat = b.add("Reshape", [ids, b.i64("flat", -1)])  # [T]
    width = b.i64("panel_width", gemm_pack.PANEL)
    return b.add("Div", [flat, width]), b.add("Mod", [flat, width])


def _panel_column(b: _Replacement, weights: ir.Value, panel: ir.Value, column: ir.Value, view: tuple[int | None, ...],
                  name: str) -> ir.Value:
    """Each id's column out of its panel: ``weights [P, ...]`` gathered at ``panel``, seen as ``[T, *view]`` whose
    axis ``view`` gives as ``None`` holds the 16 columns, reduced to that one column (size 1 there)."""
    axis = 1 + view.index(None)
    view = tuple(gemm_pack.PANEL if v is None else v for v in view)
    picked = b.add("Reshape", [b.add("Gather", [weights, panel], axis=0), b.i64(name, 0, *view)])
    where = b.add("Reshape", [column, b.i64(f"{name}_column", -1, *(1 for _ in view))])
    spread = b.i64(f"{name}_spread", 1, *(1 if i + 1 == axis else v for i, v in enumerate(view)))
    return b.add("GatherElements", [picked, b.add("Expand", [where, spread])], axis=axis)


def _rows_of(b: _Replacement, rows: ir.Value, width: int, k: int, ids: ir.Value) -> ir.Value:
    """``rows`` (``width`` values per id, K padded to ``width``) as the Gather's ``[*ids.shape, k]``."""
    rows = b.add("Reshape", [rows, b.i64("row", 0, width)])
    if width != k:
        rows = b.add("Slice", [rows, b.i64("start", 0), b.i64("k", k), b.i64("last", -1)])
    return b.add("Reshape", [rows, b.add("Concat", [b.add("Shape", [ids]), b.i64("k_dim", k)], axis=0)])


def weight_source(w: ir.Value | None) -> tuple[str | None, ir.Value | None, bool]:
    """Behind a MatMul's weight input: the torch weight name, the constant holding it and whether that constant
    is stored transposed (``[K, N]``); (None, None, False) when it is no export weight."""
    if w is None:
        return None, None, False
    if w.const_value is not None and (w.name or "").endswith(".T") and len(w.const_value.shape) == 2:
        return w.name[:-2], w, True
    producer = w.producer()
    if (producer is not None and producer.op_type == "Transpose" and producer.inputs[0] is not None
            and producer.inputs[0].const_value is not None
            and list(producer.attributes.get_ints("perm", [1, 0])) == [1, 0]):
        return producer.inputs[0].name, producer.inputs[0], False
    return None, None, False


def _rows(const: ir.Value, transposed: bool) -> np.ndarray:
    """The weight ``[N, K]`` (one row per output feature) of a constant found by :func:`weight_source`."""
    array = read_weight(const.const_value)
    return np.ascontiguousarray(array.T) if transposed else array
