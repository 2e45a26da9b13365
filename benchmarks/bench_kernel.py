"""The CPU kernel issue's step benchmarks: omforge's PagedAttention kernel against the plain-op lowering.

  .venv/bin/python benchmarks/bench_kernel.py EXPORT_DIR [--steps 15] [--block-size 64]

EXPORT_DIR is an unfused export (``omforge export RECIPE -o DIR``). Prints, for the same export lowered both
ways: full step times (median, the two graphs alternating in rounds so machine drift hits both alike) for
decode at batch 32 / context 200 and 512, batch 16 / context 2048, a 512-token prefill and a mixed step
(256-token chunk + 16 decodes); the kernel's attention time per layer from ORT's profiler against its
bandwidth bound (K/V bytes read ÷ measured 2-thread read bandwidth); and the kernel's decode step on a pool
4x larger (cost must not follow the pool).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from bench_passes import interleaved_ms

from omforge.compile.ort import build
from omforge.contract import cdiv
from omforge.runtime.ort.ort_executor import OrtExecutor
from omforge.runtime.step import SeqWork, build_step


def read_bandwidth_gbs(nbytes: int = 1 << 30, threads: int = 2) -> float:
    """Best of 5: every thread sums its own slice of a float32 array (numpy releases the GIL)."""
    parts = np.array_split(np.ones(nbytes // 4, np.float32), threads)
    pool = ThreadPoolExecutor(threads)
    list(pool.map(np.sum, parts))
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        list(pool.map(np.sum, parts))
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def steps(block_size: int, num_blocks: int) -> dict[str, dict[str, np.ndarray]]:
    """The benchmarked steps; each on its own (its blocks drawn at random from the whole pool)."""
    rng = np.random.default_rng(0)
    cases = {"decode b32 c200": [(200, 1)] * 32, "decode b32 c512": [(512, 1)] * 32,
             "decode b16 c2048": [(2048, 1)] * 16, "prefill 512": [(512, 512)],
             "mixed 256 + 16 decodes": [(256, 256)] + [(512, 1)] * 16}
    out = {}
    for name, seqs in cases.items():
        free = list(rng.permutation(num_blocks))
        work = []
        for length, new in seqs:  # a sequence of `length` tokens whose last `new` are this step's
            table = [int(free.pop()) for _ in range(cdiv(length, block_size))]
            work.append(SeqWork(rng.integers(3, 1000, new).tolist(), length - new, table))
        out[name] = build_step(work, block_size, split_decodes=True)
    return out


def attention_ms_per_layer(path: Path, layout, step: dict[str, np.ndarray], num_blocks: int) -> float:  # noqa: ANN001
    import onnxruntime as ort

    plain = ort.SessionOptions

    def profiled() -> ort.SessionOptions:
        options = plain()
        options.enable_profiling, options.profile_file_prefix = True, tempfile.mkdtemp() + "/p"
        return options

    ort.SessionOptions = profiled
    try:
        ex = OrtExecutor(path, layout, num_blocks=num_blocks)
    finally:
        ort.SessionOptions = plain
    for _ in range(4):
        ex.run(step)
    events = json.load(open(ex.session.end_profiling()))
    runs = [e for e in events if e.get("name") == "model_run"]
    last = runs[-1]["ts"]
    attn = [e["dur"] for e in events if e.get("cat") == "Node" and e["ts"] >= last
            and e.get("args", {}).get("op_name") == "PagedAttention"]
    return sum(attn) / 1e3 / layout.num_layers


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("export", type=Path)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--block-size", type=int, default=64)
    a = ap.parse_args(argv)
    bs, blocks = a.block_size, 600
    with tempfile.TemporaryDirectory() as tmp:
        graphs = {name: build(a.export, Path(tmp) / name / "step.onnx", block_size=bs, kernel=(name == "kernel"))
                  for name in ("kernel", "plain")}
        layout = graphs["kernel"].layout
        print(f"nodes in the step graph: kernel {graphs['kernel'].num_nodes}, plain {graphs['plain'].num_nodes} "
              f"({layout.num_layers} layers)")
        executors = {name: OrtExecutor(Path(tmp) / name / "step.onnx", r.layout, num_blocks=blocks)
                     for name, r in graphs.items()}
        print(f"full step, median of {a.steps} (block size {bs}):")
        for name, step in steps(bs, blocks).items():
            ms = interleaved_ms({k: (ex, step) for k, ex in executors.items()}, a.steps)
            print(f"  {name:24s} plain {ms['plain']:7.1f} ms   kernel {ms['kernel']:7.1f} ms   "
                  f"speed-up {ms['plain'] / ms['kernel']:.2f}x", flush=True)
        del executors
        bw = read_bandwidth_gbs()
        step = steps(bs, blocks)["decode b32 c512"]
        attn = attention_ms_per_layer(Path(tmp) / "kernel" / "step.onnx", layout, step, blocks)
        kv_bytes = 32 * 512 * layout.kv_heads * layout.head_dim * 4 * 2
        bound = kv_bytes / (bw * 1e9) * 1e3
        print(f"attention, decode b32 c512: {attn:.3f} ms per layer; bound {bound:.3f} ms "
              f"({kv_bytes / 1e6:.1f} MB of K/V at {bw:.1f} GB/s read) -> {attn / bound:.2f}x the bound")
        big = blocks * 4
        cases = {n: (OrtExecutor(Path(tmp) / "kernel" / "step.onnx", layout, num_blocks=n),
                     steps(bs, blocks)["decode b32 c512"])
                 for n in (blocks, big)}
        ms = interleaved_ms(cases, a.steps)
        print(f"kernel decode b32 c512, pool {blocks} vs {big} blocks: {ms[blocks]:.1f} vs {ms[big]:.1f} ms "
              f"(ratio {ms[big] / ms[blocks]:.3f})")


if __name__ == "__main__":
    sys.exit(main())
