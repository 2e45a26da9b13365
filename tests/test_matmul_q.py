"""The native ``MatMulQ`` GEMM (runtime/ort/kernels/qgemm*.cpp) and its weight layout (passes/gemm_pack.py):
against a float64 reference of its own formula (int8 activations per 32 k) and against the float weight, for
4- and 8-bit weights, blocks of 32 / 64 / 128, symmetric and affine, GGUF blocks as they are, M = 1 … 256 and
shapes that leave partial panels, chunks and blocks; the portable path bit for bit against the vector one; the
layout read back; and its errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from kernel_reference import forced_isa_outputs, matmul_q_model, matmul_q_reference
from kernel_reference import kernel_session as session
from omforge.contract import cdiv
from omforge.passes import gemm_pack, quant
from omforge.runtime.ort import kernels

pytestmark = pytest.mark.skipif(not kernels.status().available, reason=f"kernel library: {kernels.status().reason}")


def check(packed: quant.Packed, rows: tuple[int, ...], seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    w = gemm_pack.pack(packed)
    s = session(matmul_q_model(w))
    dense = quant.dequantize(packed).astype(np.float64)
    for m in rows:
        x = rng.standard_normal((m, packed.k)).astype(np.float32)
        x[0, : min(packed.k, 40)] *= 30  # an outlier chunk: its scale must not leak into the next chunk
        y = s.run(None, {"x": x})[0]
        ref = matmul_q_reference(x, packed)
        scale = np.abs(ref).max()
        assert y.shape == (m, packed.n)
        assert np.abs(y - ref).max() <= 2e-6 * scale, (m, np.abs(y - ref).max() / scale)  # the formula, float32
        # int8 activations: within 3% of the float product (measured ~0.5–2% at these small K)
        assert np.abs(y - x.astype(np.float64) @ dense.T).max() <= 0.03 * scale


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("block", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "affine"])
def test_rtn_weights(bits: int, block: int, symmetric: bool) -> None:
    w = np.random.default_rng(bits + block).standard_normal((45, 2 * block + 40)).astype(np.float32)
    check(quant.quantize(w, bits, block, symmetric), rows=(1, 2, 5, 6, 7, 12, 13, 64))


@pytest.mark.parametrize("m", [1, 8, 16, 32, 64, 128, 256])
def test_row_counts_on_a_model_shape(m: int) -> None:
    """SmolLM2's down projection (K 1536, N 576): every row-tile remainder of the two-panel and one-panel tiles."""
    w = np.random.default_rng(m).standard_normal((576, 1536)).astype(np.float32)
    check(quant.quantize(w, 4, 32, True), rows=(m, m + 5 if m < 256 else m - 3))


@pytest.mark.parametrize("bits", [4, 8])
def test_a_wide_output_written_with_streaming_stores(bits: int) -> None:
    """N ≥ 8,192 (an lm_head's logits): full panels are streamed to memory, the partial last one stored normally."""
    w = np.random.default_rng(bits).standard_normal((8200, 64)).astype(np.float32)
    check(quant.quantize(w, bits, 32, True), rows=(1, 4, 7))


def _gguf_rows(kind: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random GGUF blocks (llama.cpp's layout: fp16 d [, fp16 m], then the codes) for ``[n, k]``."""
    bits, size = quant.GGUF_BLOCKS[kind]
    raw = rng.integers(0, 256, (n, k // 32, size), dtype=np.uint8)
    raw[..., :2] = np.float16(0.01 + 0.02 * rng.random((n, k // 32))).view(np.uint8).reshape(n, k // 32, 2)
    if kind == "Q4_1":
        raw[..., 2:4] = np.float16(-0.1 * rng.random((n, k // 32))).view(np.uint8).reshape(n, k // 32, 2)
    return raw.reshape(n, -1)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_as_they_are(kind: str) -> None:
    rng = np.random.default_rng(3)
    packed = quant.from_gguf(kind, _gguf_rows(kind, 70, 192, rng), 192)
    assert np.array_equal(gemm_pack.unpack(gemm_pack.pack(packed)), quant.dequantize(packed))  # lossless
    check(packed, rows=(1, 9, 33))


def test_layout_reads_back_exactly() -> None:
    rng = np.random.default_rng(5)
    for bits, block, n, k in [(4, 32, 1, 32), (4, 64, 17, 100), (8, 128, 33, 129), (4, 128, 16, 256)]:
        packed = quant.quantize(rng.standard_normal((n, k)).astype(np.float32), bits, block, symmetric=bits == 8)
        w = gemm_pack.pack(packed)
        assert w.codes.shape == (cdiv(n, 16), packed.k_blocks * block // 32, 16 * 32 * bits // 8)
        assert np.array_equal(gemm_pack.unpack(w), quant.dequantize(packed))


CPU_HAS = {"avxvnni": "avx_vnni", "avx2": "avx2", "generic": ""}


def test_a_long_k_gives_the_portable_bits(tmp_path: Path) -> None:
    """K of a 1B–8B down projection's order (4,520: the vector path's row tiles run the whole K, its activation rows
    no longer fit L1 beside the panels), a partial block; pairs of panels and a single one (N 40), row tiles and a
    remainder (M 13): the portable path's bits exactly, and the reference."""
    rng = np.random.default_rng(21)
    k = 2 * 2048 + 3 * 128 + 40
    ws = [gemm_pack.pack(quant.quantize(rng.standard_normal((40, k)).astype(np.float32), bits, 128, symmetric=False))
          for bits in (4, 8)]
    x = rng.standard_normal((13, k)).astype(np.float32)
    for i, w in enumerate(ws):
        (tmp_path / f"m{i}.onnx").write_bytes(matmul_q_model(w).SerializeToString())
    np.save(tmp_path / "x.npy", x)
    portable = forced_isa_outputs(tmp_path, "generic", "gemm", "generic", len(ws))
    for i, w in enumerate(ws):
        assert np.array_equal(portable[i], session(matmul_q_model(w)).run(None, {"x": x})[0]), i
    check(quant.quantize(rng.standard_normal((40, k)).astype(np.float32), 4, 32, True), rows=(1, 5, 64))


@pytest.mark.parametrize("isa", ["avxvnni", "avx2", "generic"])
def test_slower_paths_agree(isa: str, tmp_path: Path) -> None:
    """Each slower path, forced in a child process (the path is fixed when the library loads): 4- and 8-bit codes
    give the vector path's bits exactly (the same integer sums Σ (c − z)·a — plain AVX2's 8-bit codes signed, the
    others' accumulators started at −z·Σa — and the same float operations in the same order); every block size
    meets the reference."""
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    if CPU_HAS[isa] and CPU_HAS[isa] not in flags:
        pytest.skip(f"this CPU has no {CPU_HAS[isa]}")
    rng = np.random.default_rng(11)
    ws = [gemm_pack.pack(quant.quantize(rng.standard_normal((50, 300)).astype(np.float32), bits, 64, symmetric=False))
          for bits in (4, 8)]
    x = rng.standard_normal((13, 300)).astype(np.float32)
    for bits, w in zip((4, 8), ws, strict=True):
        (tmp_path / f"model{bits}.onnx").write_bytes(matmul_q_model(w).SerializeToString())
    np.save(tmp_path / "x.npy", x)
    code = ("import sys, numpy as np, onnxruntime as ort, test_matmul_q as t; from omforge.runtime.ort import kernels; "
            "from omforge.passes import quant; "
            f"assert kernels.status().gemm == {isa!r}, kernels.status(); d = sys.argv[1]; "
            "[np.save(f'{d}/y{b}.npy', t.session(__import__('onnx').load(f'{d}/model{b}.onnx')).run(None, "
            "{'x': np.load(d + '/x.npy')})[0]) for b in (4, 8)]; rng = np.random.default_rng(1); "
            "[t.check(quant.quantize(rng.standard_normal((40, 200)).astype(np.float32), bits, block, sym), "
            "(1, 2, 3, 9)) for bits in (4, 8) for block in (32, 128) for sym in (True, False)]")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env={**os.environ, "OMFORGE_KERNELS_ISA": isa},
                       cwd=Path(__file__).parent, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    for bits, w in zip((4, 8), ws, strict=True):
        here = session(matmul_q_model(w)).run(None, {"x": x})[0]
        assert np.array_equal(np.load(tmp_path / f"y{bits}.npy"), here), bits


def test_the_tile_unit_gives_the_vnni_bits(tmp_path: Path) -> None:
    """Where MatMulQ runs on AMX (whole 16-row tiles on tdpbssd, the other rows on VNNI), its results are the VNNI
    path's bit for bit (the same exact integer products per chunk, the same float operations in the same order),
    so the rows a batch puts on either path change nothing: 4- and 8-bit codes, blocks of 32 / 64 / 128, symmetric
    and affine, partial panels and odd K, M from 16 to 70, and a wide output (streaming stores)."""
    if kernels.status().gemm != "amx-int8":
        pytest.skip(f"MatMulQ runs on {kernels.status().gemm} here, not the tile unit")
    rng = np.random.default_rng(21)
    cases = [(4, 32, False, 50, 300), (4, 64, True, 33, 576), (8, 128, False, 40, 200), (8, 32, True, 17, 96),
             (4, 32, True, 8200, 64)]
    xs = {m: rng.standard_normal((m, 576)).astype(np.float32) for m in (16, 17, 31, 32, 48, 70)}
    for i, (bits, block, sym, n, k) in enumerate(cases):
        packed = quant.quantize(rng.standard_normal((n, k)).astype(np.float32), bits, block, symmetric=sym)
        (tmp_path / f"m{i}.onnx").write_bytes(matmul_q_model(gemm_pack.pack(packed)).SerializeToString())
    for m, x in xs.items():
        np.save(tmp_path / f"x{m}.npy", x)
    code = ("import sys, onnx, numpy as np, test_matmul_q as t; from omforge.runtime.ort import kernels; "
            "assert kernels.status().gemm == 'avx512vnni', kernels.status(); d = sys.argv[1]; "
            f"[np.save(f'{{d}}/y{{i}}-{{m}}.npy', t.session(onnx.load(f'{{d}}/m{{i}}.onnx')).run(None, "
            f"{{'x': np.load(f'{{d}}/x{{m}}.npy')[:, :k]}})[0]) for i, k in enumerate({[c[4] for c in cases]}) "
            f"for m in {list(xs)}]")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)],
                       env={**os.environ, "OMFORGE_KERNELS_ISA": "avx512"}, cwd=Path(__file__).parent,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    for i, (_, _, _, _, k) in enumerate(cases):
        s = session(onnx.load(tmp_path / f"m{i}.onnx"))
        for m, x in xs.items():
            assert np.array_equal(s.run(None, {"x": x[:, :k].copy()})[0], np.load(tmp_path / f"y{i}-{m}.npy")), (i, m)


def test_zero_rows_and_a_batched_input() -> None:
    rng = np.random.default_rng(2)
    packed = quant.quantize(rng.standard_normal((20, 64)).astype(np.float32), 4, 32)
    s = session(matmul_q_model(gemm_pack.pack(packed)))
    x = np.zeros((3, 64), np.float32)
    assert np.array_equal(s.run(None, {"x": x})[0], np.zeros((3, 20), np.float32))  # a zero chunk: scale 0, no NaN


@pytest.mark.parametrize("attrs, message", [
    ({"layout": 7}, "weight layout version 7 is not known"),
    ({"bits": 3}, "bits must be 4 or 8"),
    ({"block_size": 16}, "block_size must be 32, 64 or 128"),
    ({"K": 65}, r"x must be float32 \[\.\.\., 65\]"),
    ({"N": 40}, r"codes must be uint8 \[3, 2, 256\]"),
])
def test_errors_name_what_is_wrong(attrs: dict, message: str) -> None:
    packed = quant.quantize(np.random.default_rng(0).standard_normal((20, 64)).astype(np.float32), 4, 32)
    with pytest.raises(Exception, match=message):
        s = session(matmul_q_model(gemm_pack.pack(packed), **attrs))
        s.run(None, {"x": np.zeros((2, 64), np.float32)})


def test_pack_refuses_blocks_the_kernel_has_no_path_for() -> None:
    packed = quant.quantize(np.ones((4, 48), np.float32), 4, 16)
    with pytest.raises(ValueError, match="blocks of 16"):
        gemm_pack.pack(packed)
