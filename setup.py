"""Builds omforge's native kernel library (runtime/ort/kernels/*.cpp) with the normal install.

Everything else is declared in pyproject.toml. The library is a plain shared object that ONNX Runtime loads
as a custom-op library (it is not a Python module and needs no Python or ORT headers). It is optional:
when it cannot be built (no C++ compiler, another platform) the install goes on without it, and compile
falls back to the plain-op lowering (see omforge.runtime.ort.kernels).
"""

import os

from setuptools import Extension, setup

# OMFORGE_KERNELS_DEBUG=1: with symbols and line tables, unstripped (perf annotate, gdb); the same -O3 code
PROFILE_BUILD = os.environ.get("OMFORGE_KERNELS_DEBUG") == "1"

SOURCES = ("custom_op", "pa_avx512", "pa_avx512bf16", "pa_avx2", "pa_generic", "qgemm_op", "qgemm_avx512",
           "qgemm_avx2", "qgemm_generic", "qgemm_amx", "bgemm_avx512", "bgemm_amx", "bgemm_avx2", "bgemm_generic",
           "qbgemm_avx512", "qbgemm_generic", "fgemm_avx512", "fgemm_generic",
           "lora_op", "lora_avx512", "lora_avx2", "lora_generic", "moe_op", "moe_avx2")
HEADERS = ("ort_abi", "ort_tensor", "bf16", "amx", "isa", "head_dims", "paged_attention", "paged_attention_impl",
           "pa_avx512_vec", "qgemm", "qgemm_op", "qgemm_avx2_impl", "avx512_reduce", "avx512_tile", "lora", "lora_impl",
           "moe")
KERNELS = Extension(
    "omforge.runtime.ort.kernels._omforge_kernels",
    sources=[f"runtime/ort/kernels/{name}.cpp" for name in SOURCES],
    depends=[f"runtime/ort/kernels/{name}.h" for name in HEADERS],
    language="c++",
    extra_compile_args=["-O3", "-std=c++17", "-fvisibility=hidden", "-Wno-maybe-uninitialized"]
    + (["-g"] if PROFILE_BUILD else []),
    extra_link_args=[] if PROFILE_BUILD else ["-s"],  # stripped: the wheel carries ~1 MB instead of ~7
    optional=True,
)

setup(ext_modules=[KERNELS])
