"""The PagedAttention node alone on decode steps: median time per call and the KV bytes it reads.

  .venv/bin/python benchmarks/bench_attention.py [--kv int8,bfloat16,float32] [--reps 200]

One node (SmolLM2's heads: 9 query, 3 KV, head_dim 64; block 64) built as tests/kernel_reference.py builds it,
pools bound in place as the executor binds them, each sequence's blocks drawn at random from a pool just large
enough; contexts spread over [C/2, 3C/2). Prints the median µs per call, the K/V bytes read and the rate they
imply — compare it with the machine's ~36 GB/s two-thread read bandwidth (in a single node the pools partly sit in
the L3 cache, so the rate can exceed what a whole step sees; ``--layers 30`` cycles the calls over 30 pools, as a
step's 30 layers do, so they come from memory). Run two libraries in one sitting with
``OMFORGE_KERNELS_LIBRARY`` to compare kernels.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from kernel_reference import ENCODE, kernel_model, kernel_session
from omforge.contract import cdiv
from omforge.runtime.ort import kernels
from omforge.runtime.step import SeqWork, build_step

CASES = ((64, 192), (32, 512), (16, 2048), (1, 192))  # (sequences, mean context)


def run(batch: int, context: int, kv: str, reps: int, q_heads: int = 9, kv_heads: int = 3, head_dim: int = 64,
        block_size: int = 64, layers: int = 1, chunk: int = 0, shared: int = 0) -> tuple[float, float]:
    """(median seconds per call, K/V megabytes read per call); calls cycle over ``layers`` pools. ``chunk`` > 0:
    ``batch`` prefill chunks of ``chunk`` tokens at positions ``context`` … ``context + chunk - 1`` instead of
    decodes (the megabytes are then the attention's GFLOP: 4 · D · Hq · the visible keys of every query).
    ``shared`` > 0: every sequence's table begins with the same ``shared // block_size`` blocks (a shared prompt)."""
    rng = np.random.default_rng(0)
    if chunk:
        lengths = np.full(batch, context + chunk - 1)
    else:
        lengths = rng.integers(max(1, context // 2), max(2, context * 3 // 2), batch)
    if shared:
        lengths = np.maximum(lengths, shared)
    num_blocks = int(sum(cdiv(n + 1, block_size) for n in lengths)) + 8
    free = list(rng.permutation(num_blocks))
    common = [int(free.pop()) for _ in range(shared // block_size)]
    work = [SeqWork([5] * chunk if chunk else [5], context if chunk else int(n),
                    common + [int(free.pop()) for _ in range(cdiv(int(n) + 1, block_size) - len(common))])
            for n in lengths]
    step = build_step(work, block_size, split_decodes=True)
    T = step["input_ids"].shape[1]
    model = kernel_model(q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size,
                         scale=head_dim ** -0.5, kv_dtype=kv)
    sess = kernel_session(model)
    activations = {name: rng.standard_normal((1, heads, T, head_dim), dtype=np.float32)
                   for name, heads in (("q", q_heads), ("k", kv_heads), ("v", kv_heads))}
    bindings = []
    for _ in range(layers):
        binding = sess.io_binding()
        binding.bind_output("o")
        for name in ("slot_mapping", "block_tables", "query_index", "token_index", "position_ids",
                     "decode_block_tables", "decode_query_index"):
            binding.bind_cpu_input(name, np.ascontiguousarray(step[name]))
        for name, x in activations.items():
            binding.bind_cpu_input(name, x)
        for name in ("key_cache", "value_cache"):
            pool = ENCODE[kv](rng.standard_normal((num_blocks * block_size, kv_heads, head_dim), dtype=np.float32))
            value = (ort.OrtValue.ortvalue_from_numpy_with_onnx_type(pool, 16) if kv == "bfloat16"
                     else ort.OrtValue.ortvalue_from_numpy(pool))
            binding.bind_ortvalue_input(name, value)
            binding.bind_ortvalue_output(name + "_out", value)
        bindings.append(binding)
    for i in range(max(10, layers)):
        sess.run_with_iobinding(bindings[i % layers])
    times = []
    for i in range(reps):
        binding = bindings[i % layers]
        t0 = time.perf_counter()
        sess.run_with_iobinding(binding)
        times.append(time.perf_counter() - t0)
    if chunk:
        visible = batch * sum(context + i + 1 for i in range(chunk))
        return float(np.median(times)), 4 * head_dim * q_heads * visible / 1e9
    row_bytes = {"int8": head_dim + 4, "bfloat16": 2 * head_dim, "float32": 4 * head_dim}[kv]
    keys = int(sum(lengths)) + batch
    return float(np.median(times)), keys * kv_heads * row_bytes * 2 / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv", default="int8,bfloat16,float32", help="pool dtypes, comma-separated")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--layers", type=int, default=1, help="pools the calls cycle over (30: read from memory)")
    ap.add_argument("--cases", default=",".join(f"{b}x{c}" for b, c in CASES),
                    help="SEQUENCESxCONTEXT decode cases, comma-separated (default: %(default)s)")
    ap.add_argument("--heads", default="9,3,64", help="Q_HEADS,KV_HEADS,HEAD_DIM (default SmolLM2's; Llama-3.2-1B: "
                                                       "32,8,64)")
    ap.add_argument("--shared", type=int, default=0,
                    help="decode cases: the first SHARED tokens' blocks are the same in every table (a shared prompt)")
    ap.add_argument("--prefill", default="",
                    help="SEQUENCESxCHUNKxSTART prefill cases, comma-separated (e.g. 1x512x0,1x512x512): GFLOP/s")
    a = ap.parse_args()
    hq, hkv, hd = (int(x) for x in a.heads.split(","))
    heads = {"q_heads": hq, "kv_heads": hkv, "head_dim": hd}
    cases = [tuple(int(x) for x in case.split("x")) for case in a.cases.split(",") if case]
    print(f"kernel library: {kernels.status().path} (isa {kernels.status().isa})")
    for kv in a.kv.split(","):
        for case in filter(None, a.prefill.split(",")):
            batch, chunk, start = (int(x) for x in case.split("x"))
            t, gflop = run(batch, start, kv, a.reps, layers=a.layers, chunk=chunk, **heads)
            print(f"prefill b{batch} {chunk} tokens from {start:<5} {kv:9s} {t * 1e6:9.1f} µs  "
                  f"{gflop:6.3f} GFLOP  {gflop / t:6.1f} GFLOP/s")
        for batch, context in cases:
            t, mb = run(batch, context, kv, a.reps, layers=a.layers, shared=a.shared, **heads)
            print(f"decode b{batch:<3} c{context:<5} {kv:9s} {t * 1e6:8.1f} µs  K/V {mb:6.2f} MB  "
                  f"{mb / 1e3 / t:5.1f} GB/s")


if __name__ == "__main__":
    main()
