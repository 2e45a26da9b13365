"""Benchmarks for the passes issue (numbers for the closing note; not a test).

  python benchmarks/bench_passes.py nodes                 nodes per decoder layer, unfused vs fused (exact, marginal)
  python benchmarks/bench_passes.py decode  EXPORT_DIR    decode step: fused vs unfused, batch 1 and 16
  python benchmarks/bench_passes.py pool    EXPORT_DIR    decode step with a pool of 1k vs 32k blocks, batch 16
  python benchmarks/bench_passes.py paged   EXPORT_DIR    paged vs contiguous cache, batch 16, context 512,
                                                          and the paged step over block sizes

Decode steps are timed on pools whose content does not matter for speed (the positions and block tables
say every sequence holds ``context`` tokens); each figure is the median of ``--steps`` runs after warm-up,
the compared cases alternating in rounds in one process so that the machine's drift hits both alike.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx_ir as ir

from omforge.compile.ort import build
from omforge.contract import cdiv
from omforge.passes.decompose import paged_attention
from omforge.passes.lower_ort import LowerPagedAttention
from omforge.passes.options import OrtLoweringOptions
from omforge.passes.pipeline import InsertPagedKV, Pipeline
from omforge.recipe import FUSIONS
from omforge.runtime.ort.ort_executor import OrtExecutor
from omforge.runtime.step import SeqWork, build_step


def interleaved_ms(cases: dict[str, tuple[OrtExecutor, dict[str, np.ndarray]]], steps: int,
                   rounds: int = 5, warmup: int = 3) -> dict[str, float]:
    """Median step time per case, the cases alternating in ``rounds`` so drift of the machine hits all alike."""
    for ex, step in cases.values():
        for _ in range(warmup):
            ex.run(step)
    times: dict[str, list[float]] = {name: [] for name in cases}
    per_round = max(1, steps // rounds)
    for _ in range(rounds):
        for name, (ex, step) in cases.items():
            for _ in range(per_round):
                t0 = time.perf_counter()
                ex.run(step)
                times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def decode_step(batch: int, context: int, block_size: int, num_blocks: int, contiguous: bool = False) -> dict:
    """``batch`` sequences each decoding one token at position ``context - 1``; tables spread over the pool."""
    per_seq = cdiv(context, block_size)
    rng = np.random.default_rng(0)
    if contiguous:
        tables = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(batch)]
    else:  # random distinct blocks anywhere in the pool: a fragmented, realistic pool
        ids = rng.choice(num_blocks, size=batch * per_seq, replace=False)
        tables = [ids[b * per_seq:(b + 1) * per_seq].tolist() for b in range(batch)]
    return build_step([SeqWork([int(rng.integers(3, 1000))], context - 1, t) for t in tables], block_size)


class ContiguousPagedAttention(LowerPagedAttention):
    """The contiguous-cache baseline: each sequence owns a fixed slot range; the context is a reshape."""

    def rewrite(self, op, q, k, v, kc, vc, slots, tables, qidx, tidx, pos, o, **_):  # noqa: ANN001, ANN201
        node = o.producer()
        a = {name: node.attributes[name].value for name in ("scale", "q_heads", "kv_heads", "block_size")}
        return paged_attention(op, q, k, v, kc, vc, slots, tables, qidx, tidx, pos, **a, attend=self.attend(node),
                               contiguous=True)


def build_contiguous(export_dir: Path, out: Path, block_size: int):  # noqa: ANN201
    from onnxscript.rewriter import pattern

    class Contiguous(ir.passes.InPlacePass):
        def call(self, model: ir.Model) -> ir.passes.PassResult:
            n = pattern.RewriteRuleSet([ContiguousPagedAttention.rule("contiguous")]).apply_to_model(model)
            return ir.passes.PassResult(model, modified=n > 0)

    model = ir.load(export_dir / "model.onnx")
    # the ort pipeline (plain lowering: the baseline writes its contiguous cache in the graph) with the
    # contiguous attention rewritten between the paged-KV insertion and the lowering
    passes = Pipeline("ort", block_size=block_size, lowering=OrtLoweringOptions(kv_write="graph")).passes()
    at = next(i for i, p in enumerate(passes) if isinstance(p, InsertPagedKV)) + 1
    ir.passes.PassManager([*passes[:at], Contiguous(), *passes[at:]])(model)
    layout = passes[at - 1].layout
    out.parent.mkdir(parents=True, exist_ok=True)
    ir.save(model, out, external_data=out.name + ".data")
    return layout


def cmd_nodes(_: argparse.Namespace) -> None:
    """Marginal nodes per decoder layer: (nodes of a 2-layer model) − (nodes of a 1-layer model)."""
    from omforge.contract.manifest import ModelConfig
    from omforge.export.onnx_export import Timings, export_checkpoint
    from omforge.export.weights import random_checkpoint

    counts = {}
    with tempfile.TemporaryDirectory() as tmp:
        for layers in (1, 2):
            cfg = ModelConfig(family="llama", vocab_size=512, hidden_size=576, intermediate_size=1536,
                              num_hidden_layers=layers, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                              tie_word_embeddings=True)
            d = Path(tmp) / str(layers)
            d.mkdir()
            meta = export_checkpoint(random_checkpoint(cfg, 0), d, 18, Timings(quiet=True))
            fused = build(d, d / "fused" / "model.onnx")
            paged = build(d, d / "paged" / "model.onnx", block_size=16)
            counts[layers] = (meta["num_nodes"], fused.num_nodes, paged.num_nodes)
    names = ("unfused (export)", "fused + ORT-lowered", "fused + paged + ORT-lowered")
    print("nodes per decoder layer (SmolLM2 shape; 2-layer minus 1-layer model):")
    for i, name in enumerate(names):
        print(f"  {name:30s} {counts[2][i] - counts[1][i]:4d}")


def cmd_decode(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        graphs = {
            "fused": build(args.export, Path(tmp) / "fused" / "model.onnx", block_size=args.block_size),
            "unfused": build(args.export, Path(tmp) / "unfused" / "model.onnx", block_size=args.block_size,
                             fusions={f: False for f in FUSIONS}),
        }
        print(f"decode step, context {args.context}, block size {args.block_size} (median of {args.steps}):")
        executors = {name: OrtExecutor(Path(tmp) / name / "model.onnx", report.layout, num_blocks=1024)
                     for name, report in graphs.items()}
        for batch in (1, 16):
            step = decode_step(batch, args.context, args.block_size, 1024)
            ms = interleaved_ms({name: (ex, step) for name, ex in executors.items()}, args.steps)
            print(f"  batch {batch:2d}: unfused {ms['unfused']:7.2f} ms  fused {ms['fused']:7.2f} ms  "
                  f"speed-up {ms['unfused'] / ms['fused']:.2f}x  ({graphs['unfused'].num_nodes} vs "
                  f"{graphs['fused'].num_nodes} nodes)")


def cmd_pool(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        report = build(args.export, Path(tmp) / "model.onnx", block_size=args.block_size, kv_write=args.kv_write)
        cases = {blocks: (OrtExecutor(Path(tmp) / "model.onnx", report.layout, num_blocks=blocks),
                          decode_step(16, args.context, args.block_size, blocks)) for blocks in (1024, args.big_pool)}
        ms = interleaved_ms(cases, args.steps)
        for blocks, (ex, _) in cases.items():
            gb = 2 * report.layout.num_layers * ex.key_pools[0].nbytes / 1e9
            print(f"  pool {blocks:6d} blocks ({gb:5.1f} GB of KV allocated, block size {args.block_size}): "
                  f"{ms[blocks]:7.2f} ms per decode step, batch 16, context {args.context}")
        print(f"  ratio {args.big_pool} / 1024 blocks: {ms[args.big_pool] / ms[1024]:.3f}  (kv_write={args.kv_write})")


def cmd_paged(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        batch, context = 16, args.context
        for bs in args.block_sizes:
            per_seq = cdiv(context, bs)
            report = build(args.export, Path(tmp) / f"p{bs}" / "model.onnx", block_size=bs)
            layout = build_contiguous(args.export, Path(tmp) / f"c{bs}" / "model.onnx", bs)
            ms = interleaved_ms({
                "paged": (OrtExecutor(Path(tmp) / f"p{bs}" / "model.onnx", report.layout,
                                      num_blocks=batch * per_seq * 2),
                          decode_step(batch, context, bs, batch * per_seq * 2)),
                "contiguous": (OrtExecutor(Path(tmp) / f"c{bs}" / "model.onnx", layout, num_blocks=batch * per_seq),
                               decode_step(batch, context, bs, batch * per_seq, contiguous=True)),
            }, args.steps)
            paged, contiguous = ms["paged"], ms["contiguous"]
            print(f"  block size {bs:4d}: paged {paged:7.2f} ms  contiguous {contiguous:7.2f} ms  "
                  f"ratio {paged / contiguous:.2f}x  (batch {batch}, context {context})")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("nodes").set_defaults(func=cmd_nodes)
    for name, func, ctx in (("decode", cmd_decode, 128), ("pool", cmd_pool, 512), ("paged", cmd_paged, 512)):
        s = sub.add_parser(name)
        s.add_argument("export", type=Path)
        s.add_argument("--context", type=int, default=ctx)
        s.add_argument("--block-size", type=int, default=16)
        s.add_argument("--block-sizes", type=int, nargs="+", default=[16, 32, 64, 128, 256])
        s.add_argument("--steps", type=int, default=20)
        s.add_argument("--kv-write", choices=["runtime", "graph"], default="runtime")
        s.add_argument("--big-pool", type=int, default=32768, help="pool: the large pool, in blocks")
        s.set_defaults(func=func)
    args = p.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    sys.exit(main())
