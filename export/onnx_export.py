"""Export a recipe's model to the *unfused* ONNX graph: primitive ops only, dynamic batch and sequence.

Output directory (an "export"):
  model.onnx        graph; inputs ``input_ids``/``position_ids`` [batch, seq] int64,
                    output ``logits`` [batch, seq, vocab]
  model.onnx.data   the weights, as ONNX external data (one file; the tied embedding stored once)
  tokenizer.json    the tokenizer (``tokenizers`` format), when the model has one
  export.json       model config, tokenizer metadata, opset, op histogram, the recipe digest, timings

Invariants: opset_import holds exactly one entry (the default domain, version ``compile.opset`` ≤ 18,
which ATC's ONNX parser requires); no op outside the ONNX standard domain; onnx.checker passes with
``full_check``; every MatMul weight initializer is named after its torch parameter (``<param>.T``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import sys
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from omforge.export.tokenizer_files import write_tokenizer
from omforge.export.weights import Checkpoint, load_checkpoint
from omforge.file_lock import locked
from omforge.recipe import Recipe

EXPORT_FORMAT = 3  # 2: GGUF blocks kept beside the graph (source_blocks.npz); 3: streamed, per-tensor random seeds
SOURCE_BLOCKS = "source_blocks.npz"
INPUTS = ("input_ids", "position_ids")
OUTPUT = "logits"


@dataclass
class Timings:
    """Wall time per stage, printed as it goes (``quiet`` silences the printing, not the recording)."""

    quiet: bool = False
    stages: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        if not self.quiet:
            print(f"[export] {name} …", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        yield
        self.stages[name] = round(time.perf_counter() - t0, 3)
        if not self.quiet:
            print(f"[export] {name}: {self.stages[name]:.1f}s", file=sys.stderr, flush=True)


def recipe_digest(recipe: Recipe) -> str:
    """Hash of what determines the export: the model section, the opset, and the weight file's identity."""
    m = recipe.model
    ident: dict[str, Any] = {"model": m.model_dump(), "opset": recipe.compile.opset, "format": EXPORT_FORMAT}
    if m.source != "random":
        p = recipe.weights_path()
        files = [p] if p.is_file() else sorted(p.iterdir())
        ident["files"] = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.is_file()]
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:16]


def export_recipe(recipe: Recipe, out_dir: Path, quiet: bool = False) -> dict[str, Any]:
    """Run the whole export into ``out_dir``; returns the export.json contents."""
    timings = Timings(quiet)
    out_dir.mkdir(parents=True, exist_ok=True)
    with timings.stage("load weights"):
        ckpt = load_checkpoint(recipe)
    with timings.stage("tokenizer"):
        tok = write_tokenizer(recipe, ckpt, out_dir)
    meta = export_checkpoint(ckpt, out_dir, recipe.compile.opset, timings)
    meta.update(name=recipe.model.name, recipe_digest=recipe_digest(recipe), tokenizer=tok, timings=timings.stages)
    (out_dir / "export.json").write_text(json.dumps(meta, indent=2))
    return meta


def export_checkpoint(ckpt: Checkpoint, out_dir: Path, opset: int, timings: Timings) -> dict[str, Any]:
    """torch → ONNX (dynamo exporter) traced without weights → weights attached lazily → save → check.

    The torch model, its buffers and the example inputs live on the meta device: tracing allocates no weight.
    The graph's initializers are then bound to ``ckpt.tensors`` as lazy tensors (the ``<param>.T`` MatMul
    weights as lazy transposes), and ``ir.save`` streams them into the external data one at a time, so the
    export's peak memory is the graph plus the largest tensor, whatever the model's size."""
    import onnx
    import onnx_ir as ir
    import torch

    from omforge.models.llama import LlamaForCausalLM, rope_inv_freq

    with timings.stage("build torch model"):
        with torch.device("meta"):
            model = LlamaForCausalLM(ckpt.config)
        inv_freq = rope_inv_freq(ckpt.config)
        model.register_buffer("inv_freq", inv_freq.to("meta"), persistent=False)
        model.eval()
    with timings.stage("torch.onnx.export"):
        # batch 2 / seq 8 as examples: a size-1 example would be specialised away by torch.export.
        ids = torch.zeros((2, 8), dtype=torch.int64, device="meta")
        pos = torch.zeros((2, 8), dtype=torch.int64, device="meta")
        batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq")
        logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # exporter deprecation chatter; real failures raise
            program = torch.onnx.export(
                model, (ids, pos), dynamo=True, opset_version=opset, optimize=False, verbose=False,
                input_names=list(INPUTS), output_names=[OUTPUT],
                dynamic_shapes={"input_ids": {0: batch, 1: seq}, "position_ids": {0: batch, 1: seq}},
            )
        graph_model: ir.Model = program.model
    with timings.stage("bind weights, optimize"):
        _bind_weights(graph_model.graph, ckpt, {"inv_freq": inv_freq.numpy()})
        import onnxscript.optimizer

        onnxscript.optimizer.optimize_ir(graph_model)  # what the exporter's optimize=True runs
        _strip_torch_metadata(graph_model.graph)
        graph_model.producer_name = "omforge"
    with timings.stage("save"):
        onnx_path = out_dir / "model.onnx"
        ir.save(graph_model, onnx_path, external_data="model.onnx.data")
    with timings.stage("onnx.checker (full)"):
        onnx.checker.check_model(str(onnx_path), full_check=True)
    proto = onnx.load(str(onnx_path), load_external_data=False)
    if len(proto.opset_import) != 1 or proto.opset_import[0].domain not in ("", "ai.onnx"):
        raise RuntimeError(f"export produced opset imports {proto.opset_import}; ATC needs exactly one")
    return {
        "format": EXPORT_FORMAT,
        "config": ckpt.config.to_dict(),
        "opset": opset,
        "inputs": list(INPUTS),
        "output": OUTPUT,
        "num_nodes": len(proto.graph.node),
        # the last layer: shared shape math is CSE'd into layer 0
        "nodes_per_layer": nodes_in_layer(proto, ckpt.config.num_hidden_layers - 1),
        "op_histogram": dict(Counter(n.op_type for n in proto.graph.node).most_common()),
        "source": str(ckpt.source) if ckpt.source else None,
        "source_blocks": _save_blocks(ckpt, out_dir),
    }


def _bind_weights(graph, ckpt: Checkpoint, buffers: dict[str, np.ndarray]) -> None:  # noqa: ANN001 - ir.Graph
    """Give the meta-traced initializers their values, lazily. A parameter read only through ``Transpose(perm
    [1, 0])`` (a Linear's ``x @ W.T``) becomes the initializer ``<param>.T`` holding the transposed array, read
    straight by its MatMul; the tied embedding, read by Gather and by the lm_head's Transpose, stays one
    initializer and its Transpose output is named ``lm_head.weight.T``."""
    import onnx_ir as ir

    def lazy(name: str, shape: tuple[int, ...], transposed: bool) -> ir.LazyTensor:
        def read() -> ir.Tensor:
            arr = ckpt.tensors[name]
            return ir.tensor(np.ascontiguousarray(arr.T) if transposed else arr)
        return ir.LazyTensor(read, dtype=ir.DataType.FLOAT, shape=ir.Shape(shape[::-1] if transposed else shape),
                             name=name + (".T" * transposed))

    for name, value in list(graph.initializers.items()):
        if name in buffers:
            value.const_value = ir.tensor(buffers[name], name=name)
            continue
        if name not in ckpt.tensors:
            raise RuntimeError(f"export: initializer '{name}' is neither a weight nor a known buffer")
        shape = tuple(ckpt.tensors.shapes[name]) if hasattr(ckpt.tensors, "shapes") else ckpt.tensors[name].shape
        uses = list(value.uses())
        transposes = [u.node for u in uses if u.node.op_type == "Transpose"
                      and list(u.node.attributes.get_ints("perm", [])) == [1, 0]]
        if len(uses) == 1 and len(transposes) == 1:
            node = transposes[0]
            graph.initializers.pop(name)
            weight = ir.Value(name=name + ".T", shape=ir.Shape(shape[::-1]), type=ir.TensorType(ir.DataType.FLOAT),
                              const_value=lazy(name, shape, transposed=True))
            graph.register_initializer(weight)
            node.outputs[0].replace_all_uses_with(weight)
            graph.remove(node, safe=True)
            continue
        value.const_value = lazy(name, shape, transposed=False)
        for node in transposes:  # the tied embedding's lm_head read
            node.name = "lm_head_tied_transpose"
            node.outputs[0].name = "lm_head.weight.T"


def _save_blocks(ckpt: Checkpoint, out_dir: Path) -> dict[str, Any] | None:
    """The GGUF blocks the ORT lowering can use as they are (``passes/quant.py``), beside the graph: an
    uncompressed npz (one array per tensor, read lazily) and their types and K in export.json."""
    if not ckpt.blocks:
        return None
    np.savez(out_dir / SOURCE_BLOCKS, **{name: data for name, (_, data, _) in ckpt.blocks.items()})
    return {"file": SOURCE_BLOCKS, "tensors": {name: {"type": kind, "k": k}
                                               for name, (kind, _, k) in ckpt.blocks.items()}}


def load_source_blocks(export_dir: Path) -> dict[str, tuple[str, np.ndarray, int]]:
    """The GGUF blocks an export kept (:func:`_save_blocks`), by torch weight name; empty when none."""
    meta = json.loads((export_dir / "export.json").read_text()).get("source_blocks")
    if not meta:
        return {}
    arrays = np.load(export_dir / meta["file"])
    return {name: (t["type"], arrays[name], int(t["k"])) for name, t in meta["tensors"].items()}


def nodes_in_layer(proto, layer: int) -> int:  # noqa: ANN001 - onnx.ModelProto
    """Nodes the exporter attributed to decoder layer ``layer`` (by the ``omforge.scope`` metadata)."""
    prefix = f"model.layers.{layer}"
    count = 0
    for node in proto.graph.node:
        scope = next((p.value for p in node.metadata_props if p.key == "omforge.scope"), "")
        count += scope == prefix or scope.startswith(prefix + ".")
    return count


def _scope(node) -> str:  # noqa: ANN001 - onnx_ir.Node
    """The innermost torch module path of a node, from the exporter's metadata (``""`` if absent)."""
    scopes = node.metadata_props.get("pkg.torch.onnx.name_scopes")
    if not scopes:
        return ""
    parts = json.loads(scopes.replace("'", '"'))
    scope = parts[-2] if len(parts) >= 2 else ""
    return scope if scope.startswith(("model", "lm_head")) else ""


def _strip_torch_metadata(graph) -> None:  # noqa: ANN001
    """Keep only the module scope (used by the passes and by diff); drop stack traces and FX dumps."""
    for node in graph:
        scope = _scope(node)
        node.metadata_props.clear()
        if scope:
            node.metadata_props["omforge.scope"] = scope


def cached_export_dir(recipe: Recipe, cache_root: Path) -> Path:
    """Where :func:`cached_export` keeps the export of ``recipe``: ``cache_root/<name>-<digest>``."""
    return cache_root / f"{recipe.model.name}-{recipe_digest(recipe)}"


def is_exported(out: Path) -> bool:
    return (out / "export.json").is_file() and (out / "model.onnx").is_file()


def cached_export(recipe: Recipe, cache_root: Path, quiet: bool = False, isolated: bool = False,
                  lock: bool = True) -> Path:
    """The export for ``recipe`` under ``cache_root/<name>-<digest>``, made once and reused while the digest holds
    (under the stage cache's lock: two processes sharing ``cache_root`` export it once).
    ``isolated``: export in a child process, so that what torch and the exporter hold is returned to the system
    before the caller's next stage (compile: the passes stage's peak then does not add to the export's). ``lock``
    False: the caller already holds the folder's lock (``locked(cached_export_dir(...))``; flock does not nest)."""
    out = cached_export_dir(recipe, cache_root)
    with locked(out) if lock else contextlib.nullcontext():  # another process sharing the cache exports it once
        if is_exported(out):
            return out
        if not isolated:
            export_recipe(recipe, out, quiet=quiet)
            return out
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        sys.stdout.flush()
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            pool.submit(export_recipe, recipe, out, quiet).result()  # the child's errors are raised here
    return out
