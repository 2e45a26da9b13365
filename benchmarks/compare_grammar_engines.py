"""Grammar engines side by side on one tokenizer and schema: set-up, compile and per-token mask time.

    pip install xgrammar llguidance; python benchmarks/compare_grammar_engines.py TOKENIZER_DIR [VOCAB]

TOKENIZER_DIR holds a tokenizer.json (a bundle's, copied alone into a folder); VOCAB is the logits' width
(SmolLM2: 49152). A valid answer to a nested schema ($ref, enum, pattern, array bounds) is fed token by token.
xgrammar is not an omforge dependency (it needs torch); this is how the choice in runtime/structured.py was made.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["name", "age", "city", "tags", "address"],
    "properties": {
        "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0},
        "city": {"type": "string", "enum": ["Paris", "Berlin", "Rome"]},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3},
        "address": {"$ref": "#/$defs/addr"}},
    "$defs": {"addr": {"type": "object", "additionalProperties": False, "required": ["street", "zip"],
                       "properties": {"street": {"type": "string"},
                                      "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}},
}
ANSWER = {"name": "Ada Lovelace", "age": 36, "city": "Paris", "tags": ["math", "poetry"],
          "address": {"street": "12 Rue de Rivoli", "zip": "75001"}}


def run_xgrammar(hf: Any, vocab: int, ids: list[int]) -> tuple[float, float, list[float]]:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
    t1 = time.perf_counter()
    compiled = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False).compile_json_schema(
        json.dumps(SCHEMA), strict_mode=True)
    t2 = time.perf_counter()
    matcher, mask, times = xgr.GrammarMatcher(compiled), xgr.allocate_token_bitmask(1, info.vocab_size), []
    for token in ids:
        start = time.perf_counter()
        matcher.fill_next_token_bitmask(mask)
        times.append(time.perf_counter() - start)
        if not matcher.accept_token(token):
            raise RuntimeError(f"xgrammar refused token {token}")
    return t1 - t0, t2 - t1, times


def run_llguidance(hf: Any, vocab: int, ids: list[int]) -> tuple[float, float, list[float]]:
    import llguidance
    import llguidance.hf
    import llguidance.numpy as lnp

    t0 = time.perf_counter()
    tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
    t1 = time.perf_counter()
    matcher = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA)))
    t2 = time.perf_counter()
    mask, times = lnp.allocate_token_bitmask(1, tok.vocab_size), []
    for token in ids:
        start = time.perf_counter()
        lnp.fill_next_token_bitmask(matcher, mask, 0)
        times.append(time.perf_counter() - start)
        if not matcher.consume_token(token):
            raise RuntimeError(f"llguidance refused token {token}: {matcher.get_error()}")
    return t1 - t0, t2 - t1, times


def main() -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(sys.argv[1])
    vocab = int(sys.argv[2]) if len(sys.argv) > 2 else 49152
    ids = hf.encode(json.dumps(ANSWER), add_special_tokens=False)
    engines: dict[str, Callable[[Any, int, list[int]], tuple[float, float, list[float]]]] = {
        "xgrammar": run_xgrammar, "llguidance": run_llguidance}
    for name, run in engines.items():
        try:
            setup, compile_s, times = run(hf, vocab, ids)
        except Exception as e:  # an engine that is not installed or fails: say so, measure the others
            print(f"{name}: {type(e).__name__}: {e}")
            continue
        print(f"{name}: tokenizer {setup:.3f} s, compile {compile_s * 1e3:.1f} ms, mask median "
              f"{statistics.median(times) * 1e6:.1f} µs, max {max(times) * 1e6:.1f} µs over {len(times)} tokens")


if __name__ == "__main__":
    main()
