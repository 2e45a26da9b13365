"""Whether omforge's CPU kernel library is usable in this process (:func:`status`), which both sides read: compile
to choose the kernel lowering and record what a bundle needs (the manifest's ``kernels``), the runtime
(:mod:`omforge.runtime.ort.kernels`) to register it with ONNX Runtime and to refuse a bundle it cannot run.

The library is ``_omforge_kernels*.so``, which ``setup.py`` builds into ``runtime/ort/kernels/`` beside its C++
sources, or ``$OMFORGE_KERNELS_LIBRARY``. The probe loads it with ctypes and asks its ``omforge_kernels_info``
(kernel ABI, each op's ISA path, the packed weight layout); it reads onnxruntime's version from the installed
distribution's metadata, so it stays dependency-free (stdlib only) and compile never imports the runtime.
``OMFORGE_KERNELS=0`` disables the library (tests of the fallback); ``OMFORGE_KERNELS_ISA`` (``amx``,
``avx512bf16``, ``avx512``, ``avxvnni``, ``avx2``, ``generic``) forces a slower code path than the CPU allows (read
once by the library itself, runtime/ort/kernels/isa.h; each op's table says which values allow which path).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.metadata
import os
from dataclasses import dataclass
from pathlib import Path

from omforge.contract.kernel_abi import ABI_VERSION, DOMAIN
from omforge.contract.manifest import KernelLibrary

MIN_ORT = (1, 17)
"""The oldest onnxruntime whose API table the library's registration uses (``ort_abi.h``)."""
LIBRARY_DIR = Path(__file__).resolve().parent.parent / "runtime" / "ort" / "kernels"
"""Where ``setup.py`` builds the library (``omforge.runtime.ort.kernels._omforge_kernels``): a file, not an import."""


@dataclass(frozen=True)
class KernelStatus:
    """Whether the library can be used here; ``reason`` says why not when ``available`` is False."""

    available: bool
    path: str | None = None
    abi: int | None = None
    isa: str | None = None
    reason: str = ""
    gemm: str | None = None  # MatMulQ's ISA path (avx512vnni, avxvnni, avx2, generic)
    bf16: str | None = None  # MatMulBF16's ISA path (avx512bf16, generic)
    qbf16: str | None = None  # MatMulQBF16's ISA path (MatMulBF16's); None: a library from before the op
    f32: str | None = None  # MatMulF32's ISA path (avx512f, generic)
    lora: str | None = None  # LoraAdd's ISA path (avx512, avx2, generic)
    moe_f32: str | None = None  # MoEF32's GEMM path (avx512f, avx2, generic; MoEBF16 and MoEQ take bf16's and gemm's)
    weight_layout: int | None = None  # the packed weight layout version MatMulQ reads

    def manifest_entry(self, weight_layout: bool = False) -> KernelLibrary:
        """The manifest's ``kernels`` section: what a bundle compiled against this library needs (``weight_layout``:
        the bundle's weight MatMuls are this library's ``MatMulQ``, so its packed layout version is recorded)."""
        return KernelLibrary(Path(self.path).name.split(".")[0] if self.path else None, DOMAIN, self.abi, self.isa,
                             self.weight_layout if weight_layout else None)


def library_path() -> Path | None:
    """The built library: ``$OMFORGE_KERNELS_LIBRARY`` or the ``_omforge_kernels*.so`` in :data:`LIBRARY_DIR`."""
    override = os.environ.get("OMFORGE_KERNELS_LIBRARY")
    if override:
        return Path(override) if Path(override).is_file() else None
    found = sorted(LIBRARY_DIR.glob("_omforge_kernels*.so"))
    return found[0] if found else None


def _ort_version() -> tuple[int, int] | None:
    """onnxruntime's (major, minor) from its distribution (``onnxruntime``, or whichever build provides the module,
    e.g. ``onnxruntime-gpu``) without importing it; None when none is installed."""
    try:
        version = importlib.metadata.version("onnxruntime")
    except importlib.metadata.PackageNotFoundError:
        dists = importlib.metadata.packages_distributions().get("onnxruntime")
        if not dists:
            return None
        version = importlib.metadata.version(dists[0])
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


@functools.cache
def status() -> KernelStatus:
    """Probe the library once per process (its ISA choice is fixed at load)."""
    if os.environ.get("OMFORGE_KERNELS", "1") == "0":
        return KernelStatus(False, reason="disabled by OMFORGE_KERNELS=0")
    path = library_path()
    if path is None:
        return KernelStatus(False, reason="the kernel library was not built (no C++ compiler at install time, or "
                                          "not an x86-64/GCC platform); reinstall omforge with g++ available")
    ort = _ort_version()
    if ort is None:
        return KernelStatus(False, str(path), reason="onnxruntime is not installed")
    if ort < MIN_ORT:
        return KernelStatus(False, str(path), reason=f"onnxruntime {'.'.join(map(str, ort))} is older "
                                                     f"than {'.'.join(map(str, MIN_ORT))}")
    try:
        lib = ctypes.CDLL(str(path))
        lib.omforge_kernels_info.restype = ctypes.c_char_p
        fields = dict(kv.split("=", 1) for kv in lib.omforge_kernels_info().decode().split())
    except (OSError, AttributeError) as e:
        return KernelStatus(False, str(path), reason=f"cannot load {path.name}: {e}")
    abi = int(fields["abi"])
    if abi != ABI_VERSION:
        return KernelStatus(False, str(path), abi, fields.get("isa"),
                            reason=f"{path.name} speaks kernel ABI {abi}, this omforge {ABI_VERSION}; "
                                   "reinstall omforge")
    return KernelStatus(True, str(path), abi, fields["isa"], gemm=fields.get("gemm"), bf16=fields.get("bf16"),
                        qbf16=fields.get("qbf16"), f32=fields.get("f32"), lora=fields.get("lora"),
                        moe_f32=fields.get("moe_f32"),
                        weight_layout=int(fields["layout"]) if "layout" in fields else None)
