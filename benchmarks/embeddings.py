"""Embeddings throughput (issue 47 item 5): documents per second of omforge's pooling bundle (task embed, through
the engine: ``LLM.embed``) against sentence-transformers on torch CPU — and its ONNX Runtime and OpenVINO
backends where optimum is installed — on the SAME random-weight Hugging Face directory, in one sitting.

    python benchmarks/embeddings.py [--shape qwen3-embedding-0.6b] [--batches 1,32,128] [--lengths 256,1024]
                                    [--runs 3] [--weights float32,bfloat16] [--threads N] [--work DIR]

smoke (seconds): python benchmarks/embeddings.py --shape tiny --batches 1,4 --lengths 16,32 --runs 1

What runs: the HF directory (a Qwen3ForCausalLM of the shape with random weights, seed 0, plus a stand-in
tokenizer so sentence-transformers can load it) is made once under ``--work``; omforge compiles it per
``--weights`` (stage cache under ``--work`` unless OMFORGE_CACHE_DIR is set). Every engine gets the same documents:
random token ids of exactly L tokens (tokenization is not timed, for either side). A measurement is one batch of
B documents handed over at once (omforge: ``LLM.embed`` of B inputs, which the engine runs in steps of at most
``--step-tokens`` tokens; sentence-transformers: one forward of its modules — Transformer, last-token Pooling,
Normalize — on the padded batch), repeated until at least ``--min-docs`` documents are done; docs/s is documents
over wall time. Rows are interleaved (each run measures every engine once), after one warm-up batch each; the table
shows the median over ``--runs`` and omforge's ratio to the best peer of that row. Expect minutes per row at the
0.6B shape with 1,024-token documents on a small machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

SHAPES = {
    # Qwen/Qwen3-Embedding-0.6B's config
    "qwen3-embedding-0.6b": dict(vocab_size=151669, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                 num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                 max_position_embeddings=32768, eos_token_id=151643),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, eos_token_id=1),
}
Embed = Callable[[list[list[int]]], np.ndarray]


def make_hf_dir(path: Path, shape: str, layers: int | None = None) -> Path:
    """The random-weight Qwen3 of ``shape`` (``layers``: fewer layers, for a quick look) as a Hugging Face
    directory (once), with a stand-in tokenizer."""
    if (path / "config.json").is_file():
        return path
    import torch
    from tokenizers import Tokenizer, models
    from transformers import AutoConfig, AutoModelForCausalLM

    dims = {**SHAPES[shape], **({"num_hidden_layers": layers} if layers else {})}
    cfg = AutoConfig.for_model("qwen3", rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
                               bos_token_id=None, **dims)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    # inputs are token ids: the tokenizer only lets sentence-transformers load the directory
    Tokenizer(models.WordLevel({"<unk>": 0, "<|endoftext|>": 1}, unk_token="<unk>")).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<|endoftext|>", "unk_token": "<unk>",
         "model_max_length": cfg.max_position_embeddings}))
    return path


def omforge_engine(hf: Path, work: Path, weights: str, args: argparse.Namespace) -> Embed:
    """Compile the directory as an embed bundle with ``weights`` and return its batch → vectors function."""
    import yaml

    from omforge.compile.compiler import compile_recipe
    from omforge.recipe import load_recipe
    from omforge.runtime.llm import LLM

    longest, most = max(args.lengths), max(args.batches)
    recipe = work / f"embed-{weights}.yaml"
    recipe.write_text(yaml.safe_dump({
        "task": "embed", "pooling": {"normalize": True, "matryoshka": True},
        "model": {"name": f"bench-{work.name}", "source": "hf", "path": str(hf), "family": "qwen3"},
        "compile": {"weights": weights, "max_seq_len": longest, "max_batch_size": most,
                    "max_num_tokens": max(args.step_tokens, longest)}}))
    os.environ.setdefault("OMFORGE_CACHE_DIR", str(work / "cache"))
    bundle = work / f"bundle-{weights}"
    compile_recipe(load_recipe(recipe), bundle, quiet=True)
    llm = LLM(bundle, max_num_seqs=most, max_num_batched_tokens=max(args.step_tokens, longest),
              threads=args.threads)
    return lambda docs: np.stack(llm.embed(docs))


def st_engine(hf: Path, backend: str, args: argparse.Namespace) -> Embed:
    """sentence-transformers' modules (Transformer, last-token Pooling, Normalize) on ``backend``; raises
    ImportError where the backend's packages (optimum) are missing."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    if args.threads:
        torch.set_num_threads(args.threads)
    body = Transformer(str(hf), backend=backend)
    model = SentenceTransformer(modules=[body, Pooling(body.get_embedding_dimension(), "lasttoken"), Normalize()],
                                device="cpu").eval()

    def embed(docs: list[list[int]]) -> np.ndarray:
        ids = torch.tensor(docs)  # one length per measurement: no padding
        with torch.inference_mode():
            out = model({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
        return out["sentence_embedding"].float().numpy()

    return embed


def docs_per_second(embed: Embed, docs: list[list[int]], min_docs: int) -> float:
    calls = max(1, math.ceil(min_docs / len(docs)))
    t = time.perf_counter()
    for _ in range(calls):
        embed(docs)
    return calls * len(docs) / (time.perf_counter() - t)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-embedding-0.6b")
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 32, 128])
    ap.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[256, 1024])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--weights", default="float32", help="omforge rows, comma-separated: float32, bfloat16, int8")
    ap.add_argument("--peers", default="torch,onnx,openvino", help="sentence-transformers backends to try")
    ap.add_argument("--threads", type=int, default=None, help="intra-op threads for every engine (default: theirs)")
    ap.add_argument("--step-tokens", type=int, default=16384, help="omforge's token budget per engine step")
    ap.add_argument("--min-docs", type=int, default=32, help="documents per measurement at least (batch 1: calls)")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the shape's (a quick look only)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/omforge-bench-embeddings"))
    args = ap.parse_args()
    work = args.work / (args.shape + (f"-{args.layers}l" if args.layers else ""))
    hf = make_hf_dir(work / "hf", args.shape, args.layers)
    engines: dict[str, Embed] = {}
    for weights in args.weights.split(","):
        print(f"[bench] compiling omforge {weights} …", file=sys.stderr, flush=True)
        engines[f"omforge {weights}"] = omforge_engine(hf, work, weights, args)
    peers = []
    for backend in args.peers.split(","):
        try:
            engines[f"sentence-transformers {backend}"] = st_engine(hf, backend, args)
            peers.append(f"sentence-transformers {backend}")
        except Exception as e:  # a backend whose packages are not installed (optimum): said, not measured
            print(f"[bench] sentence-transformers {backend}: not measured ({type(e).__name__}: {str(e)[:120]})",
                  file=sys.stderr)
    rng = np.random.default_rng(0)
    vocab = SHAPES[args.shape]["vocab_size"]
    probe = rng.integers(2, vocab, size=(2, min(args.lengths))).tolist()
    first, *_ = outs = {name: embed(probe) for name, embed in engines.items()}.items()
    for name, vecs in outs:  # the same model: every engine's vectors agree with the first's
        cos = float((vecs * first[1]).sum(-1).min())
        print(f"[bench] {name}: cosine to {first[0]} {cos:.6f}", file=sys.stderr)
        if cos < 0.999:
            print(f"[bench] WARNING: {name} disagrees with {first[0]}", file=sys.stderr)
    rates: dict[tuple[str, int, int], list[float]] = {}
    for length in args.lengths:
        for batch in args.batches:
            docs = rng.integers(2, vocab, size=(batch, length)).tolist()
            for embed in engines.values():  # warm-up, untimed
                embed(docs[:min(batch, 4)])
            for run in range(args.runs):
                for name, embed in engines.items():
                    rate = docs_per_second(embed, docs, args.min_docs)
                    rates.setdefault((name, length, batch), []).append(rate)
                    print(f"[bench] L={length} B={batch} run {run}: {name} {rate:.2f} docs/s", file=sys.stderr,
                          flush=True)
    print(f"\nEmbeddings, {args.shape} (random weights), docs/s, median of {args.runs} run(s); "
          f"threads {args.threads or 'default'}; {os.cpu_count()} CPUs\n")
    names = list(engines)
    print("| tokens/doc | batch | " + " | ".join(names) + " | omforge / best peer |")
    print("|---|---|" + "---|" * (len(names) + 1))
    for length in args.lengths:
        for batch in args.batches:
            med = {n: statistics.median(rates[(n, length, batch)]) for n in names}
            best_ours = max(v for n, v in med.items() if n.startswith("omforge"))
            best_peer = max((med[p] for p in peers), default=None)
            ratio = f"{best_ours / best_peer:.2f}×" if best_peer else "n/a"
            print(f"| {length} | {batch} | " + " | ".join(f"{med[n]:.2f}" for n in names) + f" | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
