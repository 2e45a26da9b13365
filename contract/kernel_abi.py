"""What the ORT lowering and omforge's kernel library (``runtime/ort/kernels``) agree on: the custom-op domain, the op
contract's version and the head sizes the kernels are instantiated for. Dependency-free (stdlib only), so the
passes read them without importing the runtime."""

from __future__ import annotations

DOMAIN = "omforge.kernels"
ABI_VERSION = 8
"""The op contract version this Python side speaks; the library reports its own (must match)."""
HEAD_DIMS = (16, 32, 64, 96, 128, 256)
"""Head sizes the kernel is instantiated for (``runtime/ort/kernels/head_dims.h`` lists the same, and the built library
reports them); the lowering keeps plain ops for any other."""
WEIGHT_LAYOUT = 2
"""The packed weight layout ``MatMulQ`` reads (runtime/ort/kernels/qgemm.h ``kPanelLayout``; passes/gemm_pack.py
writes it; 2: float16 scales). A bundle records it; a library reading another version refuses the bundle in one line."""
