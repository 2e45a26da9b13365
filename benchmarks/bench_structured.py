"""Structured output's cost: a batch of sequences decoding under a grammar vs the same batch free.

    python benchmarks/bench_structured.py BUNDLE [--batch 16] [--tokens 64] [--rounds 3] [--kind json|regex]

Each round runs the batch free (``ignore_eos``) and under a grammar that cannot end within ``--tokens``
(every step masked), interleaved; prints output tok/s of each and their ratio (medians) and the tokens made.
``json``: an object with one string field of at least 20 × ``--tokens`` characters (the common case);
``regex``: ``[a-z ]{4 × tokens}`` (a bounded repetition: llguidance's mask is ~100× dearer there, and long
tokens may still finish it early).
"""

from __future__ import annotations

import argparse
import statistics
import time

from omforge import LLM, SamplingParams
from omforge.runtime.structured import StructuredOutput


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kind", choices=("json", "regex"), default="json")
    a = ap.parse_args()
    llm = LLM(a.bundle)
    prompts = [llm.tokenizer.encode(f"Story number {i}: once upon a time") for i in range(a.batch)]
    free = SamplingParams(max_tokens=a.tokens, temperature=1.0, seed=0, ignore_eos=True)
    spec = (StructuredOutput("regex", f"[a-z ]{{{a.tokens * 4}}}") if a.kind == "regex" else
            StructuredOutput("json", {"type": "object", "required": ["story"],  # cannot close within --tokens
                                      "properties": {"story": {"type": "string", "minLength": a.tokens * 20}}}))
    ruled = SamplingParams(max_tokens=a.tokens, temperature=1.0, seed=0, ignore_eos=True, structured=spec)
    llm.generate(prompts[:2], ruled, use_tqdm=False)  # warm: tokenizer for the grammar engine, ORT
    rates: dict[str, list[float]] = {"free": [], "grammar": []}
    counts: dict[str, int] = {}
    for _ in range(a.rounds):
        for name, params in (("free", free), ("grammar", ruled)):
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            counts[name] = sum(len(o.token_ids) for o in outs)
            rates[name].append(counts[name] / (time.perf_counter() - t))
    f, g = statistics.median(rates["free"]), statistics.median(rates["grammar"])
    print(f"{a.kind}, batch {a.batch} × {a.tokens} tokens: free {f:.1f} tok/s, grammar {g:.1f} tok/s, "
          f"ratio {g / f:.3f} (tokens: free {counts['free']}, grammar {counts['grammar']})")


if __name__ == "__main__":
    main()
