"""The native ``MatMulBF16`` GEMM (runtime/ort/kernels/bgemm_*.cpp) and its layout (passes/gemm_pack.py): against
float64 products of the bfloat16-rounded weights and activations, odd K, partial panels, M = 1 … 64, the portable
path in a child process, the layout read back, errors; and ``compile.weights: bfloat16`` end to end on the tiny
model (every weight MatMul lowered to it, logits within bfloat16 rounding of the float32 bundle's)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers import TINY_RECIPE, compile_bundle
from kernel_reference import forced_isa_outputs, matmul_bf16_model
from kernel_reference import kernel_session as session
from omforge.passes import gemm_pack
from omforge.runtime.ort import kernels

pytestmark = pytest.mark.skipif(not kernels.status().bf16, reason=f"kernel library: {kernels.status().reason}")


def check(n: int, k: int, rows: tuple[int, ...], seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32)
    codes = gemm_pack.pack_bf16(w)
    wb = gemm_pack.unpack_bf16(codes, n, k).astype(np.float64)
    assert np.abs(wb - w).max() <= 2 ** -8 * np.abs(w).max()  # round to nearest: half an ulp of 8 bits
    s = session(matmul_bf16_model(codes, n, k))
    for m in rows:
        x = rng.standard_normal((m, k)).astype(np.float32)
        xb = gemm_pack.unpack_bf16(gemm_pack.pack_bf16(x), m, k).astype(np.float64)
        y = s.run(None, {"x": x})[0]
        ref = xb @ wb.T
        assert y.shape == (m, n)
        assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max(), m  # float32 sums of exact bf16 products


@pytest.mark.parametrize(("n", "k"), [(16, 2), (40, 97), (576, 576), (17, 1536)])
def test_against_the_rounded_product(n: int, k: int) -> None:
    check(n, k, rows=(1, 3, 8, 9, 16, 17, 33, 64))


def test_a_wide_output() -> None:
    """N ≥ 8,192 (an lm_head's logits) is written with streaming stores: whole aligned panels, the partial last
    panel and an odd row stride through the ordinary masked store."""
    check(8192 + 16 + 5, 64, rows=(1, 9, 64))
    check(8192 + 32, 40, rows=(2, 16))


@pytest.mark.parametrize(("isa", "want"), [("generic", "generic"), ("avx2", "avx2"), ("avx512", "avx512bf16")])
def test_the_slower_paths(isa: str, want: str) -> None:
    """The portable path and (where the CPU has them) the AVX2 and AVX-512 paths forced in a child process, when the
    default is another one (AMX tiles by default where the CPU has them)."""
    code = ("import sys, test_matmul_bf16 as t; from omforge.runtime.ort import kernels; "
            f"kernels.status().bf16 == {want!r} or sys.exit(3); t.check(40, 97, (1, 9)); "
            "t.check(33, 64, (2, 17))")
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "OMFORGE_KERNELS_ISA": isa},
                       cwd=Path(__file__).parent, capture_output=True, text=True, timeout=300)
    if r.returncode == 3:
        pytest.skip(f"this CPU has no {want} path")
    assert r.returncode == 0, r.stderr[-2000:]


def test_the_avx2_path_gives_the_portable_bits(tmp_path: Path) -> None:
    """AVX2 has no bfloat16 dot product: its path widens both operands and adds the pair's two products with two
    FMAs, high element first. A bfloat16 product is exact in float32, so that is the portable loop's sum bit for
    bit — over odd K, a partial panel, ragged rows, a wide output's streaming stores and a NaN."""
    rng = np.random.default_rng(5)
    n, k = 8192 + 16 + 7, 97
    w = rng.standard_normal((n, k)).astype(np.float32)
    x = rng.standard_normal((11, k)).astype(np.float32)
    x[3, 5] = np.nan
    x[4, :] *= 1e-3
    (tmp_path / "m0.onnx").write_bytes(matmul_bf16_model(gemm_pack.pack_bf16(w), n, k).SerializeToString())
    np.save(tmp_path / "x.npy", x)
    portable = forced_isa_outputs(tmp_path, "generic", "bf16", "generic", 1)[0]
    vector = forced_isa_outputs(tmp_path, "avx2", "bf16", "avx2", 1)
    if vector is None:
        pytest.skip("this CPU has no AVX2 + FMA")
    vector = vector[0]
    assert np.isnan(vector[3]).all() and not np.isnan(np.delete(vector, 3, axis=0)).any()
    assert np.array_equal(portable, vector, equal_nan=True)


def test_errors_name_what_is_wrong() -> None:
    codes = gemm_pack.pack_bf16(np.ones((20, 64), np.float32))
    with pytest.raises(Exception, match="weight layout version 3 is not known"):
        session(matmul_bf16_model(codes, 20, 64, layout=3))
    with pytest.raises(Exception, match=r"codes must be uint16 or bfloat16 \[3, 32, 32\]"):
        session(matmul_bf16_model(codes, 40, 64)).run(None, {"x": np.zeros((1, 64), np.float32)})
    with pytest.raises(Exception, match=r"codes must be uint16 or bfloat16 \[2, 32, 32\]"):  # the bits as int16
        session(matmul_bf16_model(codes.view(np.int16), 20, 64)).run(None, {"x": np.zeros((1, 64), np.float32)})


def test_panels_typed_bfloat16_are_the_same_bits() -> None:
    """The panels may be typed bfloat16 (a bundle's tied embedding gathers its rows from them with ONNX ops) as well
    as uint16: the same bits, the same products."""
    import ml_dtypes

    rng = np.random.default_rng(2)
    w, x = rng.standard_normal((40, 70)).astype(np.float32), rng.standard_normal((5, 70)).astype(np.float32)
    codes = gemm_pack.pack_bf16(w)
    as_u16 = session(matmul_bf16_model(codes, 40, 70)).run(None, {"x": x})[0]
    as_bf16 = session(matmul_bf16_model(codes.view(ml_dtypes.bfloat16), 40, 70)).run(None, {"x": x})[0]
    assert np.array_equal(as_u16, as_bf16)


def test_a_bfloat16_bundle(tmp_path: Path) -> None:
    """compile.weights: bfloat16 on the tiny model: every weight MatMul is MatMulBF16, the manifest says so, and
    greedy tokens and logits follow the float32 bundle within bfloat16 rounding."""
    import json

    from omforge import LLM, SamplingParams

    recipe = tmp_path / "tiny-bf16.yaml"
    recipe.write_text(TINY_RECIPE.read_text().replace("compile:\n", "compile:\n  weights: bfloat16\n"))
    bundle = compile_bundle(recipe, tmp_path / "bf16", tmp_path / "cache")
    fp32 = compile_bundle(TINY_RECIPE, tmp_path / "fp32", tmp_path / "cache")
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["weights"]["precision"] == "bfloat16" and manifest["weights"]["gemm"] == "MatMulBF16"
    assert manifest["kernels"]["weight_layout"] == kernels.status().weight_layout
    ops = manifest["passes"]["op_histogram"]
    assert ops["omforge.kernels::MatMulBF16"] == 2 * 4 + 1 and "MatMul" not in ops
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    with LLM(bundle) as a, LLM(fp32) as b:
        x, y = (llm.generate([[5, 6, 7, 8]], params)[0] for llm in (a, b))
    assert len(x.token_ids) == 8
    first = x.logprobs[0].logprob, y.logprobs[0].logprob
    assert abs(first[0] - first[1]) < 0.05, first
