"""``omforge diff``: where a fused graph differs from its unfused reference, and by how much.

Three views of a pair of graphs A (reference) and B (candidate) with the same interface
(``input_ids``/``position_ids`` [batch, seq] → outputs):

* **structure**: op-type histograms side by side, total nodes (≈ kernel launches per forward) and nodes
  per decoder layer (from the exporter's ``omforge.scope`` metadata);
* **provenance**: every fused region of B and the original nodes of A it replaced. Recorded by replaying
  the fusions and the ORT lowering on A, one pass at a time, with every original node tagged in its
  metadata: the onnxscript rewriter merges the metadata of the nodes a rule matched into the nodes it
  creates, so each fused node carries the tags of everything it stands for, through rewrites of rewrites
  (AddRMSNorm takes in an RMSNorm; lowering expands a neutral op). Around each pass the node sets are
  diffed for the rest: what a hand-written rewrite (qkv_merge) replaced, and the dead code a rewrite left
  (a causal mask, shape arithmetic), charged to the rewrite that read it. The replay must reproduce B's
  histogram; otherwise provenance is reported as unavailable rather than guessed;
* **numerics**: both graphs run with ONNX Runtime on the same random tokens; max abs error, relative
  error (max abs error over max |A|, normwise, so near-zero logits do not blow it up) and top-1
  agreement per output; with ``per_fusion``, the same for a graph per fusion.

One module per view: :mod:`~omforge.diff.structure`, :mod:`~omforge.diff.provenance`, :mod:`~omforge.diff.parity`,
:mod:`~omforge.diff.render`; the options and the result are in :mod:`~omforge.diff.types`; this one holds the entry
point.

Entry point: :func:`run` → :class:`~omforge.diff.types.DiffResult`; :func:`~omforge.diff.render.render_text` /
:func:`~omforge.diff.render.render_html` / :meth:`~omforge.diff.types.DiffResult.to_dict` present it.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path

import onnx_ir as ir

from omforge.compile import ort
from omforge.contract import FUSIONS
from omforge.diff.parity import Runner
from omforge.diff.structure import compare_structure
from omforge.diff.types import DiffOptions, DiffResult, FusionDrift, OutputDrift
from omforge.errors import OmforgeError, one_line

INPUTS = ("input_ids", "position_ids")
BUILDS_ON: dict[str, tuple[str, ...]] = {"add_rms_norm": ("rms_norm",)}
"""Fusions that only match on another's output: a per-fusion graph enables those too (else it matches 0)."""

Progress = Callable[[str], None]


# ---------------------------------------------------------------------------------------- entry point


def run(a: Path, b: Path | None, options: DiffOptions, progress: Progress | None = None) -> DiffResult:
    """Diff two ONNX graphs, or (``b`` None) an export directory's unfused graph against its fused one."""
    say = progress or (lambda _msg: None)
    _check_options(options)
    if b is None:
        if not a.is_dir():
            raise OmforgeError(f"{a}: give an export directory, or two ONNX files A and B")
        return _diff_export(a, options, say)
    if options.per_fusion:
        raise OmforgeError("--per-fusion builds its graphs from an export: give one export directory")
    a_path, b_path = _onnx_file(a), _onnx_file(b)
    model_a, model_b = _load(a_path), _load(b_path)
    check_interfaces(a_path, model_a, b_path, model_b)
    say("replaying the fusions on A for provenance")
    structure, provenance = compare_structure(model_a, model_b, _recorded_switches(b_path))
    say("running both graphs")
    parity = Runner(a_path, options).compare(b_path)
    return DiffResult(str(a_path), str(b_path), options, structure, provenance, parity, [])


def _diff_export(export_dir: Path, options: DiffOptions, say: Progress) -> DiffResult:
    a_path = _onnx_file(export_dir)
    with tempfile.TemporaryDirectory(prefix="omforge-diff-") as tmp:
        b_path = Path(tmp) / "fused.onnx"
        say("building the fused graph (all fusions, ORT lowering)")
        report = ort.build(export_dir, b_path, fusions=None, block_size=None)
        model_a, model_b = _load(a_path), _load(b_path)
        check_interfaces(a_path, model_a, b_path, model_b)
        say("replaying the fusions on A for provenance")
        structure, provenance = compare_structure(model_a, model_b, None)
        say("running A and B")
        reference = Runner(a_path, options)
        parity = reference.compare(b_path)
        sweep = []
        if options.per_fusion:
            for name in FUSIONS:
                enabled = [f for f in FUSIONS if f == name or f in BUILDS_ON.get(name, ())]
                say(f"per fusion: {name}" + (f" (with {', '.join(e for e in enabled if e != name)})"
                                             if len(enabled) > 1 else ""))
                path = Path(tmp) / f"{name}.onnx"
                single = ort.build(export_dir, path, fusions={f: f in enabled for f in FUSIONS}, block_size=None)
                sweep.append(_fusion_drift(name, enabled, single.fusion_counts[name], single.num_nodes,
                                           reference.compare(path), options.tol))
                for f in (path, path.with_name(path.name + ".data")):
                    f.unlink()
            sweep.append(_fusion_drift("all", list(FUSIONS), sum(report.fusion_counts.values()), report.num_nodes,
                                       parity, options.tol))
    return DiffResult(str(a_path), f"{export_dir} fused (all fusions + ORT lowering, built on the fly)",
                      options, structure, provenance, parity, sweep)


def _fusion_drift(name: str, enabled: list[str], matches: int, nodes: int, parity: list[OutputDrift],
                  tol: float) -> FusionDrift:
    logits = next((o for o in parity if o.name == "logits"), parity[0])
    return FusionDrift(name, enabled, matches, nodes, logits.max_abs, logits.max_rel, logits.max_abs <= tol)


def _check_options(options: DiffOptions) -> None:
    if options.seq < 1 or options.batch < 1:
        raise OmforgeError("--seq and --batch must be at least 1")
    if not options.tol >= 0:
        raise OmforgeError("--tol must be a number >= 0")


# ---------------------------------------------------------------------------------------- loading


def _onnx_file(path: Path) -> Path:
    if path.is_dir():
        model = path / "model.onnx"
        if not model.is_file():
            raise OmforgeError(f"{path}: not an omforge export (no model.onnx)")
        return model
    if not path.exists():
        raise OmforgeError(f"{path}: no such file or directory")
    return path


def _load(path: Path) -> ir.Model:
    try:
        return ir.load(path)
    except Exception as e:
        raise OmforgeError(f"{path}: not a readable ONNX model ({type(e).__name__}: {one_line(e)})") from None


def _recorded_switches(b_path: Path) -> dict[str, bool] | None:
    """The fusions a pipeline-built B had on, from the report the ort build (``compile/ort.py``) writes beside it: a
    fusion that matched nothing changes nothing, so "matched" stands in for "switched on"."""
    report = b_path.with_suffix(".json")
    if not report.is_file():
        return None
    try:
        counts = json.loads(report.read_text()).get("fusion_counts")
    except (ValueError, AttributeError):
        return None
    if not isinstance(counts, dict) or set(counts) != set(FUSIONS):
        return None
    return {f: bool(counts[f]) for f in FUSIONS}


def _interface(model: ir.Model) -> tuple[list[str], list[str]]:
    def describe(v: ir.Value) -> str:
        dtype = v.dtype.name.lower() if v.dtype is not None else "?"
        rank = v.shape.rank() if v.shape is not None else "?"
        return f"{v.name} {dtype} rank {rank}"

    return sorted(describe(v) for v in model.graph.inputs), sorted(v.name for v in model.graph.outputs)


def check_interfaces(a_path: Path, a: ir.Model, b_path: Path, b: ir.Model) -> None:
    """A and B must take the same inputs (name, type, rank) and give the same outputs, and A must take
    exactly ``input_ids`` and ``position_ids`` (the full-recompute interface diff feeds)."""
    (ins_a, outs_a), (ins_b, outs_b) = _interface(a), _interface(b)
    if (ins_a, outs_a) != (ins_b, outs_b):
        raise OmforgeError(f"interfaces differ: {a_path} takes ({', '.join(ins_a)}) → ({', '.join(outs_a)}); "
                           f"{b_path} takes ({', '.join(ins_b)}) → ({', '.join(outs_b)})")
    names = sorted(v.name for v in a.graph.inputs)
    if names != sorted(INPUTS):
        raise OmforgeError(f"{a_path}: inputs are {names}; diff runs graphs taking {', '.join(INPUTS)} [batch, seq] "
                           "(the full-recompute export interface)")

