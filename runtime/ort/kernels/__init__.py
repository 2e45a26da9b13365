"""Loading omforge's native CPU kernels for ONNX Runtime, a custom-op library in domain :data:`DOMAIN`.

The library (``_omforge_kernels*.so`` beside this file, built from the C++ sources here by ``setup.py``, or
``$OMFORGE_KERNELS_LIBRARY``) registers ``PagedAttention``, ``PagedAttentionBF16`` and ``PagedAttentionInt8``
(fp32, bf16 and int8 KV pools), ``SwiGLU``, ``AddRMSNorm``, ``MatMulQ`` (block-quantized weights × int8
activations, its weights in the packed layout of ``qgemm.h``), ``MatMulQBF16`` (the same weights × bfloat16
activations), ``MatMulBF16`` (bfloat16 weights), ``MatMulF32`` (float32 weights in column panels),
``LoraAdd`` (each token's LoRA term from adapter pools, tokens grouped by slot; since ABI 6) and ``MoEF32`` /
``MoEBF16`` / ``MoEQ`` (a mixture-of-experts block, tokens grouped by expert; since ABI 9); their contracts are at
the top of ``custom_op.cpp``, ``qgemm_op.h``, ``lora.h`` and ``moe.h``, and what the lowering shares of them (domain,
ABI version, head dims) lives in :mod:`omforge.contract.kernel_abi`. It receives ORT's API table at registration and
declares the few ABI facts it uses itself (``ort_abi.h``), so it needs no ORT headers and loads on any ORT >=
:data:`MIN_ORT`.

Nothing here is required: :func:`status` (probed in :mod:`omforge.contract.kernel_library`, which compile reads
too) says whether the library is usable in this process (built, ORT recent enough, loadable, the same kernel ABI
version) and why not; compile then falls back to the plain-op lowering, and a bundle that needs the library fails
to load with one clear line (:func:`check_bundle`). :func:`register` adds it to a session's options.
``OMFORGE_KERNELS=0`` disables the library (tests of the fallback); ``OMFORGE_KERNELS_ISA`` (``amx``, ``avx512bf16``,
``avx512``, ``avxvnni``, ``avx2``, ``generic``) forces a slower code path than the CPU allows (``avx512``: the bfloat16
ops on ``vdpbf16ps`` rather than the AMX tile unit, and PagedAttention over bfloat16 pools in float32 FMAs rather than
``vdpbf16ps``: the ``avx512bf16`` attention path); ``isa.h`` reads it once, and each op's table of paths (in
``custom_op.cpp``, ``lora_op.cpp``, ``qgemm_op.cpp``) names the values that allow each path.
"""

from __future__ import annotations

import logging
from pathlib import Path

from omforge.contract.kernel_abi import ABI_VERSION, DOMAIN
from omforge.contract.kernel_abi import HEAD_DIMS as HEAD_DIMS
from omforge.contract.kernel_library import MIN_ORT as MIN_ORT
from omforge.contract.kernel_library import KernelStatus as KernelStatus
from omforge.contract.kernel_library import library_path as library_path
from omforge.contract.kernel_library import status
from omforge.contract.manifest import BundleError, KernelLibrary

log = logging.getLogger("omforge.ort")

# the weight GEMM ops and the KernelStatus field naming the ISA path each runs on here
GEMM_PATHS = {"MatMulQ": "gemm", "MatMulQBF16": "qbf16", "MatMulBF16": "bf16", "MatMulF32": "f32"}


def portable_gemms(op_histogram: dict[str, int]) -> list[str]:
    """The weight GEMM ops in a step graph's op histogram (``domain::op``) that this library runs on its portable
    path: the bundle was compiled where a vector path ran and this CPU lacks it, or (MatMulBF16: bfloat16 weights
    always lower to it) a CPU without AVX2 has none. Correct (the same sums), and several times slower."""
    s = status()
    return [op for op, attr in GEMM_PATHS.items()
            if op_histogram.get(f"{DOMAIN}::{op}") and getattr(s, attr) == "generic"]


def check_bundle(bundle: Path, needs: KernelLibrary | None, op_histogram: dict[str, int]) -> None:
    """Refuse, in one line, a bundle compiled for this library (``needs``: its manifest's ``kernels``) that the
    library here cannot run — unavailable, a newer kernel ABI (older bundles run: the ops keep their forms), another
    packed weight layout — before ONNX Runtime sees its graph; warn once when its weight GEMMs will run on the
    portable path here (:func:`portable_gemms`). A bundle that needs nothing of the library passes."""
    if needs is None:
        return
    s = status()
    if not s.available:
        raise BundleError(f"{bundle}: compiled for omforge's CPU kernel library (paged attention), which is "
                          f"unavailable here: {s.reason}; or recompile the bundle on this machine")
    if (needs.abi or 0) > ABI_VERSION:
        raise BundleError(f"{bundle}: compiled for kernel ABI {needs.abi}, this omforge's kernel library "
                          f"speaks ABI {ABI_VERSION}; upgrade omforge or recompile the bundle with it")
    if needs.weight_layout not in (None, s.weight_layout):
        raise BundleError(f"{bundle}: its weights are packed in MatMulQ layout version {needs.weight_layout}, "
                          f"this kernel library reads version {s.weight_layout}; recompile it")
    slow = portable_gemms(op_histogram)
    if slow:  # compiled on a CPU of this ISA (bfloat16 weights always lower to MatMulBF16): recompiling cannot help
        advice = ("this CPU has no vector path for them: float32, int8 or int4 weights run faster here"
                  if needs.isa == s.isa else "recompile the bundle on this machine")
        log.warning("%s: its weight GEMMs (%s) run on the kernel library's portable path on this CPU (compiled "
                    "where its ISA path was %s): correct but several times slower; %s", bundle, ", ".join(slow),
                    needs.isa, advice)


def register(options) -> None:  # noqa: ANN001 - onnxruntime.SessionOptions
    """Register the library's ops with ``options``; raises RuntimeError naming the reason if unavailable."""
    s = status()
    if not s.available:
        raise RuntimeError(f"omforge kernel library unavailable: {s.reason}")
    options.register_custom_ops_library(s.path)
