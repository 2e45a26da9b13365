"""Weight-only quantization into ONNX Runtime's ``com.microsoft.MatMulNBits`` layout (pure numpy).

A :class:`Packed` matrix holds ``W [N, K]`` (one row per output feature, as torch's Linear stores it) as
``blocks`` ``[N, ceil(K / block), block * bits / 8]`` uint8 codes, packed low nibble first along K for 4 bits,
``scales`` ``[N * k_blocks]`` float32, no zero-point input (MatMulNBits' default, 2^(bits-1)), and an optional
``block_min`` ``[N, k_blocks]`` float32 added per block:

    W[n, k] = (code[n, k] - 2^(bits-1)) * scale[n, b] + block_min[n, b]        (b = k // block)

Why no zero points: ONNX Runtime's fast CPU MatMulNBits paths take 4-bit weights without zero points (and 8-bit
weights); float zero points take a slow one (measured: benchmarks/RESULTS.md, "MatMulNBits on this CPU"). An
affine block (GGUF Q4_1 ``q·d + m``, asymmetric round to nearest) is written as its symmetric part plus
``block_min``, which the graph adds as ``blocksum(x) @ block_minᵀ`` — one small MatMul over ``K / block`` columns
(:mod:`omforge.passes.quantize_weights`). Invariant: :func:`dequantize` is exactly the weight the graph multiplies
by.

Two producers: :func:`quantize` (round to nearest per group along K, symmetric or asymmetric) for float weights,
and :func:`from_gguf` for GGUF's own Q4_0 / Q4_1 / Q8_0 blocks, which fit without re-quantizing: Q4_0 ``(q - 8)·d``
and Q8_0 ``q·d`` as they are; Q4_1 ``q·d + m`` as ``(q - 8)·d + (m + 8·d)`` (exact in float32: d and m are fp16).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from omforge.contract import cdiv

GGUF_BLOCKS = {"Q4_0": (4, 18), "Q4_1": (4, 20), "Q8_0": (8, 34)}  # GGUF type -> (bits, bytes per 32 weights)
GGUF_BLOCK = 32


@dataclass
class Packed:
    bits: int
    block: int
    n: int
    k: int
    blocks: np.ndarray
    scales: np.ndarray
    block_min: np.ndarray | None  # [N, k_blocks]: the affine part, None when symmetric
    source: str  # how it was made: "rtn symmetric", "rtn asymmetric", "gguf Q4_1", …

    @property
    def k_blocks(self) -> int:
        return cdiv(self.k, self.block)

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes + self.scales.nbytes + (0 if self.block_min is None else self.block_min.nbytes)


def _pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """``[..., 2m]`` codes 0..15 → ``[..., m]`` bytes, element 2i in the low nibble."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def _unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    out = np.empty((*packed.shape[:-1], packed.shape[-1] * 2), np.uint8)
    out[..., 0::2], out[..., 1::2] = packed & 15, packed >> 4
    return out


ROWS_PER_CHUNK = 2048  # rows quantized at a time: the temporaries stay a few rows' worth, not the whole matrix


def quantize(w: np.ndarray, bits: int, block: int, symmetric: bool = True) -> Packed:
    """Round-to-nearest quantization of ``w [N, K]`` (float) per ``block`` consecutive elements along K (K is
    padded with zeros to a whole block). Symmetric: scale ``amax / (2^(bits-1) - 1)``; asymmetric: scale
    ``(max - min) / (2^bits - 1)`` over the block's range (widened to include 0) and its offset as ``block_min``;
    either scale rounded to a float16 value first (:func:`_float16_scale`).
    Works through :data:`ROWS_PER_CHUNK` rows at a time (an 128k-row embedding would otherwise need several
    float32 copies of itself)."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    parts = [_quantize_rows(w[i:i + ROWS_PER_CHUNK], bits, block, symmetric)
             for i in range(0, w.shape[0], ROWS_PER_CHUNK)]
    return parts[0] if len(parts) == 1 else concat_rows(parts)


def _quantize_rows(w: np.ndarray, bits: int, block: int, symmetric: bool) -> Packed:
    n, k = w.shape
    kb = cdiv(k, block)
    g = np.zeros((n, kb * block), np.float32)
    g[:, :k] = w
    g = g.reshape(n, kb, block)
    half, top = 1 << (bits - 1), (1 << bits) - 1
    if symmetric:
        scale = _float16_scale(np.abs(g).max(-1) / (half - 1))
        codes = np.clip(np.rint(g / scale[..., None]), -half, half - 1) + half
        block_min = None
    else:  # w ≈ (q - z)·s = (q - half)·s + (half - z)·s
        lo, hi = np.minimum(g.min(-1), 0), np.maximum(g.max(-1), 0)
        scale = _float16_scale((hi - lo) / top)
        z = np.clip(np.rint(-lo / scale), 0, top)
        codes = np.clip(np.rint(g / scale[..., None]) + z[..., None], 0, top)
        block_min = ((half - z) * scale).astype(np.float32)
    codes = codes.astype(np.uint8)
    blocks = _pack_nibbles(codes) if bits == 4 else codes
    return Packed(bits, block, n, k, blocks, scale.reshape(-1).astype(np.float32), block_min,
                  f"rtn {'symmetric' if symmetric else 'asymmetric'}")


def _float16_scale(scale: np.ndarray) -> np.ndarray:
    """Block scales as float16 values (in float32), chosen before the codes so that the codes fit them: the kernel
    layout stores scales as float16 (runtime/ort/kernels/qgemm.h), as GGUF's Q4_0/Q8_0 store ``d``. Rounded up, never
    down, so the block's range still fits its codes (each weight within half a step); an all-zero block gets 1, and
    scales stay within float16's range (2^-24 … 65504: a block whose step would be finer holds weights under ~1e-7,
    whose codes then round to the zero point)."""
    scale = np.clip(np.where(scale == 0, np.float32(1.0), scale), np.float32(2.0 ** -24), np.float32(65504.0))
    half = scale.astype(np.float16)
    half = np.where(half.astype(np.float32) < scale, np.nextafter(half, np.float16(np.inf)), half)
    return half.astype(np.float32)


def unpacked_codes(p: Packed) -> np.ndarray:
    """The unsigned codes of ``p``, one per weight (4 bits unpacked, low nibble first), shaped like its blocks'
    leading dims with ``block`` codes per block."""
    return _unpack_nibbles(p.blocks) if p.bits == 4 else p.blocks


def dequantize(p: Packed) -> np.ndarray:
    """``W [N, K]`` float32 as the graph computes it (the layout's invariant)."""
    codes = unpacked_codes(p).astype(np.float32)
    kb = p.k_blocks
    w = (codes.reshape(p.n, kb, p.block) - (1 << (p.bits - 1))) * p.scales.reshape(p.n, kb)[..., None]
    if p.block_min is not None:
        w += p.block_min[..., None]
    return w.reshape(p.n, kb * p.block)[:, :p.k]


def from_gguf(kind: str, data: np.ndarray, k: int) -> Packed:
    """GGUF blocks ``data`` (uint8 ``[N, K / 32 * bytes per block]``, a row per output feature) of type ``kind``
    (Q4_0, Q4_1, Q8_0) in this layout, value for value (llama.cpp's ggml-quants block layouts)."""
    bits, size = GGUF_BLOCKS[kind]
    n = data.shape[0]
    kb = k // GGUF_BLOCK
    raw = np.ascontiguousarray(data).reshape(n, kb, size)
    d = raw[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q8_0":
        codes = (raw[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return Packed(8, GGUF_BLOCK, n, k, codes, d.reshape(-1), None, f"gguf {kind}")
    qs = raw[..., 4:] if kind == "Q4_1" else raw[..., 2:]
    codes = np.concatenate([qs & 15, qs >> 4], axis=-1)  # ggml: element j low nibble, element j + 16 high
    block_min = None
    if kind == "Q4_1":
        m = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        block_min = (m + 8 * d).astype(np.float32)
    return Packed(4, GGUF_BLOCK, n, k, _pack_nibbles(codes), d.reshape(-1), block_min, f"gguf {kind}")


def from_gguf_parts(blocks: Mapping[str, tuple[str, np.ndarray, int]], parts: Sequence[str],
                    check: np.ndarray, name: str, parts_named: str | None = None) -> Packed | None:
    """The matrix stacked (rows in order) from the GGUF blocks of the torch weights ``parts`` (``blocks``: by torch
    name, as the export saved them), or None when a part has no blocks or the parts differ in width (one matrix
    cannot hold both). Checked against ``check`` ``[N, K]``, the float weight the export dequantized from the same
    blocks: a mismatch is a RuntimeError naming ``name`` and the parts (``parts_named``, default their names)."""
    if not all(part in blocks for part in parts):
        return None
    try:
        packed = concat_rows([from_gguf(*blocks[part]) for part in parts])
    except ValueError:  # parts of different widths (a Q4 q with a Q8 v)
        return None
    got = dequantize(packed)
    if got.shape != check.shape or np.abs(got - check).max() > 1e-6 * max(float(np.abs(check).max()), 1.0):
        raise RuntimeError(f"{name}: the GGUF blocks of {parts_named or ', '.join(parts)} do not hold the exported "
                           "weight")
    return packed


def concat_rows(parts: list[Packed]) -> Packed:
    """Matrices stacked along N (a merged q/k/v or gate/up projection): blocks run along K, so rows concatenate
    value for value; a part without ``block_min`` contributes zeros to it."""
    first = parts[0]
    if any((p.bits, p.block, p.k) != (first.bits, first.block, first.k) for p in parts):
        raise ValueError("cannot stack matrices of different bits, block or K")
    block_min = None
    if any(p.block_min is not None for p in parts):
        block_min = np.concatenate([p.block_min if p.block_min is not None
                                    else np.zeros((p.n, p.k_blocks), np.float32) for p in parts])
    return Packed(first.bits, first.block, sum(p.n for p in parts), first.k,
                  np.concatenate([p.blocks for p in parts]), np.concatenate([p.scales for p in parts]), block_min,
                  "+".join(dict.fromkeys(p.source for p in parts)))
