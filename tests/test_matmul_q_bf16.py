"""The native ``MatMulQBF16`` GEMM (runtime/ort/kernels/qbgemm_*.cpp): MatMulQ's panel16 weights decompressed to
bfloat16 per call, activations rounded to bfloat16, MatMulBF16's tiles. Against a float64 reference of its formula
and against the float product, for 4- and 8-bit codes, blocks of 32 / 64 / 128, symmetric and affine, GGUF blocks as
they are, M = 1 … 256 and partial panels and blocks; the portable path bit for bit against the vector one; its
errors; and ``quantization.activations: bfloat16`` end to end (tiny model; SmolLM2 from its own Q4_1 blocks)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from helpers import SMOLLM2_RECIPE, TINY_RECIPE, compile_bundle
from kernel_reference import forced_isa_outputs, matmul_q_bf16_reference, matmul_q_model
from kernel_reference import kernel_session as session
from omforge.passes import gemm_pack, quant
from omforge.runtime.ort import kernels

_WHY = kernels.status().reason or "no MatMulQBF16 (a library from before it)"
pytestmark = pytest.mark.skipif(not kernels.status().qbf16, reason=f"kernel library: {_WHY}")


def check(packed: quant.Packed, rows: tuple[int, ...], seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    s = session(matmul_q_model(gemm_pack.pack(packed), op="MatMulQBF16"))
    dense = quant.dequantize(packed).astype(np.float64)
    for m in rows:
        x = rng.standard_normal((m, packed.k)).astype(np.float32)
        x[0, : min(packed.k, 40)] *= 30  # an outlier: bfloat16 keeps relative precision per element, no chunk scale
        y = s.run(None, {"x": x})[0]
        ref = matmul_q_bf16_reference(x, packed)
        scale = np.abs(ref).max()
        assert y.shape == (m, packed.n)
        assert np.abs(y - ref).max() <= 2e-6 * scale, (m, np.abs(y - ref).max() / scale)  # float32 sums, exact products
        # bfloat16 weights and activations: within 1% of the float product (measured ~0.2–0.3%)
        assert np.abs(y - x.astype(np.float64) @ dense.T).max() <= 0.01 * scale


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("block", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "affine"])
def test_rtn_weights(bits: int, block: int, symmetric: bool) -> None:
    w = np.random.default_rng(bits + block).standard_normal((45, 2 * block + 40)).astype(np.float32)
    check(quant.quantize(w, bits, block, symmetric), rows=(1, 2, 5, 8, 9, 13, 64))


@pytest.mark.parametrize("m", [1, 8, 16, 32, 64, 128, 256])
@pytest.mark.parametrize("bits", [4, 8])
def test_row_counts_on_a_model_shape(m: int, bits: int) -> None:
    """SmolLM2's down projection (K 1536, N 576), affine like Q4_1: every 8-row tile remainder."""
    w = np.random.default_rng(m).standard_normal((576, 1536)).astype(np.float32)
    check(quant.quantize(w, bits, 32, symmetric=False), rows=(m, m + 5 if m < 256 else m - 3))


def test_a_wide_output() -> None:
    """N ≥ 8,192 (an lm_head) goes out through MatMulBF16's streaming stores, the partial last panel masked."""
    w = np.random.default_rng(3).standard_normal((8192 + 16 + 5, 64)).astype(np.float32)
    check(quant.quantize(w, 4, 32, symmetric=False), rows=(1, 9, 64))


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_as_they_are(kind: str) -> None:
    from test_matmul_q import _gguf_rows

    rng = np.random.default_rng(3)
    check(quant.from_gguf(kind, _gguf_rows(kind, 70, 192, rng), 192), rows=(1, 9, 33))


def _child_outputs(tmp_path: Path, isa: str, n: int) -> np.ndarray | None:
    """MatMulQBF16 on models m0..m{n-1} and x.npy in tmp_path with OMFORGE_KERNELS_ISA=isa (kernel_reference)."""
    return forced_isa_outputs(tmp_path, isa, "qbf16", {"generic": "generic", "avx2": "avx2"}.get(isa, "avx512bf16"), n)


def test_the_portable_path_gives_the_same_bits(tmp_path: Path) -> None:
    """The portable path, forced in a child process: the same bfloat16 weights (one fma, one rounding) and the same
    products added in the same order as vdpbf16ps — the AVX-512 and AVX2 paths' bits exactly (no denormals here).
    The AMX path (the default where the CPU has it) sums the same products in another order: within float32 rounding."""
    rng = np.random.default_rng(11)
    cases = [quant.quantize(rng.standard_normal((50, 300)).astype(np.float32), bits, 64, sym)
             for bits in (4, 8) for sym in (True, False)]
    x = rng.standard_normal((13, 300)).astype(np.float32)
    for i, p in enumerate(cases):
        (tmp_path / f"m{i}.onnx").write_bytes(matmul_q_model(gemm_pack.pack(p), op="MatMulQBF16").SerializeToString())
    np.save(tmp_path / "x.npy", x)
    portable = _child_outputs(tmp_path, "generic", len(cases))
    for isa in ("avx2", "avx512"):  # AVX2: widened operands, two FMAs a pair, high first — the same sums
        vector = _child_outputs(tmp_path, isa, len(cases))
        if vector is not None:
            assert np.array_equal(portable, vector), isa
    here = np.stack([session(matmul_q_model(gemm_pack.pack(p), op="MatMulQBF16")).run(None, {"x": x})[0]
                     for p in cases])
    if kernels.status().qbf16 in ("generic", "avx2", "avx512bf16"):
        assert np.array_equal(portable, here)
    else:  # the tile unit: float32 sums of the same exact products, another order
        assert np.abs(here - portable).max() <= 1e-5 * np.abs(portable).max()


def test_zero_rows_and_a_zero_input() -> None:
    rng = np.random.default_rng(2)
    packed = quant.quantize(rng.standard_normal((20, 64)).astype(np.float32), 4, 32, symmetric=False)
    s = session(matmul_q_model(gemm_pack.pack(packed), op="MatMulQBF16"))
    assert s.run(None, {"x": np.zeros((0, 64), np.float32)})[0].shape == (0, 20)
    assert np.array_equal(s.run(None, {"x": np.zeros((3, 64), np.float32)})[0], np.zeros((3, 20), np.float32))


@pytest.mark.parametrize("attrs, message", [
    ({"layout": 7}, "MatMulQBF16: weight layout version 7 is not known"),
    ({"bits": 3}, "MatMulQBF16: bits must be 4 or 8"),
    ({"block_size": 16}, "MatMulQBF16: block_size must be 32, 64 or 128"),
    ({"K": 65}, r"MatMulQBF16: x must be float32 \[\.\.\., 65\]"),
    ({"N": 40}, r"MatMulQBF16: codes must be uint8 \[3, 2, 256\]"),
])
def test_errors_name_the_op_and_what_is_wrong(attrs: dict, message: str) -> None:
    packed = quant.quantize(np.random.default_rng(0).standard_normal((20, 64)).astype(np.float32), 4, 32)
    with pytest.raises(Exception, match=message):
        s = session(matmul_q_model(gemm_pack.pack(packed), op="MatMulQBF16", **attrs))
        s.run(None, {"x": np.zeros((2, 64), np.float32)})


def test_a_bfloat16_activation_bundle(tmp_path: Path) -> None:
    """``weights: int4`` + ``activations: bfloat16`` on the tiny model: every weight MatMul is MatMulQBF16, the
    manifest records the activations, and the first greedy logprob follows the int8-activation bundle's."""
    from omforge import LLM, SamplingParams

    bundles = {}
    for act in ("bfloat16", "int8"):
        recipe = tmp_path / f"tiny-{act}.yaml"
        recipe.write_text(TINY_RECIPE.read_text().replace(
            "compile:\n", f"compile:\n  weights: int4\n  quantization:\n    activations: {act}\n"))
        bundles[act] = compile_bundle(recipe, tmp_path / act, tmp_path / "cache")
    weights = json.loads((bundles["bfloat16"] / "manifest.json").read_text())["weights"]
    assert (weights["gemm"], weights["activations"], weights["accuracy_level"]) == ("MatMulQBF16", "bfloat16", None)
    ops = json.loads((bundles["bfloat16"] / "manifest.json").read_text())["passes"]["op_histogram"]
    assert ops["omforge.kernels::MatMulQBF16"] == 2 * 4 + 1 and "omforge.kernels::MatMulQ" not in ops
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    with LLM(bundles["bfloat16"]) as a, LLM(bundles["int8"]) as b:
        x, y = (llm.generate([[5, 6, 7, 8]], params)[0] for llm in (a, b))
    assert len(x.token_ids) == 8
    assert abs(x.logprobs[0].logprob - y.logprobs[0].logprob) < 0.05


def test_smollm2_from_its_own_q4_1_blocks(smollm2_cache: Path, smollm2_export: Path, smollm2_bundle: Path,
                                          tmp_path: Path) -> None:
    """SmolLM2's Q4_1 blocks as they are (the Q8_0 tied lm_head stays 8-bit) with bfloat16 activations: every
    weight MatMul is MatMulQBF16, and the logits follow the float32 bundle of the same blocks within bfloat16
    rounding (MatMulBF16's bundle: max |Δlogit| 0.61) on 5 chat prompts."""
    from omforge.diff.bundles import CHAT_PROMPTS, diff_bundles

    recipe = tmp_path / "smollm2-int4-bf16.yaml"
    recipe.write_text(SMOLLM2_RECIPE.read_text().replace(
        "compile:\n", "compile:\n  weights: int4\n  quantization:\n    activations: bfloat16\n"))
    bundle = compile_bundle(recipe, tmp_path / "bundle", smollm2_cache)
    manifest = json.loads((bundle / "manifest.json").read_text())
    quantized = manifest["weights"]["quantized"]
    assert sum(v["source"] == "gguf Q4_1" for v in quantized.values()) == 30 * 4
    assert sorted({v["source"] for v in quantized.values()}) == ["gguf Q4_1", "gguf Q8_0"]
    assert manifest["passes"]["op_histogram"]["omforge.kernels::MatMulQBF16"] == 30 * 4 + 1
    d = diff_bundles(smollm2_bundle, bundle, prompts=CHAT_PROMPTS[:5], max_tokens=24)
    assert max(p.max_abs for p in d.prompts) <= 1.0, [p.max_abs for p in d.prompts]
    assert min(p.top1_agreement for p in d.prompts) >= 0.9, [p.top1_agreement for p in d.prompts]
