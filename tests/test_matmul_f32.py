"""The native ``MatMulF32`` GEMM (runtime/ort/kernels/fgemm_*.cpp) and its layout (passes/gemm_pack.py): bit for bit
the contract's sums (one fma per k, in k order) computed here in numpy, and within float32 rounding of float64
products; odd K, partial panels, M = 1 … 130, a wide output, the portable path in a child process, the layout read
back, errors; and float32 weights end to end on the tiny model (every weight MatMul of the paged step lowered to it
where the AVX-512 path runs, the unpaged graph of ``omforge diff`` left on ORT's MatMul; on a CPU without that
path the bundle runs on the portable one and the engine says so)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers import TINY_RECIPE, compile_bundle
from kernel_reference import kernel_session as session
from kernel_reference import matmul_f32_model
from omforge.contract import cdiv
from omforge.passes import gemm_pack
from omforge.runtime.ort import kernels

pytestmark = pytest.mark.skipif(not kernels.status().f32, reason=f"kernel library: {kernels.status().reason}")


def fma_in_k_order(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The contract's float32 sums: acc = fma(x[m, k], W[n, k], acc) for k = 0 … K-1 from 0 (each fma rounded once:
    the exact product plus acc in float64 is exact for float32 operands, then rounded to float32)."""
    acc = np.zeros((x.shape[0], w.shape[0]), np.float32)
    for k in range(x.shape[1]):
        acc = (np.multiply.outer(x[:, k].astype(np.float64), w[:, k].astype(np.float64)) + acc).astype(np.float32)
    return acc


def check(n: int, k: int, rows: tuple[int, ...], seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32)
    panels = gemm_pack.pack_f32(w)
    assert panels.shape == (cdiv(n, 16), k, 16) and np.array_equal(gemm_pack.unpack_f32(panels, n, k), w)
    s = session(matmul_f32_model(panels, n, k))
    for m in rows:
        x = rng.standard_normal((m, k)).astype(np.float32)
        y = s.run(None, {"x": x})[0]
        assert y.shape == (m, n)
        assert np.array_equal(y, fma_in_k_order(x, w)), m
        ref = x.astype(np.float64) @ w.T.astype(np.float64)
        assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max(), m


@pytest.mark.parametrize(("n", "k"), [(16, 1), (40, 97), (576, 576), (17, 1536)])
def test_the_contracts_sums(n: int, k: int) -> None:
    check(n, k, rows=(1, 3, 4, 8, 9, 16, 17, 33, 64, 130))


def test_a_wide_output() -> None:
    """N ≥ 8,192 (an lm_head's logits) is written with streaming stores: whole aligned panels, the partial last
    panel and an odd row stride through the ordinary masked store."""
    check(8192 + 16 + 5, 24, rows=(1, 9, 64))
    check(8192 + 32, 40, rows=(2, 16))


def test_the_portable_path() -> None:
    """The portable path forced in a child process gives the same bits (the same fma per k in k order)."""
    code = ("import sys, test_matmul_f32 as t; from omforge.runtime.ort import kernels; "
            "kernels.status().f32 == 'generic' or sys.exit(3); t.check(40, 97, (1, 9)); t.check(33, 64, (2, 17))")
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "OMFORGE_KERNELS_ISA": "generic"},
                       cwd=Path(__file__).parent, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def test_errors_name_what_is_wrong() -> None:
    panels = gemm_pack.pack_f32(np.ones((20, 64), np.float32))
    with pytest.raises(Exception, match="weight layout version 3 is not known"):
        session(matmul_f32_model(panels, 20, 64, layout=3))
    with pytest.raises(Exception, match=r"w must be float32 \[3, 64, 16\]"):
        session(matmul_f32_model(panels, 40, 64)).run(None, {"x": np.zeros((1, 64), np.float32)})


@pytest.mark.skipif(kernels.status().f32 != "avx512f", reason="float32 weights are lowered to MatMulF32 only where "
                    "its AVX-512 path runs (elsewhere ORT's MatMul is faster)")
def test_a_float32_bundle(tmp_path: Path) -> None:
    """The tiny model's default float32 bundle: every weight MatMul is MatMulF32 (the manifest says so and records
    the weight layout); with compile.float_gemm: MatMul the same bundle keeps ORT's MatMul, and both give the same
    greedy tokens with logprobs within float32 rounding."""
    import json

    from omforge import LLM, SamplingParams

    bundle = compile_bundle(TINY_RECIPE, tmp_path / "f32", tmp_path / "cache")
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["weights"]["precision"] == "float32" and manifest["weights"]["gemm"] == "MatMulF32"
    assert manifest["kernels"]["weight_layout"] == kernels.status().weight_layout
    ops = manifest["passes"]["op_histogram"]
    assert ops["omforge.kernels::MatMulF32"] == 2 * 4 + 1 and "MatMul" not in ops

    recipe = tmp_path / "tiny-mlas.yaml"
    recipe.write_text(TINY_RECIPE.read_text().replace("compile:\n", "compile:\n  float_gemm: MatMul\n"))
    mlas = compile_bundle(recipe, tmp_path / "mlas", tmp_path / "cache")
    manifest = json.loads((mlas / "manifest.json").read_text())
    assert "gemm" not in manifest["weights"] and manifest["kernels"].get("weight_layout") is None
    ops = manifest["passes"]["op_histogram"]
    assert ops["MatMul"] >= 2 * 4 + 1 and "omforge.kernels::MatMulF32" not in ops

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    with LLM(bundle) as a, LLM(mlas) as b:
        x, y = (llm.generate([[5, 6, 7, 8], [9, 10]], params) for llm in (a, b))
    for p, q in zip(x, y):
        assert p.token_ids == q.token_ids and len(p.token_ids) == 8
        assert all(abs(u.logprob - v.logprob) < 1e-4 for u, v in zip(p.logprobs, q.logprobs))

    # on a CPU without the AVX-512 path (forced here) the bundle still runs, on the portable path, and says so once
    code = ("import json; from omforge import LLM, SamplingParams; "
            "p = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1); "
            f"llm = LLM({str(bundle)!r}); "
            "print(json.dumps([[o.token_ids, [e.logprob for e in o.logprobs]] "
            "for o in llm.generate([[5, 6, 7, 8], [9, 10]], p)])); llm.close()")
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "OMFORGE_KERNELS_ISA": "generic"},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stderr.count("run on the kernel library's portable path") == 1, r.stderr[-2000:]
    assert "MatMulF32" in r.stderr
    for p, (ids, logprobs) in zip(x, json.loads(r.stdout.strip().splitlines()[-1])):
        assert p.token_ids == ids
        assert all(abs(u.logprob - v) < 1e-4 for u, v in zip(p.logprobs, logprobs))
