"""The kernel library's weight layout for ``MatMulQ`` ("panel16", :data:`LAYOUT`), packed at compile time from a
:class:`~omforge.passes.quant.Packed` matrix (pure numpy). The byte layout is specified once, in
``runtime/ort/kernels/qgemm.h``; this module writes it and :func:`unpack` reads it back (the tests' check that
both sides agree).

Values are unchanged: a packed matrix multiplies by exactly :func:`omforge.passes.quant.dequantize`'s weight —
codes and scales are moved, never re-quantized (GGUF blocks stay lossless). N is padded to whole panels of 16
columns (padding: code at the zero point, scale 0) and K to whole weight blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from omforge.contract import cdiv
from omforge.contract.kernel_abi import WEIGHT_LAYOUT as LAYOUT  # noqa: F401 - the version this module writes
from omforge.passes import quant

PANEL = 16
CHUNK = 32
BLOCKS = (32, 64, 128)


@dataclass
class PanelWeights:
    bits: int
    block: int
    n: int
    k: int
    codes: np.ndarray  # uint8 [P, Kp/32, 16·32·bits/8]
    scales: np.ndarray  # float16 [P, kb, 16]
    offsets: np.ndarray | None  # float32 [P, kb, 16]; None when symmetric

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes + (0 if self.offsets is None else self.offsets.nbytes)


def pack(p: quant.Packed) -> PanelWeights:
    """``p`` in the panel16 layout; ValueError for a block size the kernel has no path for."""
    if p.block not in BLOCKS or p.bits not in (4, 8):
        raise ValueError(f"MatMulQ takes 4- or 8-bit blocks of {BLOCKS}, got {p.bits}-bit blocks of {p.block}")
    kb, zero = p.k_blocks, 1 << (p.bits - 1)
    panels = cdiv(p.n, PANEL)
    np_ = panels * PANEL
    codes = np.full((np_, kb * p.block), zero, np.uint8)
    codes[:p.n] = quant.unpacked_codes(p).reshape(p.n, -1)
    chunks = kb * p.block // CHUNK
    if p.bits == 8:  # [P, 16 cols, chunk, g, e] -> [P, chunk, g, cols, e]
        c = codes.reshape(panels, PANEL, chunks, 8, 4).transpose(0, 2, 3, 1, 4)
    else:  # [P, 16 cols, chunk, h, half, e]: the low nibble takes k = 8h + e, the high one k = 8h + 4 + e
        c6 = codes.reshape(panels, PANEL, chunks, 4, 2, 4)
        c = (c6[:, :, :, :, 0] | (c6[:, :, :, :, 1] << 4)).transpose(0, 2, 3, 1, 4)
    packed = np.ascontiguousarray(c).reshape(panels, chunks, -1)
    scales = p.scales.astype(np.float16)
    if not np.array_equal(scales.astype(np.float32), p.scales):
        raise ValueError("MatMulQ's scales are float16: these blocks' scales are not all float16 values "
                         "(quant.quantize rounds its scales to float16; GGUF's d are float16)")
    return PanelWeights(p.bits, p.block, p.n, p.k, packed, _panel_major(scales.reshape(p.n, kb), panels),
                        None if p.block_min is None else _panel_major(p.block_min, panels))


def _panel_major(per_block: np.ndarray, panels: int) -> np.ndarray:
    """``[N, kb]`` → ``[P, kb, 16]`` in ``per_block``'s dtype, padding columns 0."""
    n, kb = per_block.shape
    out = np.zeros((panels * PANEL, kb), per_block.dtype)
    out[:n] = per_block
    return np.ascontiguousarray(out.reshape(panels, PANEL, kb).transpose(0, 2, 1))


def unpack(w: PanelWeights) -> np.ndarray:
    """The float32 weight ``[N, K]`` a panel16 matrix stands for (the layout read back, for tests)."""
    panels, chunks, _ = w.codes.shape
    if w.bits == 8:
        c = w.codes.reshape(panels, chunks, 8, PANEL, 4).transpose(0, 3, 1, 2, 4)
    else:
        b = w.codes.reshape(panels, chunks, 4, PANEL, 4)
        c = np.stack([b & 15, b >> 4], axis=3).transpose(0, 4, 1, 2, 3, 5)  # [P, cols, chunk, h, half, e]
    codes = c.reshape(panels * PANEL, chunks * CHUNK).astype(np.float32)
    kb = w.scales.shape[1]
    scales = w.scales.transpose(0, 2, 1).reshape(-1, kb)
    out = (codes.reshape(-1, kb, w.block) - (1 << (w.bits - 1))) * scales.astype(np.float32)[..., None]
    if w.offsets is not None:
        out += w.offsets.transpose(0, 2, 1).reshape(-1, kb)[..., None]
    return out.reshape(panels * PANEL, -1)[:w.n, :w.k]


def to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 → bfloat16 bits (uint16), round to nearest even (NaN stays NaN), as the kernel rounds activations."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    out = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    out[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
    return out


def pack_bf16(w: np.ndarray) -> np.ndarray:
    """``W [N, K]`` (float) in MatMulBF16's layout (runtime/ort/kernels/bgemm.cpp): uint16 ``[P, Kp/2, 32]``,
    element ``[p, i, 2c + e] = bf16(W[16p + c, 2i + e])``; N padded to whole panels and K to even, with zeros."""
    n, k = w.shape
    panels, kp = cdiv(n, PANEL), k + (k % 2)
    padded = np.zeros((panels * PANEL, kp), np.float32)
    padded[:n, :k] = w
    b = to_bf16(padded).reshape(panels, PANEL, kp // 2, 2).transpose(0, 2, 1, 3)  # [P, pair, col, e]
    return np.ascontiguousarray(b).reshape(panels, kp // 2, 2 * PANEL)


def pack_f32(w: np.ndarray) -> np.ndarray:
    """``W [N, K]`` (float) in MatMulF32's layout (runtime/ort/kernels/fgemm_generic.cpp): float32 ``[P, K, 16]``,
    element ``[p, k, c] = W[16p + c, k]``; N padded to whole panels with zero columns. Values unchanged."""
    n, k = w.shape
    panels = cdiv(n, PANEL)
    padded = np.zeros((panels * PANEL, k), np.float32)
    padded[:n] = w
    return np.ascontiguousarray(padded.reshape(panels, PANEL, k).transpose(0, 2, 1))


def unpack_f32(w: np.ndarray, n: int, k: int) -> np.ndarray:
    """The float32 weight ``[N, K]`` a MatMulF32 layout holds (for tests)."""
    return w.transpose(0, 2, 1).reshape(-1, w.shape[1])[:n, :k]


def unpack_bf16(codes: np.ndarray, n: int, k: int) -> np.ndarray:
    """The float32 weight ``[N, K]`` a MatMulBF16 layout stands for (for tests)."""
    panels, pairs, _ = codes.shape
    b = codes.reshape(panels, pairs, PANEL, 2).transpose(0, 2, 1, 3).reshape(panels * PANEL, pairs * 2)
    return (b.astype(np.uint32) << 16).view(np.float32)[:n, :k]
