"""The weight GEMM alone: omforge's MatMulQ (int8 activations) and MatMulQBF16 (the same weights, bfloat16
activations), MatMulBF16 and MatMulF32 (the weights as bfloat16 / float32 panels) against ONNX Runtime's MatMulNBits
(accuracy levels 4 and 0) and the float32 MatMul, per shape and row
count, in one process (ratios measured side by side), with this CPU's measured int8 VNNI peak.

  .venv/bin/python benchmarks/bench_gemm.py [--shapes smollm2|llama1b|llama8b|all] [--rows 1,8,16,32,64,128,256]
                                            [--threads 2] [--reps 30] [--bits 4] [--affine] [--repeat 8] [--torch]

Weights: random, round to nearest per 32 along K (``--affine``: with a per-block offset, like GGUF Q4_1). Each
cell is the median of ``--reps`` runs after one warm-up, printed as GOP/s (2·M·N·K per op): each run computes the op
``--repeat`` times on the same x (8 copies of its nodes in one graph, one column of each output kept), as a decode
step runs its nodes back to back, so ORT's per-run overhead and its threads' wake-up are spread over them
(``--repeat 1``: one node per run, as before 2026-12-04, where they are inside every cell). The peak is a
throughput loop of independent ``vpdpbusd`` (zmm) chains on ``--threads`` threads, compiled here with g++ (skipped
without it); "of peak" is MatMulQ's GOP/s over it.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from omforge.passes import gemm_pack, quant
from omforge.runtime.ort import kernels

SHAPES = {  # (name, N, K): the weight matrices of a layer (merged as omforge's fusions merge them) and the head
    "smollm2": [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536),
                ("lm_head", 49152, 576)],
    "llama1b": [("qkv", 3072, 2048), ("o", 2048, 2048), ("gate_up", 16384, 2048), ("down", 2048, 8192),
                ("lm_head", 128256, 2048)],
    "llama8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)],
}

PEAK_SOURCE = r"""
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <thread>
#include <vector>
// 16 independent accumulator chains, all in registers (more spill; fewer leave the pipes idle on latency)
extern "C" __attribute__((target("avx512f,avx512vnni"))) void chain(long iters, int* sink) {
  __m512i a[16];
  for (int i = 0; i < 16; ++i) a[i] = _mm512_set1_epi32(i);
  __m512i b = _mm512_set1_epi32(0x01010101), c = _mm512_set1_epi32(0x02020202);
  asm volatile("" : "+v"(b), "+v"(c));
  for (long n = 0; n < iters; ++n) {
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) a[i] = _mm512_dpbusd_epi32(a[i], b, c);
  }
  __m512i s = a[0];
  for (int i = 1; i < 16; ++i) s = _mm512_add_epi32(s, a[i]);
  *sink = _mm512_reduce_add_epi32(s);
}
extern "C" void run(long iters, int threads) {
  std::vector<std::thread> ts;
  std::vector<int> sink(threads);
  for (int t = 0; t < threads; ++t) ts.emplace_back(chain, iters, &sink[t]);
  for (auto& t : ts) t.join();
}
// the tile unit's int8 peak: 4 independent tdpbusd (16 x 16 x 64 each) on tiles loaded once; 0 without permission
struct alignas(64) Cfg {
  unsigned char palette, start, reserved[14];
  unsigned short colsb[16];
  unsigned char rows[16];
};
__attribute__((target("amx-tile,amx-int8"))) static void tiles(long iters) {
  Cfg c = {};
  c.palette = 1;
  for (int i = 0; i < 8; ++i) c.colsb[i] = 64, c.rows[i] = 16;
  alignas(64) static thread_local char buf[1024];
  asm volatile("" : : "r"(&c) : "memory");  // GCC 12's _tile_loadconfig claims to read 8 bytes of the 64
  _tile_loadconfig(&c);
  _tile_loadd(4, buf, 64); _tile_loadd(5, buf, 64); _tile_loadd(6, buf, 64); _tile_loadd(7, buf, 64);
  for (long n = 0; n < iters; ++n) {
    _tile_dpbusd(0, 4, 6); _tile_dpbusd(1, 4, 7); _tile_dpbusd(2, 5, 6); _tile_dpbusd(3, 5, 7);
  }
  _tile_release();
}
extern "C" int run_amx(long iters, int threads) {
  if (!__builtin_cpu_supports("amx-int8") || syscall(SYS_arch_prctl, 0x1023, 18) != 0) return 0;
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t) ts.emplace_back(tiles, iters);
  for (auto& t : ts) t.join();
  return 1;
}
"""


@functools.cache
def _peak_library() -> Path | None:
    """PEAK_SOURCE compiled here with g++ (None without it)."""
    tmp = Path(tempfile.mkdtemp(prefix="omforge-peak-"))
    (tmp / "peak.cpp").write_text(PEAK_SOURCE)
    try:
        subprocess.run(["g++", "-O2", "-shared", "-fPIC", "-pthread", str(tmp / "peak.cpp"), "-o",
                        str(tmp / "peak.so")], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return tmp / "peak.so"


def vnni_peak(threads: int) -> float | None:
    """int8 GOP/s of ``threads`` threads issuing only vpdpbusd zmm (64 multiply-adds each), or None."""
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if "avx512_vnni" not in flags:  # the loop is zmm vpdpbusd: an illegal instruction on an AVX2-only CPU
        return None
    path = _peak_library()
    if path is None:
        return None
    lib = ctypes.CDLL(str(path))
    lib.run.argtypes = [ctypes.c_long, ctypes.c_int]
    iters = 20_000_000
    lib.run(iters // 10, threads)
    best = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        lib.run(iters, threads)
        best = max(best, iters * 16 * 64 * 2 * threads / (time.perf_counter() - t0) / 1e9)
    return best


def amx_peak(threads: int) -> float | None:
    """int8 GOP/s of ``threads`` threads issuing only tdpbusd (16·16·64 multiply-adds each), or None without AMX."""
    lib = ctypes.CDLL(str(_peak_library()))
    lib.run_amx.argtypes = [ctypes.c_long, ctypes.c_int]
    iters = 2_000_000
    if not lib.run_amx(iters // 10, threads):
        return None
    best = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        lib.run_amx(iters, threads)
        best = max(best, iters * 4 * 16 * 16 * 64 * 2 * threads / (time.perf_counter() - t0) / 1e9)
    return best


def _session(make_nodes: Callable[[int], list], inits: list, k: int, n: int, threads: int, domains: dict[str, int],
             repeat: int) -> Callable[[], ort.InferenceSession]:
    """``repeat`` copies of one op's nodes on the same x (``make_nodes(i)`` names its output ``y{i}``), each
    output's first column kept, so one run computes the op ``repeat`` times as a decode step runs its nodes: ORT's
    per-run overhead and the wake-up of its threads spread over them. Returns a factory: each session has its own
    thread pool, and with several alive their idle workers took a core from the one being timed (measured: the
    same MatMulQ session alternated between ~440 and ~940 µs per op with five others alive, 432–474 alone)."""
    nodes = [node for i in range(repeat) for node in make_nodes(i)]
    for i in range(repeat):
        nodes.append(helper.make_node("Slice", [f"y{i}", "zero", "one", "one"], [f"c{i}"]))
    nodes.append(helper.make_node("Concat", [f"c{i}" for i in range(repeat)], ["y"], axis=1))
    axes = [onnx.numpy_helper.from_array(np.array([v], np.int64), name) for name, v in (("zero", 0), ("one", 1))]
    graph = helper.make_graph(nodes, "gemm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", repeat])], inits + axes)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in domains.items()])
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    if "omforge.kernels" in domains:
        kernels.register(options)
    # the copies are identical nodes: common-subexpression elimination would merge them into one
    return lambda: ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"],
                                        disabled_optimizers=["CommonSubexpressionElimination"])


def sessions(w: np.ndarray, bits: int, affine: bool, threads: int,
             repeat: int = 1) -> dict[str, Callable[[], ort.InferenceSession]]:
    n, k = w.shape
    p = quant.quantize(w, bits, 32, symmetric=not affine)
    arr = onnx.numpy_helper.from_array
    pw = gemm_pack.pack(p)
    q_inputs = ["x", "codes", "scales"] + (["offsets"] if pw.offsets is not None else [])
    q_inits = [arr(pw.codes, "codes"), arr(pw.scales, "scales")] + ([arr(pw.offsets, "offsets")] if affine else [])
    kernel_domains = {"": 17, "omforge.kernels": 1}
    out = {op: _session(lambda i, op=op: [helper.make_node(op, q_inputs, [f"y{i}"], domain="omforge.kernels", K=k,
                                                           N=n, bits=bits, block_size=32, layout=gemm_pack.LAYOUT)],
                        q_inits, k, n, threads, kernel_domains, repeat)
           for op in ("MatMulQ", *(("MatMulQBF16",) if kernels.status().qbf16 else ()))}
    if kernels.status().bf16:  # the same weights as bfloat16 (compile.weights: bfloat16)
        out["MatMulBF16"] = _session(lambda i: [helper.make_node("MatMulBF16", ["x", "codes"], [f"y{i}"],
                                                                 domain="omforge.kernels", K=k, N=n,
                                                                 layout=gemm_pack.LAYOUT)],
                                     [arr(gemm_pack.pack_bf16(w), "codes")], k, n, threads, kernel_domains, repeat)
    for level in (4, 0):  # affine blocks: MatMulNBits + the block-offset MatMul, as quantize_weights lowers them
        def nbits(i: int, level: int = level) -> list:
            nodes = [helper.make_node("MatMulNBits", ["x", "b", "s"], [f"y0_{i}" if affine else f"y{i}"],
                                      domain="com.microsoft", K=k, N=n, bits=bits, block_size=32,
                                      accuracy_level=level)]
            if affine:
                nodes += [helper.make_node("MatMul", ["x", "member"], [f"sums{i}"]),
                          helper.make_node("MatMul", [f"sums{i}", "bmin"], [f"corr{i}"]),
                          helper.make_node("Add", [f"y0_{i}", f"corr{i}"], [f"y{i}"])]
            return nodes
        inits = [arr(p.blocks.reshape(n, p.k_blocks, -1), "b"), arr(p.scales, "s")]
        if affine:
            member = np.zeros((k, p.k_blocks), np.float32)
            member[np.arange(k), np.arange(k) // 32] = 1
            inits += [arr(member, "member"), arr(np.ascontiguousarray(p.block_min.T), "bmin")]
        out[f"NBits L{level}"] = _session(nbits, inits, k, n, threads, {"": 17, "com.microsoft": 1}, repeat)
    out["fp32 MatMul"] = _session(lambda i: [helper.make_node("MatMul", ["x", "w"], [f"y{i}"])],
                                  [arr(np.ascontiguousarray(w.T), "w")], k, n, threads, {"": 17}, repeat)
    if kernels.status().f32:  # the same float32 weights in column panels (compile.weights: float32, float_gemm)
        out["MatMulF32"] = _session(lambda i: [helper.make_node("MatMulF32", ["x", "w"], [f"y{i}"],
                                                                domain="omforge.kernels", K=k, N=n,
                                                                layout=gemm_pack.LAYOUT)],
                                    [arr(gemm_pack.pack_f32(w), "w")], k, n, threads, kernel_domains, repeat)
    return out


class TorchLinear:
    """``torch.nn.functional.linear`` (oneDNN / MKL, as vLLM CPU's float32 path calls it) ``repeat`` times per run on
    ``threads`` threads, with the session's ``run(None, {"x": x})`` signature."""

    def __init__(self, w: np.ndarray, threads: int, repeat: int) -> None:
        import torch
        torch.set_num_threads(threads)
        self.torch, self.w, self.repeat = torch, torch.from_numpy(np.ascontiguousarray(w)), repeat

    def run(self, _outputs: None, feeds: dict[str, np.ndarray]) -> None:
        x = self.torch.from_numpy(feeds["x"])
        for _ in range(self.repeat):
            self.torch.nn.functional.linear(x, self.w)


def median_seconds(s: ort.InferenceSession, x: np.ndarray, reps: int) -> float:
    s.run(None, {"x": x})
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        s.run(None, {"x": x})
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="smollm2", choices=[*SHAPES, "all"])
    ap.add_argument("--rows", default="1,8,16,32,64,128,256")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--bits", type=int, default=4, choices=[4, 8])
    ap.add_argument("--affine", action="store_true")
    ap.add_argument("--repeat", type=int, default=8, help="copies of the op per run (1: one node per run)")
    ap.add_argument("--torch", action="store_true", help="also torch.nn.functional.linear on the float32 weights")
    a = ap.parse_args()
    if not kernels.status().available or kernels.status().weight_layout is None:
        raise SystemExit(f"the kernel library's MatMulQ is unavailable: {kernels.status().reason}")
    peak = vnni_peak(a.threads)
    print(f"VNNI peak ({a.threads} threads, vpdpbusd zmm loop): " + (f"{peak:.0f} GOP/s" if peak else "not measured"))
    tile_peak = amx_peak(a.threads) if peak else None
    if tile_peak:  # MatMulQ runs its 16-row tiles on the tile unit where it has one: "of peak" is then against it
        print(f"AMX int8 peak ({a.threads} threads, tdpbusd loop on resident tiles): {tile_peak:.0f} GOP/s")
        peak = tile_peak if kernels.status().gemm == "amx-int8" else peak
    print(f"MatMulQ path {kernels.status().gemm}, MatMulQBF16 and MatMulBF16 path {kernels.status().qbf16}; "
          f"int{a.bits} {'affine' if a.affine else 'symmetric'} blocks of 32")
    rng = np.random.default_rng(0)
    shapes = [s for key in (SHAPES if a.shapes == "all" else [a.shapes]) for s in SHAPES[key]]
    for name, n, k in shapes:
        w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
        ss = sessions(w, a.bits, a.affine, a.threads, a.repeat)
        if a.torch:
            ss["torch linear"] = lambda w=w: TorchLinear(w, a.threads, a.repeat)
        print(f"\n{name} N={n} K={k}   GOP/s: " + " | ".join(ss) + " | MatMulQ of peak")
        rows = [int(m) for m in a.rows.split(",")]
        xs = {m: rng.standard_normal((m, k)).astype(np.float32) for m in rows}
        gops: dict[int, dict[str, float]] = {m: {} for m in rows}
        for label, make in ss.items():  # one session alive at a time
            s = make()
            for m in rows:
                gops[m][label] = 2 * m * n * k * a.repeat / median_seconds(s, xs[m], a.reps) / 1e9
            del s
        for m in rows:
            frac = f"{gops[m]['MatMulQ'] / peak:.0%}" if peak else "–"
            print(f"  M={m:<4d} " + " | ".join(f"{v:7.1f}" for v in gops[m].values()) + f" | {frac}")


if __name__ == "__main__":
    main()
