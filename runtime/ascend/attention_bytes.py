"""The bytes a decode step's attention reads and writes on an ascend bundle, by paged-attention mode, beside the
paged floor — what ``omforge inspect`` prints. Pure arithmetic over the model's shape (docs/ascend-paged-attention.md
§4 derives the gather count op by op); nothing here has been measured on a device.

Symbols (per layer, decode: one query token per sequence): B sequences, ctx tokens of context each, kv KV heads,
Hq query heads, g = Hq / kv, D head_dim, s bytes per element, C = ctx rounded up to the block (the gather path pays
for whole blocks; at a gear it pays for the gear's ``max_blocks · block_size``, more again), E = B·C·kv·D·s.

- floor: a paged kernel reads each sequence's K and V once, ``2·B·ctx·kv·D·s``.
- ``gather``: ``Gather`` of the context (4E) → ``Concat`` of the step's rows behind it (4E: the context is copied;
  passes/decompose.py ``_attend_new_rows_concat``) → Transposes to heads (4E) → GQA Expand (2E + 2gE, g > 1) → kᵀ
  (2gE) → the two MatMuls' KV side (2gE), plus the int64 row indices (96·B·C) and the scores (8·B·Hq·C·s):
  ``14E + 6gE + 96·B·C + 8·B·Hq·C·s``.
- ``inplace``: FusedInferAttentionScore / IncreFlashAttention read the pool through the block table: the floor over
  whole blocks (2·B·C·kv·D·s), the block table (4·B·C/block_size), and the step's new rows, read and written once
  by ScatterPaKvCache (4·B·kv·D·s). [unverified: the kernels' own extra traffic, e.g. tiling, softmax state]
- ``readonly``: FusedInferAttentionScore reads the pool as it was through the block table (the floor over whole
  blocks and the table, as in place) and writes its log-sum-exp (float32, ``B·Hq`` per layer, read back by the
  merge: 8·B·Hq); the step's own rows are read by the plain-op attention (2·B·kv·D·s), written as ``kv_new``
  (2·B·kv·D·s) and copied into the pools by the executor (read and written: 4·B·kv·D·s).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from omforge.contract import cdiv

if TYPE_CHECKING:
    from omforge.contract.manifest import Manifest

MODES = ("gather", "inplace", "readonly")


@dataclass(frozen=True)
class AttentionShape:
    """What the count needs of a bundle: layers, query and KV heads, head_dim, bytes per KV element, block size."""

    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    block_size: int

    @classmethod
    def of(cls, m: Manifest) -> AttentionShape:
        """The shape of a generate bundle (ValueError, one line, for a bundle without a KV cache)."""
        if m.kv is None:
            raise ValueError("a pooling bundle has no KV cache: no decode step to count")
        cfg, kv = m.model.config, m.kv
        return cls(kv.num_layers, cfg.num_attention_heads, kv.kv_heads, kv.head_dim,
                   {"float32": 4, "float16": 2, "bfloat16": 2}.get(kv.dtype, 1), kv.block_size)


def paged_floor(shape: AttentionShape, batch: int, ctx: int) -> int:
    """``2·B·ctx·kv·D·s`` per layer, times the layers."""
    return shape.layers * 2 * batch * ctx * shape.kv_heads * shape.head_dim * shape.dtype_bytes


def step_bytes(mode: str, shape: AttentionShape, batch: int, ctx: int) -> int:
    """The bytes one decode step's attention moves in ``mode`` (see the module docstring), all layers."""
    if mode not in MODES:
        raise ValueError(f"paged-attention mode '{mode}' has no count here (have {', '.join(MODES)})")
    bs, s = shape.block_size, shape.dtype_bytes
    c = cdiv(ctx, bs) * bs
    row = shape.kv_heads * shape.head_dim * s
    if mode == "inplace":
        per_layer = 2 * batch * c * row + 4 * batch * (c // bs) + 4 * batch * row
    elif mode == "readonly":
        per_layer = 2 * batch * c * row + 4 * batch * (c // bs) + 8 * batch * shape.q_heads + 8 * batch * row
    else:
        g = shape.q_heads // shape.kv_heads
        e = batch * c * row
        expand = 2 * e + 2 * g * e if g > 1 else 0
        per_layer = 12 * e + expand + 4 * g * e + 96 * batch * c + 8 * batch * shape.q_heads * c * s
    return shape.layers * per_layer


def inspect_line(m: Manifest, batch: int, ctx: int) -> str:
    """One line for ``omforge inspect``: the bundle's mode, its bytes per decode step, the floor and their ratio."""
    mode = m.ascend.paged_attention if m.ascend is not None else "gather"
    shape = AttentionShape.of(m)
    floor = paged_floor(shape, batch, ctx)
    if mode not in MODES:
        return f"  attn bytes {mode}: not counted (not built); paged floor {_mib(floor)} per decode step"
    got = step_bytes(mode, shape, batch, ctx)
    return (f"  attn bytes {mode}: {_mib(got)} per decode step at batch {batch}, context {ctx} — {got / floor:.2f}× "
            f"the paged floor 2·B·ctx·kv·D·s × {shape.layers} layers = {_mib(floor)} (read from the sources, "
            "not measured)")


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"
