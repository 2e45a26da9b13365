"""The first run of omforge's Ascend path on a real NPU (driven by scripts/ascend-first-run.sh): for each built
bundle (one per paged-attention mode), every gear's logits against the plain-op ORT twin
(:func:`omforge.verify.verify`), then one prompt through the real pyACL — a prefill and three decode steps — whose
greedy tokens must equal the ORT bundle's, and the decode step time, as one table. Nothing here has ever run: no NPU
was available where it was written. Without pyACL it refuses in one line (exit 2); a failed check exits 1.

Not done here [left]: reading the pool rows back at their slots (needs the executor's device pools exposed).

usage: python scripts/ascend_first_run.py RECIPE ORT_BUNDLE MODE=ASCEND_BUNDLE [MODE=ASCEND_BUNDLE ...]
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

PROMPT = [1, 17, 42, 99, 7, 3, 120, 64]
DECODE_STEPS = 3


def _generate(bundle: Path, max_tokens: int) -> tuple[list[int], float]:
    from omforge import LLM, SamplingParams

    llm = LLM(bundle)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    out = llm.generate([PROMPT], params, use_tqdm=False)
    return list(out[0].token_ids), time.perf_counter() - start


def main(argv: list[str]) -> int:
    if len(argv) < 3 or any("=" not in a for a in argv[2:]):
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    if importlib.util.find_spec("acl") is None:
        print("ascend_first_run: pyACL (`import acl`) is not importable: source the CANN set_env.sh on a machine "
              "with an Ascend NPU", file=sys.stderr)
        return 2
    from omforge.verify import verify

    recipe, ort_bundle = Path(argv[0]), Path(argv[1])
    want, _ = _generate(ort_bundle, 1 + DECODE_STEPS)
    rows, ok = [], True
    for pair in argv[2:]:
        mode, bundle = pair.split("=", 1)
        gears_ok = verify(Path(bundle), recipe, say=lambda line, m=mode: print(f"[{m}] {line}"))
        _, prefill = _generate(Path(bundle), 1)
        got, total = _generate(Path(bundle), 1 + DECODE_STEPS)
        step_ms = max(total - prefill, 0.0) / DECODE_STEPS * 1e3
        same = got == want
        ok = ok and gears_ok and same
        rows.append((mode, "ok" if gears_ok else "FAIL", "equal" if same else f"DIFFER {got} vs {want}", step_ms))
    print(f"\n{'mode':<10} {'gears vs twin':<14} {'greedy tokens vs ORT':<22} decode ms/step (incl. engine)")
    for mode, gears, tokens, ms in rows:
        print(f"{mode:<10} {gears:<14} {tokens:<22} {ms:.2f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
