"""What an ort bundle needs of the kernel library, checked in runtime/ort (``kernels.check_bundle``, called by
``OrtExecutor.for_bundle``) before ONNX Runtime sees its graph: one line naming the bundle and the mismatch, and a
warning when its weight GEMMs will run on the portable path here. The library's status is stubbed, so these run
whether it is built or not."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from omforge.contract.manifest import BundleError, KernelLibrary
from omforge.runtime.ort import kernels
from omforge.runtime.ort.kernels import ABI_VERSION, DOMAIN, KernelStatus

BUNDLE = Path("/bundles/b")
HERE = KernelStatus(True, "/lib/_omforge_kernels.so", ABI_VERSION, "avx512", gemm="avx512vnni", bf16="avx512bf16",
                    qbf16="avx512bf16", f32="avx512f", weight_layout=2)
F32_GEMMS = {f"{DOMAIN}::MatMulF32": 9, f"{DOMAIN}::PagedAttention": 4}


def needs(abi: int = ABI_VERSION, weight_layout: int | None = None) -> KernelLibrary:
    return KernelLibrary("_omforge_kernels", DOMAIN, abi, "avx512", weight_layout)


def check(status: KernelStatus, library: KernelLibrary | None, ops: dict[str, int],
          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "status", lambda: status)
    kernels.check_bundle(BUNDLE, library, ops)


def test_a_bundle_this_library_runs_passes_quietly(monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    for library in (needs(), needs(ABI_VERSION - 1), needs(weight_layout=2), None):
        check(HERE, library, F32_GEMMS, monkeypatch)
    check(KernelStatus(False, reason="not built"), None, {}, monkeypatch)  # a plain-op bundle needs nothing
    assert not caplog.records


@pytest.mark.parametrize("status, library, message", [
    (KernelStatus(False, reason="disabled by OMFORGE_KERNELS=0"), needs(),
     f"{BUNDLE}: compiled for omforge's CPU kernel library (paged attention), which is unavailable here: disabled by "
     "OMFORGE_KERNELS=0; or recompile the bundle on this machine"),
    (HERE, needs(ABI_VERSION + 1), f"{BUNDLE}: compiled for kernel ABI {ABI_VERSION + 1}, this omforge's kernel "
     f"library speaks ABI {ABI_VERSION}; upgrade omforge or recompile the bundle with it"),
    (HERE, needs(weight_layout=99), f"{BUNDLE}: its weights are packed in MatMulQ layout version 99, this kernel "
     "library reads version 2; recompile it"),
])
def test_a_bundle_this_library_cannot_run_is_refused_in_one_line(status: KernelStatus, library: KernelLibrary,
                                                                 message: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(BundleError) as err:
        check(status, library, F32_GEMMS, monkeypatch)
    assert str(err.value) == message


def test_weight_gemms_on_the_portable_path_are_named_once(monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    portable = KernelStatus(True, HERE.path, ABI_VERSION, "generic", gemm="generic", bf16="generic", qbf16="generic",
                            f32="generic", weight_layout=2)
    with caplog.at_level(logging.WARNING, logger="omforge.ort"):
        check(portable, needs(), {**F32_GEMMS, f"{DOMAIN}::MatMulQ": 2}, monkeypatch)
    [record] = caplog.records
    assert "weight GEMMs (MatMulQ, MatMulF32) run on the kernel library's portable path" in record.getMessage()
    assert str(BUNDLE) in record.getMessage() and "ISA path was avx512" in record.getMessage()
    assert record.getMessage().endswith("recompile the bundle on this machine")


def test_bf16_weights_on_a_cpu_without_their_path_are_not_told_to_recompile(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """bfloat16 weights always lower to MatMulBF16: compiled on a CPU without AVX2 (no vector path of it) the advice
    is another weight type, not a recompile that would build the same bundle."""
    sse = KernelStatus(True, HERE.path, ABI_VERSION, "generic", gemm="generic", bf16="generic", qbf16="generic",
                       f32="generic", weight_layout=2)
    with caplog.at_level(logging.WARNING, logger="omforge.ort"):
        check(sse, KernelLibrary("_omforge_kernels", DOMAIN, ABI_VERSION, "generic"), {f"{DOMAIN}::MatMulBF16": 3},
              monkeypatch)
    [record] = caplog.records
    assert "(MatMulBF16) run on the kernel library's portable path" in record.getMessage()
    assert "no vector path for them" in record.getMessage() and "recompile" not in record.getMessage()
