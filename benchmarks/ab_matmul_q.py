"""MatMulQ alone from two kernel libraries in one process, runs alternated: the A/B of a GEMM change without the
machine's phases between two processes (on the 2-core VM the same code read 0.63–1.59× itself across them).

  .venv/bin/python benchmarks/ab_matmul_q.py OLD.so NEW.so [--rows 1,16,64,512]

One MatMulQ node per library and shape (Llama-3.2-1B's down, gate_up and o projections; int4 symmetric blocks of
32, random weights), each session with ORT's spinning off (two pools spinning on two cores starve each other); per
row count the outputs are compared bit for bit, then the two sessions run alternately: GOP/s medians (60 runs up to
M 64, 16 beyond).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from kernel_reference import matmul_q_model
from omforge.passes import gemm_pack, quant

SHAPES = {"down": (2048, 8192), "gate_up": (16384, 2048), "o": (2048, 2048)}  # N, K


def session(model, library: str) -> ort.InferenceSession:  # noqa: ANN001 - onnx.ModelProto
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.register_custom_ops_library(library)
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--rows", default="1,16,64,512")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    for name, (n, k) in SHAPES.items():
        w = gemm_pack.pack(quant.quantize(rng.standard_normal((n, k)).astype(np.float32), 4, 32, True))
        sessions = [session(matmul_q_model(w), lib) for lib in (a.old, a.new)]
        for m in map(int, a.rows.split(",")):
            x = rng.standard_normal((m, k)).astype(np.float32)
            old, new = (s.run(None, {"x": x})[0] for s in sessions)
            same = "same bits" if np.array_equal(old, new) else f"max |diff| {np.abs(old - new).max():.3g}"
            times: list[list[float]] = [[], []]
            for _ in range(60 if m <= 64 else 16):
                for i, s in enumerate(sessions):
                    t0 = time.perf_counter()
                    s.run(None, {"x": x})
                    times[i].append(time.perf_counter() - t0)
            gops = [2 * m * n * k / float(np.median(t)) / 1e9 for t in times]
            print(f"{name:8s} M={m:4d}  old {gops[0]:7.1f}  new {gops[1]:7.1f} GOP/s  new/old {gops[1] / gops[0]:.2f}"
                  f"  ({same})", flush=True)


if __name__ == "__main__":
    main()
