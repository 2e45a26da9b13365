"""What the ORT lowering and omforge's kernel library (``runtime/ort/kernels``) agree on: the custom-op domain, the op
contract's version and the head sizes the kernels are instantiated for. Dependency-free (stdlib only), so the
passes read them without importing the runtime."""

from __future__ import annotations

DOMAIN = "omforge.kernels"
ABI_VERSION = 9
"""The op contract version this Python side speaks; the library reports its own (must match)."""
HEAD_DIMS = (16, 32, 64, 96, 128, 256)
"""Head sizes the kernel is instantiated for (``runtime/ort/kernels/head_dims.h`` lists the same, and the built library
reports them); the lowering keeps plain ops for any other."""
MOE_OPS = {"float32": "MoEF32", "bfloat16": "MoEBF16", "int8": "MoEQ", "int4": "MoEQ"}
"""The mixture-of-experts op per expert weight precision (runtime/ort/kernels/moe.h; passes/moe_kernel.py packs their
weights in :data:`WEIGHT_LAYOUT`'s MatMul layouts, gate and up interleaved by panel; since ABI 9)."""
WEIGHT_LAYOUT = 2
"""The packed weight layout ``MatMulQ`` reads (runtime/ort/kernels/qgemm.h ``kPanelLayout``; passes/gemm_pack.py
writes it; 2: float16 scales). A bundle records it; a library reading another version refuses the bundle in one line."""
