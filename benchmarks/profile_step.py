"""Where one engine step's time goes: onnxruntime's profiler on a prefill step and a decode step of a bundle.

  .venv/bin/python benchmarks/profile_step.py BUNDLE [--prefill 4x128] [--decode 32] [--context 200]

Runs each step twice to warm up, then once profiled, and prints the step's wall time and its kernel time per op
type (top 8). The profile JSON is written under --dir (default a temporary folder).
"""

from __future__ import annotations

import argparse
import collections
import json
import tempfile
import time

import numpy as np
import onnxruntime as ort

from omforge.contract import cdiv


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle")
    ap.add_argument("--prefill", default="4x128", help="SEQSxTOKENS of the prefill step (default 4x128)")
    ap.add_argument("--decode", type=int, default=32, help="sequences in the decode step (default 32)")
    ap.add_argument("--context", type=int, default=200, help="position of the decode tokens (default 200)")
    ap.add_argument("--dir", default=None, help="where the profile JSON goes")
    a = ap.parse_args()
    prefix = (a.dir or tempfile.mkdtemp(prefix="omforge-profile-")) + "/step"

    plain_options = ort.SessionOptions

    def profiled() -> ort.SessionOptions:  # the executor makes its own options: switch profiling on in them
        options = plain_options()
        options.enable_profiling, options.profile_file_prefix = True, prefix
        return options

    ort.SessionOptions = profiled
    from omforge.runtime.engine import LLMEngine
    from omforge.runtime.step import SeqWork

    engine = LLMEngine(a.bundle, num_kv_blocks=1024)
    ex, bs = engine.executor, engine.block_size
    rng = np.random.default_rng(0)
    seqs, tokens = (int(x) for x in a.prefill.split("x"))
    per = cdiv(tokens, bs)
    prefill = [SeqWork(rng.integers(100, 40000, tokens).tolist(), 0, list(range(i * per, (i + 1) * per)))
               for i in range(seqs)]
    per = cdiv(a.context + 1, bs)
    base = seqs * cdiv(tokens, bs)
    decode = [SeqWork([5], a.context, list(range(base + i * per, base + (i + 1) * per))) for i in range(a.decode)]
    walls = {}
    for name, work in (("prefill", prefill), ("decode", decode)):
        for _ in range(2):
            ex.execute(work)
        t0 = time.perf_counter()
        ex.execute(work)
        walls[name] = time.perf_counter() - t0
    events = json.load(open(ex.session.end_profiling()))
    runs = [e for e in events if e.get("name") == "model_run"]
    for (name, wall), run in zip(walls.items(), (runs[2], runs[5])):
        kernels = collections.Counter()
        for e in events:
            if (e.get("cat") == "Node" and e["name"].endswith("_kernel_time")
                    and run["ts"] <= e["ts"] <= run["ts"] + run["dur"]):
                kernels[e["args"]["op_name"]] += e["dur"]
        total = sum(kernels.values())
        print(f"{name}: step {1e3 * wall:.1f} ms, kernel time {total / 1e3:.1f} ms")
        for op, us in kernels.most_common(8):
            print(f"  {op:34} {us / 1e3:8.1f} ms {100 * us / total:5.1f}%")


if __name__ == "__main__":
    main()
