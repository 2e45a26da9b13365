"""TTFT of a 1,024-token prompt that arrives while 16 decodes run, and those decodes' inter-token latency,
with chunked prefill on (a step budget of ``--budget`` tokens) and off (a budget that takes the prompt whole).

  python benchmarks/bench_chunked.py BUNDLE [--budget 512]

The 16 decoding requests (128-token prompts) run alone for 8 steps; then the long prompt arrives. Reported:
the long prompt's TTFT, and p50/p99 of the 16 decodes' inter-token gaps from its arrival until it has its
first token plus 16 more steps (the window in which the prefill competes with the decodes).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from omforge.runtime.engine import LLMEngine
from omforge.runtime.sampling_params import SamplingParams


def run(bundle: Path, budget: int) -> dict[str, float]:
    engine = LLMEngine(bundle, max_num_batched_tokens=budget, max_num_seqs=32)
    rng = np.random.default_rng(0)
    vocab = engine.config.vocab_size
    decoders = [engine.add_request(rng.integers(100, vocab, 128).tolist(),
                                   SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True))[0]
                for _ in range(16)]
    while any(r.first_token_time is None for r in decoders):  # get all 16 into steady decode
        engine.step()
    for _ in range(8):
        engine.step()
    arrival = time.monotonic()
    (long,) = engine.add_request(rng.integers(100, vocab, 1024).tolist(),
                                 SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    while long.first_token_time is None:
        engine.step()
    for _ in range(16):
        engine.step()
    end = time.monotonic()
    gaps = []
    for r in decoders:
        times = [t for t in r.token_times if arrival <= t <= end]
        prev = max((t for t in r.token_times if t < arrival), default=None)
        series = ([prev] if prev is not None else []) + times
        gaps += [b - a for a, b in zip(series, series[1:])]
    gaps.sort()
    for r in decoders + [long]:
        engine.abort(r.request_id)
    return {"ttft_ms": 1e3 * (long.first_token_time - long.arrival_time),
            "itl_p50_ms": 1e3 * statistics.median(gaps), "itl_p99_ms": 1e3 * gaps[int(0.99 * (len(gaps) - 1))]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("bundle", type=Path)
    p.add_argument("--budget", type=int, default=512)
    args = p.parse_args()
    for label, budget in (("chunked prefill on ", args.budget), ("chunked prefill off", 1024 + 64)):
        r = run(args.bundle, budget)
        print(f"{label} (budget {budget:4d}): TTFT {r['ttft_ms']:7.0f} ms   16 decodes' ITL p50 "
              f"{r['itl_p50_ms']:6.1f} ms  p99 {r['itl_p99_ms']:6.1f} ms")


if __name__ == "__main__":
    main()
