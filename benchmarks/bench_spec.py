"""Speculative decoding (n-gram) on vs off, offline, interleaved rounds, medians of output tok/s.

    python benchmarks/bench_spec.py BUNDLE [--rounds 2] [--k 4] [--only grounded|chat]

Each row also gives the decode phase alone (tokens after every request's first one, over the time from then on):
the whole-run ratio includes the prompts' prefill, which speculation does not touch.

Workloads (greedy, EOS ignored, fixed output lengths):
  grounded-1 / grounded-8: input-grounded — a passage of ~450 tokens from the project's own docs (docs/*.md,
      README.md; 8 passages chosen with seed 0) and "copy it" as the instruction, 128 output tokens; one stream,
      then 8 concurrent.
  chat-1 / chat-64: the shared harness's short-chat prompts (benchmarks/harness/workload.py: 128 single-token
      English words), 128 output tokens; one stream, then 64 concurrent.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

from omforge import LLM, SamplingParams

ROOT = Path(__file__).resolve().parent.parent


def grounded_prompts(llm: LLM, n: int, tokens: int = 450) -> list[list[int]]:
    tok = llm.tokenizer
    text = "\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"])
    ids = tok.encode(text, add_special_tokens=False)
    rng = random.Random(0)
    out = []
    for _ in range(n):
        start = rng.randrange(0, len(ids) - tokens)
        passage = tok.decode(ids[start:start + tokens])
        msgs = [{"role": "user", "content": "Copy the following text exactly, word for word.\n\n" + passage}]
        out.append(tok.encode(tok.apply_chat_template(msgs), add_special_tokens=False))
    return out


def chat_prompts(bundle: Path, n: int) -> list[list[int]]:
    sys.path.insert(0, str(ROOT.parent / "shared" / "bench"))
    from workload import build  # the shared harness's exact-length prompts, its seeds

    return [r["prompt_token_ids"] for r in build(str(bundle), "short-chat", num=n)]


def rate(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[float, float]:
    """(output tok/s of the whole run, tok/s of its decode phase: the tokens after every request's first token
    arrived, over the time from then to the end — what speculation can speed up; prefill is the rest)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t
    first = max(o.first_token_time for o in outs)
    end = max(o.token_times[-1] for o in outs)
    late = sum(sum(1 for x in o.token_times if x > first) for o in outs)
    return sum(len(o.token_ids) for o in outs) / wall, late / (end - first) if end > first else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--only", choices=("grounded", "chat"))
    a = ap.parse_args()
    off = LLM(a.bundle)
    on = LLM(a.bundle, speculative_config={"method": "ngram", "num_speculative_tokens": a.k})
    workloads = {}
    if a.only != "chat":
        g = grounded_prompts(off, 8)
        workloads |= {"grounded-1": (g[:1], 128), "grounded-8": (g, 128)}
    if a.only != "grounded":
        c = chat_prompts(a.bundle, 64)
        workloads |= {"chat-1": (c[:1], 128), "chat-64": (c, 128)}
    for llm in (off, on):  # warm both engines
        llm.generate([next(iter(workloads.values()))[0][0][:64]], SamplingParams(max_tokens=8), use_tqdm=False)
    for name, (prompts, max_tokens) in workloads.items():
        rates: dict[str, list[float]] = {"off": [], "on": []}
        decode: dict[str, list[float]] = {"off": [], "on": []}
        s0 = (on.engine.stats.spec_draft_tokens, on.engine.stats.spec_accepted_tokens)
        for _ in range(a.rounds):
            for key, llm in (("off", off), ("on", on)):
                whole, dec = rate(llm, prompts, max_tokens)
                rates[key].append(whole)
                decode[key].append(dec)
        drafted = on.engine.stats.spec_draft_tokens - s0[0]
        accepted = on.engine.stats.spec_accepted_tokens - s0[1]
        f, n = statistics.median(rates["off"]), statistics.median(rates["on"])
        acc = f"{accepted / drafted:.2f}" if drafted else "-"
        df, dn = statistics.median(decode["off"]), statistics.median(decode["on"])
        print(f"{name:11s} prompts {len(prompts):2d}: off {f:7.1f} tok/s, on {n:7.1f} tok/s, ratio {n / f:.3f}, "
              f"acceptance {acc} ({accepted}/{drafted}); decode phase off {df:7.1f}, on {dn:7.1f}, "
              f"ratio {dn / df:.3f}", flush=True)


if __name__ == "__main__":
    main()
