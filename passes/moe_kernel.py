"""The kernel library's mixture-of-experts ops (``MoEF32``, ``MoEBF16``, ``MoEQ``; runtime/ort/kernels/moe.h has
their contract): the neutral ``omforge.MoE`` node lowered to one of them, its expert weights packed at compile time.

Layout (moe.h): expert e's gate_up weight, ``W1_e [2·Fp, H]`` (one row per output column, Fp = F rounded up to 16),
interleaves gate and up by panel of 16 rows — rows 32q … 32q + 15 are gate columns 16q … 16q + 15, the next 16 rows
the same up columns, rows past F zero — so each pair of panels gives whole SwiGLU outputs; its down weight is
``W2_e [H, Fp]`` (columns past F zero). Each is then in its precision's MatMul layout (:mod:`omforge.passes.gemm_pack`:
panel16-f32, panel16-bf16, panel16), the experts stacked on a leading axis. Values are those of the weight MatMuls:
float32 unchanged, bfloat16 rounded to nearest even, int8 / int4 round to nearest per ``group_size`` along K, or a
GGUF's own Q4_0 / Q4_1 / Q8_0 blocks as they are (moved, never re-quantized) when every expert has them in one
width (:func:`pack_experts`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import ml_dtypes
import numpy as np
import onnx_ir as ir

from omforge.contract import cdiv
from omforge.contract.kernel_abi import DOMAIN as KERNEL_DOMAIN
from omforge.contract.kernel_abi import MOE_OPS, WEIGHT_LAYOUT
from omforge.passes import gemm_pack, quant
from omforge.passes.util import read_weight

PANEL = gemm_pack.PANEL
PRECISIONS = tuple(MOE_OPS)
"""What :func:`lower_moe_to_kernel` takes: ``float32``, ``bfloat16``, ``int8``, ``int4``."""
EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")
"""The per-expert torch weights a GGUF's blocks are looked up by: ``<prefix>.<e>.<name>.weight`` (Qwen3-MoE's hub
names, which the export gives Mixtral's w1 / w3 / w2 too)."""


@dataclasses.dataclass
class PackedExperts:
    """One MoE kernel node's packed weights (``inputs``: suffix and array, in the op's input order after x and
    router_logits; None: an optional input left out) and attributes."""

    op: str
    inputs: list[tuple[str, np.ndarray | None]]
    attributes: dict[str, int]
    report: dict[str, object] = dataclasses.field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for _, a in self.inputs if a is not None)


def padded_inter(f: int) -> int:
    """Fp: the expert intermediate size F rounded up to whole panels."""
    return cdiv(f, PANEL) * PANEL


def interleave_index(f: int) -> np.ndarray:
    """Row i of an expert's ``W1 [2·Fp, H]`` is row ``index[i]`` of its stacked ``[gate; up]`` ``[2F, H]``; -1: a
    zero row (past F)."""
    fp = padded_inter(f)
    c = np.arange(fp)
    index = np.full(2 * fp, -1, np.int64)
    valid = c < f
    index[(32 * (c // PANEL) + c % PANEL)[valid]] = c[valid]
    index[(32 * (c // PANEL) + PANEL + c % PANEL)[valid]] = f + c[valid]
    return index


def _w1_rows(gate_up: np.ndarray, f: int) -> np.ndarray:
    """One expert's ``W1 [2·Fp, H]`` float32 from its neutral ``gate_up [H, 2F]`` (MatMul layout)."""
    index = interleave_index(f)
    out = np.zeros((len(index), gate_up.shape[0]), np.float32)
    valid = index >= 0
    out[valid] = gate_up.T[index[valid]]
    return out


def _w2_rows(down: np.ndarray, fp: int) -> np.ndarray:
    """One expert's ``W2 [H, Fp]`` float32 from its neutral ``down [F, H]``."""
    f, h = down.shape
    out = np.zeros((h, fp), np.float32)
    out[:, :f] = down.T
    return out


def _stacked(n: int, make: Callable[[int], list[np.ndarray]]) -> list[np.ndarray]:
    """``make(e)``'s arrays for e = 0 … n − 1, each stacked on a new leading axis (filled in place: no second copy)."""
    first = make(0)
    out = [np.empty((n, *a.shape), a.dtype) for a in first]
    for e in range(n):
        for o, a in zip(out, first if e == 0 else make(e), strict=True):
            o[e] = a
    return out


def _take_rows(p: quant.Packed, index: np.ndarray) -> quant.Packed:
    """The rows ``index`` of ``p`` (-1: a zero row: codes at the zero point, scale and offset 0), values unchanged."""
    kb, valid = p.k_blocks, index >= 0
    src = np.where(valid, index, 0)
    blocks = p.blocks.reshape(p.n, kb, -1)[src]
    zero = 1 << (p.bits - 1)
    blocks[~valid] = zero | (zero << 4) if p.bits == 4 else zero
    scales = p.scales.reshape(p.n, kb)[src]
    scales[~valid] = 0
    block_min = None
    if p.block_min is not None:
        block_min = p.block_min[src]
        block_min[~valid] = 0
    return quant.Packed(p.bits, p.block, len(index), p.k, blocks, scales.reshape(-1), block_min, p.source)


def _gguf_experts(blocks: Mapping[str, tuple[str, np.ndarray, int]], prefix: str, experts: int,
                  names: tuple[str, ...], check: list[np.ndarray]) -> list[quant.Packed] | None:
    """Each expert's matrix stacked from the GGUF blocks of ``names`` (rows in order; :func:`quant.from_gguf_parts`,
    checked against the float weights ``check[e]`` ``[N, K]``), when every expert has them all in one bit width and
    block. None when any is missing or the widths differ."""
    keys = [[f"{prefix}.{e}.{n}.weight" for n in names] for e in range(experts)]
    if not all(k in blocks for ks in keys for k in ks):
        return None
    packed = [quant.from_gguf_parts(blocks, ks, w, f"{prefix}.{e}", ", ".join(names))
              for e, (ks, w) in enumerate(zip(keys, check, strict=True))]
    if any(p is None for p in packed) or len({(p.bits, p.block) for p in packed}) != 1:
        return None
    return packed


def pack_experts(gate_up: np.ndarray, down: np.ndarray, precision: str, top_k: int, normalize: bool, *,
                 group_size: int = 32, symmetric: bool = True,
                 blocks: Mapping[str, tuple[str, np.ndarray, int]] | None = None,
                 prefix: str | None = None) -> PackedExperts:
    """The kernel node's weights and attributes for the neutral op's ``gate_up_weight [E, H, 2F]`` (gate columns
    then up) and ``down_weight [E, F, H]`` (MatMul layout), in ``precision`` (:data:`PRECISIONS`). int8 / int4: round
    to nearest per ``group_size`` (32, 64, 128) along K, ``symmetric`` or affine; with ``blocks`` (a GGUF's blocks by
    torch name, as :class:`~omforge.passes.quantize_weights.QuantizeWeights` takes them) and ``prefix`` (the experts'
    torch name, e.g. ``model.layers.0.mlp.experts``), a matrix whose every expert has blocks of one width uses them as
    they are, in their own width (the gate_up and the down matrices each). ValueError names a bad argument."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if gate_up.ndim != 3 or down.ndim != 3 or gate_up.shape[2] % 2 or down.shape[0] != gate_up.shape[0] or \
            down.shape[1:] != (gate_up.shape[2] // 2, gate_up.shape[1]):
        raise ValueError(f"gate_up_weight must be [E, H, 2F] and down_weight [E, F, H], got {list(gate_up.shape)} and "
                         f"{list(down.shape)}")
    if top_k < 1 or top_k > gate_up.shape[0]:
        raise ValueError(f"top_k must be in 1 … {gate_up.shape[0]} (the experts), got {top_k}")
    n_exp, h, f = gate_up.shape[0], gate_up.shape[1], gate_up.shape[2] // 2
    fp = padded_inter(f)
    attrs = {"hidden_size": h, "inter_size": f, "top_k": top_k, "normalize": int(normalize), "layout": WEIGHT_LAYOUT}
    op = MOE_OPS[precision]
    if precision in ("float32", "bfloat16"):
        pack = gemm_pack.pack_f32 if precision == "float32" else gemm_pack.pack_bf16
        w1 = _stacked(n_exp, lambda e: [pack(_w1_rows(gate_up[e], f))])[0]
        w2 = _stacked(n_exp, lambda e: [pack(_w2_rows(down[e], fp))])[0]
        if precision == "bfloat16":  # typed as bfloat16 (the kernel takes uint16 too: the same bits)
            w1, w2 = w1.view(ml_dtypes.bfloat16), w2.view(ml_dtypes.bfloat16)
        return PackedExperts(op, [("gate_up", w1), ("down", w2)], attrs, {"source": precision})

    bits = 8 if precision == "int8" else 4
    if group_size not in gemm_pack.BLOCKS:
        raise ValueError(f"group_size must be one of {gemm_pack.BLOCKS}, got {group_size}")
    index = interleave_index(f)
    gguf1 = gguf2 = None
    if blocks and prefix:
        gguf1 = _gguf_experts(blocks, prefix, n_exp, EXPERT_NAMES[:2], [gate_up[e].T for e in range(n_exp)])
        gguf2 = _gguf_experts(blocks, prefix, n_exp, EXPERT_NAMES[2:], [down[e].T for e in range(n_exp)])
    # the torch-layout rows quantized (or taken from the blocks), then interleaved: the padding rows exact zeros (an
    # affine block's zero would be ~0 only up to the activations' rounding, and SwiGLU's padding columns not zero);
    # the down matrix's K padded from F to Fp within its last block (Fp − F < 16 < every block)
    p1 = [_take_rows(gguf1[e] if gguf1 else quant.quantize(gate_up[e].T, bits, group_size, symmetric), index)
          for e in range(n_exp)]
    p2 = [dataclasses.replace(gguf2[e] if gguf2 else quant.quantize(down[e].T, bits, group_size, symmetric), k=fp)
          for e in range(n_exp)]
    inputs: list[tuple[str, np.ndarray | None]] = []
    offsets = []
    for tag, parts in (("gate_up", p1), ("down", p2)):
        affine = any(p.block_min is not None for p in parts)

        def panel16(e: int, parts: list[quant.Packed] = parts, affine: bool = affine) -> list[np.ndarray]:
            w = gemm_pack.pack(parts[e])
            return [w.codes, w.scales] + ([w.offsets if w.offsets is not None else
                                           np.zeros(w.scales.shape, np.float32)] if affine else [])

        arrays = _stacked(n_exp, panel16)
        inputs += [(f"{tag}.codes", arrays[0]), (f"{tag}.scales", arrays[1])]
        offsets.append((f"{tag}.offsets", arrays[2] if affine else None))
    attrs |= {"bits": p1[0].bits, "block_size": p1[0].block, "down_bits": p2[0].bits, "down_block_size": p2[0].block}
    report = {"gate_up": p1[0].source, "down": p2[0].source}
    return PackedExperts(op, inputs + offsets, attrs, report)


def experts_name(node: ir.Node) -> str:
    """The experts' torch name of a neutral ``omforge.MoE`` node (``<prefix>`` of its ``<prefix>.gate_up_proj.
    weight.T`` weight, as passes/moe.py names it), else the node's name."""
    gate_up = node.inputs[2] if len(node.inputs) > 2 else None
    name = gate_up.name if gate_up is not None and gate_up.name else ""
    return name.rsplit(".gate_up_proj.", 1)[0] if ".gate_up_proj." in name else node.name or "MoE"


def describe(packed: PackedExperts) -> dict[str, object]:
    """A manifest ``weights.quantized`` entry for one MoE node's experts: op, bits, block, source, bytes (int8 /
    int4: the gate_up matrix's width and block, ``down`` the down matrix's where they differ)."""
    a = packed.attributes
    if packed.op == MOE_OPS["float32"] or packed.op == MOE_OPS["bfloat16"]:
        bits, block, source = (32, None, "float32") if packed.op == MOE_OPS["float32"] else (16, None, "bfloat16")
    else:
        bits, block = a["bits"], a["block_size"]
        gate_up, down = packed.report["gate_up"], packed.report["down"]
        source = gate_up if (gate_up, bits, block) == (down, a["down_bits"], a["down_block_size"]) else \
            f"gate_up {gate_up} ({bits}-bit, block {block}), down {down} ({a['down_bits']}-bit, block " \
            f"{a['down_block_size']})"
    return {"bits": bits, "block": block, "source": source, "bytes": packed.nbytes, "op": packed.op}


def lower_moe_to_kernel(graph: ir.Graph, node: ir.Node, precision: str, *, group_size: int = 32,
                        symmetric: bool = True, blocks: Mapping[str, tuple[str, np.ndarray, int]] | None = None,
                        prefix: str | None = None, report: dict[str, dict[str, object]] | None = None) -> ir.Node:
    """Replace the neutral ``omforge.MoE(x, router_logits, gate_up_weight, down_weight; top_k, normalize)`` node in
    ``graph`` by the kernel library's op for ``precision`` (:func:`pack_experts`; the weights must be initializers),
    its packed weights new initializers named after ``gate_up_weight`` and ``down_weight`` (which are dropped when
    nothing else reads them); returns the new node. Its output is the neutral op's (same shape, float32). ``prefix``
    defaults to the experts' torch name in ``gate_up_weight``'s (``<prefix>.gate_up_proj.weight.T``, as
    passes/moe.py names it). ``report`` gets the node's :func:`describe` entry under :func:`experts_name`. The caller
    imports :data:`KERNEL_DOMAIN` and checks the library (:func:`kernel_runs`)."""
    if len(node.inputs) != 4 or any(v is None for v in node.inputs):
        raise ValueError(f"{node.name}: MoE takes x, router_logits, gate_up_weight and down_weight")
    x, logits, gate_up, down = node.inputs
    if gate_up.const_value is None or down.const_value is None:
        raise ValueError(f"{node.name}: the expert weights must be initializers to be packed")
    if prefix is None and ".gate_up_proj." in (gate_up.name or ""):
        prefix = experts_name(node)
    top_k = node.attributes.get_int("top_k", 0)
    normalize = bool(node.attributes.get_int("normalize", 0))
    packed = pack_experts(read_weight(gate_up.const_value), read_weight(down.const_value), precision, top_k, normalize,
                          group_size=group_size, symmetric=symmetric, blocks=blocks, prefix=prefix)
    if report is not None:
        report[experts_name(node)] = describe(packed)
    weights: list[ir.Value | None] = []
    for suffix, array in packed.inputs:
        if array is None:
            weights.append(None)
            continue
        source = gate_up if suffix.startswith("gate_up") else down
        name = f"{source.name}.{packed.op}.{suffix}.panel{WEIGHT_LAYOUT}"
        value = ir.Value(name=name, const_value=ir.tensor(array, name=name))
        graph.register_initializer(value)
        weights.append(value)
    while weights and weights[-1] is None:  # trailing optional inputs left out
        weights.pop()
    kernel = ir.node(packed.op, [x, logits, *weights], domain=KERNEL_DOMAIN, attributes=packed.attributes,
                     name=f"{node.name}_{packed.op}", metadata_props=dict(node.metadata_props))
    ir.convenience.replace_nodes_and_values(graph, node, [node], [kernel], node.outputs, kernel.outputs)
    for value in (gate_up, down):  # the stacked float weights, unless something else reads them
        if not value.uses() and not value.is_graph_output() and graph.initializers.get(value.name) is value:
            del graph.initializers[value.name]
    return kernel


def kernel_runs(precision: str) -> str | None:
    """Why the kernel library here cannot run the MoE op for ``precision`` well, or None when it can: unavailable, or
    its GEMMs for ``precision`` on their portable path (a CPU without AVX2: scalar loops, several times slower)."""
    from omforge.contract.kernel_library import status

    s = status()
    if not s.available:
        return s.reason
    path = s.moe_f32 if precision == "float32" else s.bf16 if precision == "bfloat16" else s.gemm
    if path == "generic":
        return f"the kernel library's {precision} expert GEMMs have only their portable path on this CPU"
    return None
