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

Entry point: :func:`run` → :class:`DiffResult`; :func:`render_text` / :func:`render_html` /
:meth:`DiffResult.to_dict` present it.
"""

from __future__ import annotations

import itertools
import json
import re
import statistics
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Mapping

import numpy as np
import onnx_ir as ir

from omforge.errors import OmforgeError
from omforge.passes import manager, pipeline
from omforge.passes.pipeline import Pipeline
from omforge.recipe import FUSIONS

LOWERING = "ort_lowering"
INPUTS = ("input_ids", "position_ids")
EXAMPLES = 3
BUILDS_ON: dict[str, tuple[str, ...]] = {"add_rms_norm": ("rms_norm",)}
"""Fusions that only match on another's output: a per-fusion graph enables those too (else it matches 0)."""

_LAYER = re.compile(r"^model\.layers\.(\d+)(?:\.|$)")

Progress = Callable[[str], None]


# ---------------------------------------------------------------------------------------- result types


@dataclass
class DiffOptions:
    seq: int = 32
    batch: int = 1
    seed: int = 0
    tol: float = 1e-3
    per_fusion: bool = False


@dataclass
class OpCount:
    op: str
    a: int
    b: int

    @property
    def delta(self) -> int:
        return self.b - self.a


@dataclass
class LayerCount:
    layer: int
    a: int
    b: int


@dataclass
class Structure:
    """Op histograms of A and B; ``layers`` is empty when the graphs carry no decoder-layer scopes."""

    ops: list[OpCount]
    total_a: int
    total_b: int
    layers: list[LayerCount]

    @property
    def new_ops(self) -> list[str]:
        """Op types B has and A has not: the fused ops."""
        return [o.op for o in self.ops if o.a == 0 and o.b > 0]

    def layer_median(self) -> tuple[float, float] | None:
        if not self.layers:
            return None
        return statistics.median(c.a for c in self.layers), statistics.median(c.b for c in self.layers)


@dataclass
class NodeRef:
    op: str
    name: str
    scope: str


@dataclass
class FusedRegion:
    """One rewrite as it stands in B: the nodes B runs (``fused``) for the nodes of A they replaced."""

    fusion: str
    scope: str
    fused: list[str]
    replaced: list[NodeRef]
    absorbed: list[str] = field(default_factory=list)  # earlier fusions this region took in (rms_norm …)

    def fused_summary(self) -> str:
        return _summary(self.fused)

    def replaced_summary(self) -> str:
        return _summary([r.op for r in self.replaced])


@dataclass
class FusionSummary:
    """Per fusion: how often it matched, and the regions of B it accounts for (fewer when a later fusion
    absorbed some of its matches)."""

    name: str
    matches: int
    regions: list[FusedRegion]
    absorbed_by: dict[str, int]

    @property
    def examples(self) -> list[FusedRegion]:
        return self.regions[:EXAMPLES]


@dataclass
class Provenance:
    available: bool
    note: str
    fusions: list[FusionSummary]
    unattributed: int  # nodes of A removed outside any region (dead code, merged duplicates)


@dataclass
class OutputDrift:
    name: str
    shape: list[int]
    max_abs: float
    max_rel: float
    top1_agree: int
    rows: int


@dataclass
class FusionDrift:
    """One graph of the per-fusion sweep: ``fusion`` (with what it builds on) enabled alone, or ``all``."""

    fusion: str
    enabled: list[str]
    matches: int
    nodes: int
    max_abs: float
    max_rel: float
    passed: bool


@dataclass
class DiffResult:
    a: str
    b: str
    options: DiffOptions
    structure: Structure
    provenance: Provenance
    parity: list[OutputDrift]
    per_fusion: list[FusionDrift]

    @property
    def max_abs(self) -> float:
        drifts = [o.max_abs for o in self.parity] + [f.max_abs for f in self.per_fusion]
        return max(drifts, default=0.0)

    @property
    def passed(self) -> bool:
        return self.max_abs <= self.options.tol

    @property
    def verdict(self) -> str:
        if self.passed:
            return f"PASS: max abs drift {self.max_abs:.3g} <= tol {self.options.tol:g}"
        where = [o.name for o in self.parity if o.max_abs > self.options.tol]
        where += [f"{f.fusion} alone" for f in self.per_fusion if not f.passed and f.fusion != "all"]
        return f"FAIL: max abs drift {self.max_abs:.3g} exceeds tol {self.options.tol:g} ({', '.join(where)})"

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["structure"]["new_ops"] = self.structure.new_ops
        for row, op in zip(d["structure"]["ops"], self.structure.ops):
            row["delta"] = op.delta
        for fs in d["provenance"]["fusions"]:
            for region in fs["regions"]:
                region["replaced"] = [[r["op"], r["name"], r["scope"]] for r in region["replaced"]]
        d.update(max_abs=self.max_abs, passed=self.passed, verdict=self.verdict)
        return d


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
    parity = _Runner(a_path, options).compare(b_path)
    return DiffResult(str(a_path), str(b_path), options, structure, provenance, parity, [])


def _diff_export(export_dir: Path, options: DiffOptions, say: Progress) -> DiffResult:
    a_path = _onnx_file(export_dir)
    with tempfile.TemporaryDirectory(prefix="omforge-diff-") as tmp:
        b_path = Path(tmp) / "fused.onnx"
        say("building the fused graph (all fusions, ORT lowering)")
        report = pipeline.build(export_dir, b_path, fusions=None, block_size=None)
        model_a, model_b = _load(a_path), _load(b_path)
        check_interfaces(a_path, model_a, b_path, model_b)
        say("replaying the fusions on A for provenance")
        structure, provenance = compare_structure(model_a, model_b, None)
        say("running A and B")
        reference = _Runner(a_path, options)
        parity = reference.compare(b_path)
        sweep = []
        if options.per_fusion:
            for name in FUSIONS:
                enabled = [f for f in FUSIONS if f == name or f in BUILDS_ON.get(name, ())]
                say(f"per fusion: {name}" + (f" (with {', '.join(e for e in enabled if e != name)})"
                                             if len(enabled) > 1 else ""))
                path = Path(tmp) / f"{name}.onnx"
                single = pipeline.build(export_dir, path, fusions={f: f in enabled for f in FUSIONS}, block_size=None)
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
    except Exception as e:  # noqa: BLE001 - any parse failure is the user's file, reported in one line
        raise OmforgeError(f"{path}: not a readable ONNX model ({type(e).__name__}: {_one_line(e)})") from None


def _recorded_switches(b_path: Path) -> dict[str, bool] | None:
    """The fusions a pipeline-built B had on, from the report ``pipeline.build`` writes beside it: a fusion
    that matched nothing changes nothing, so "matched" stands in for "switched on"."""
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


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text[:200] + ("…" if len(text) > 200 else "")


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


# ---------------------------------------------------------------------------------------- structure


def op_key(node: ir.Node) -> str:
    """``Op`` for the default domain, ``domain::Op`` otherwise (as :func:`pipeline.histogram`)."""
    return f"{node.domain}::{node.op_type}" if node.domain not in ("", "ai.onnx") else node.op_type


def scope_of(node: ir.Node) -> str:
    return node.metadata_props.get("omforge.scope", "")


def compare_structure(a: ir.Model, b: ir.Model, switches: Mapping[str, bool] | None) -> tuple[Structure, Provenance]:
    """Histograms of ``a`` and ``b``, and the provenance of ``b``'s fused regions (``a`` is consumed: the
    fusions are replayed on it)."""
    hist_a, hist_b = Counter(op_key(n) for n in a.graph), Counter(op_key(n) for n in b.graph)
    layers_a = _layer_counts(a.graph, {})
    new_ops = {op for op in hist_b if op not in hist_a}
    try:
        replay: Replay | None = trace_fusions(a, switches)
    except Exception as e:  # noqa: BLE001 - A may be any graph; its structure and numerics are still worth showing
        replay, failure = None, f"replaying the fusions on A failed ({type(e).__name__}: {_one_line(e)})"
    hist_replay = Counter(op_key(n) for n in a.graph)
    if replay is not None and hist_replay == hist_b:
        provenance = replay.summarize(new_ops)
        layers_b = _layer_counts(a.graph, replay.scopes())  # the replay is B, with scopes for every node
    else:
        layers_b = _layer_counts(b.graph, {})
        if replay is None:
            note = failure
        elif not new_ops and hist_a != hist_b:
            note = "B has no op type A lacks: nothing fused, the graphs differ otherwise"
        elif not new_ops:
            note = "B has the same ops as A: nothing fused"
        else:
            note = (f"B is not omforge's fusion of A (replaying the fusions gives {sum(hist_replay.values())} "
                    f"nodes, B has {sum(hist_b.values())}): provenance of {', '.join(sorted(new_ops))} unknown")
        provenance = Provenance(False, note, [], 0)
    ops = sorted({*hist_a, *hist_b}, key=lambda op: (-max(hist_a[op], hist_b[op]), op))
    layers = [LayerCount(i, layers_a.get(i, 0), layers_b.get(i, 0)) for i in sorted({*layers_a, *layers_b})]
    structure = Structure([OpCount(op, hist_a[op], hist_b[op]) for op in ops], sum(hist_a.values()),
                          sum(hist_b.values()), layers)
    return structure, provenance


def _layer_counts(nodes: Iterable[ir.Node], scopes: Mapping[ir.Node, str]) -> dict[int, int]:
    counts: Counter[int] = Counter()
    for node in nodes:
        m = _LAYER.match(scopes.get(node) or scope_of(node))
        if m:
            counts[int(m.group(1))] += 1
    return dict(counts)


# ---------------------------------------------------------------------------------------- provenance

_ORIGIN = "omforge.diff.origin."
"""Metadata key prefix, one key per original node a node stands for (``omforge.diff.origin.17``). Keys, not
values: the onnxscript rewriter merges the metadata of the nodes a rule matched into the nodes it creates,
keeping the first value of a key that collides, so distinct keys make every fused node carry the union."""


def _origins(node: ir.Node) -> set[int]:
    return {int(k[len(_ORIGIN):]) for k in node.metadata_props if k.startswith(_ORIGIN)}


def _stamp(node: ir.Node, origins: Iterable[int]) -> None:
    for i in origins:
        node.metadata_props[f"{_ORIGIN}{i}"] = "1"


@dataclass
class _Snapshot:
    """The graph just before a pass: its nodes, each node's inputs, each value's producer, the outputs."""

    nodes: set[ir.Node]
    inputs: dict[ir.Node, tuple[ir.Value | None, ...]]
    producer: dict[ir.Value, ir.Node]
    outputs: list[ir.Value]

    @classmethod
    def of(cls, graph: ir.Graph) -> "_Snapshot":
        nodes = list(graph)
        return cls(set(nodes), {n: tuple(n.inputs) for n in nodes},
                   {v: n for n in nodes for v in n.outputs}, list(graph.outputs))

    def consumers(self) -> dict[ir.Node, list[ir.Node]]:
        out: dict[ir.Node, list[ir.Node]] = {}
        for node, inputs in self.inputs.items():
            for v in inputs:
                if v is not None and v in self.producer:
                    out.setdefault(self.producer[v], []).append(node)
        return out


@dataclass
class Replay:
    """The fusions and the ORT lowering replayed on A. Every node carries the original nodes it stands for
    (see :data:`_ORIGIN`); ``fusion_of`` is the last fusion that rewrote an original node, ``dead_parent``
    ties an original that became dead code (a causal mask, shape arithmetic) to an original of the rewrite
    that consumed it."""

    model: ir.Model
    original: list[NodeRef]
    original_nodes: set[ir.Node]
    counts: dict[str, int] = field(default_factory=dict)
    fusion_of: dict[int, str] = field(default_factory=dict)
    dead_parent: dict[int, int] = field(default_factory=dict)
    absorbed: Counter[tuple[str, str]] = field(default_factory=Counter)  # (earlier, absorbing fusion) → matches
    took_in: dict[int, set[str]] = field(default_factory=dict)  # original → earlier fusions that had rewritten it

    def regions(self) -> list[tuple[list[ir.Node], set[int]]]:
        """The fused nodes of the graph grouped by the originals they share, in graph order, with those
        originals (dead code included)."""
        groups: list[tuple[list[ir.Node], set[int]]] = []
        group_of: dict[int, int] = {}
        for node in self.model.graph:
            if node in self.original_nodes:
                continue
            origins = _origins(node)
            hits = sorted({group_of[i] for i in origins if i in group_of})
            if not hits:
                hits = [len(groups)]
                groups.append(([], set()))
            target = groups[hits[0]]
            for other in hits[1:]:  # origins overlap two groups (never for these fusions): one region
                target[0].extend(groups[other][0])
                target[1].update(groups[other][1])
                groups[other] = ([], set())
            target[0].append(node)
            target[1].update(origins)
            for i in target[1]:
                group_of[i] = hits[0]
        groups = [g for g in groups if g[0]]
        index = {i: g for g in groups for i in g[1]}
        for dead in self.dead_parent:
            parent, seen = self.dead_parent[dead], {dead}
            while parent in self.dead_parent and parent not in index and parent not in seen:
                seen.add(parent)
                parent = self.dead_parent[parent]
            if parent in index:
                index[parent][1].add(dead)
        return groups

    def scopes(self) -> dict[ir.Node, str]:
        """A scope for every fused node: its own, else the one its originals share (qkv_merge sets none)."""
        return {node: scope_of(node) or _common_scope([self.original[i].scope for i in origins])
                for nodes, origins in self.regions() for node in nodes}

    def summarize(self, new_ops: set[str]) -> Provenance:
        by_fusion: dict[str, list[FusedRegion]] = {f: [] for f in FUSIONS}
        attributed: set[int] = set()
        for nodes, origins in self.regions():
            fusion = Counter(self.fusion_of[i] for i in origins if i in self.fusion_of).most_common(1)
            if not fusion:
                continue
            fused = [op_key(n) for n in nodes]
            key = [op == "MatMul" or op in new_ops - {"Constant"} for op in fused]  # the kernels, then glue
            fused = [op for op, k in zip(fused, key) if k] + [op for op, k in zip(fused, key) if not k]
            replaced = [self.original[i] for i in sorted(origins)]
            scope = next((s for n in nodes if (s := scope_of(n))), "") or _common_scope([r.scope for r in replaced])
            earlier = sorted({f for i in origins for f in self.took_in.get(i, ())})
            by_fusion[fusion[0][0]].append(FusedRegion(fusion[0][0], scope, fused, replaced, earlier))
            attributed |= origins
        live = {i for n in self.model.graph for i in _origins(n)}
        unattributed = sum(1 for i in range(len(self.original)) if i not in live and i not in attributed)
        fusions = [FusionSummary(f, self.counts.get(f, 0), by_fusion[f],
                                 {by: n for (was, by), n in self.absorbed.items() if was == f}) for f in FUSIONS]
        note = "recorded by replaying the fusions and the ORT lowering on A (the replay reproduces B's histogram)"
        return Provenance(True, note, fusions, unattributed)


def trace_fusions(model: ir.Model, switches: Mapping[str, bool] | None = None) -> Replay:
    """Fuse and lower ``model`` in place as :func:`pipeline.build` does (without paging), one pass at a
    time, recording which original nodes each fused node stands for."""
    switches = dict(switches or {})
    nodes = list(model.graph)
    for i, node in enumerate(nodes):
        _stamp(node, [i])
    replay = Replay(model, [NodeRef(op_key(n), n.name or "", scope_of(n)) for n in nodes], set(nodes))
    replay.counts = {name: 0 for name in FUSIONS}
    passes = Pipeline("ort", switches).passes()
    for i, p in enumerate(passes):
        if isinstance(p, manager.Cleanup):
            continue  # booked with the pass before it
        before = _Snapshot.of(model.graph)
        p(model)
        for cleanup in itertools.takewhile(lambda q: isinstance(q, manager.Cleanup), passes[i + 1:]):
            cleanup(model)
        if isinstance(p, manager.Fusion):
            replay.counts[p.name] = p.count
        _record(replay, before, p.name if isinstance(p, manager.Fusion) else LOWERING)
    return replay


def _record(replay: Replay, before: _Snapshot, pass_name: str) -> None:
    """Book one pass: stamp what a hand-written rewrite created, label fusions, place new dead code."""
    graph = replay.model.graph
    after = list(graph)
    removed = before.nodes - set(after)
    added = [n for n in after if n not in before.nodes]
    unstamped = [n for n in added if not _origins(n)]
    if unstamped:
        _stamp_by_structure(before, graph, removed, unstamped)
    if pass_name != LOWERING:
        for origins in {frozenset(_origins(n)) for n in added}:
            for earlier in {replay.fusion_of[i] for i in origins if i in replay.fusion_of} - {pass_name}:
                replay.absorbed[(earlier, pass_name)] += 1
            for i in origins:
                if replay.fusion_of.get(i, pass_name) != pass_name:
                    replay.took_in.setdefault(i, set()).add(replay.fusion_of[i])
                replay.fusion_of[i] = pass_name
    live = {i for n in after for i in _origins(n)}
    consumers = before.consumers()
    for node in removed:
        for i in _origins(node) - live:
            parent = _consuming_rewrite(node, consumers, removed, live)
            if parent is not None:
                replay.dead_parent[i] = parent


def _consuming_rewrite(node: ir.Node, consumers: dict[ir.Node, list[ir.Node]], removed: set[ir.Node],
                       live: set[int]) -> int | None:
    """An original of the first rewrite that read ``node``'s outputs, through other dead nodes if need be."""
    queue, seen = list(consumers.get(node, [])), {node}
    while queue:
        c = queue.pop(0)
        if c in seen or c not in removed:
            continue
        seen.add(c)
        hit = _origins(c) & live
        if hit:
            return min(hit)
        queue.extend(consumers.get(c, []))
    return None


def _stamp_by_structure(before: _Snapshot, graph: ir.Graph, removed: set[ir.Node], new: list[ir.Node]) -> None:
    """For rewrites written directly on onnx-ir (qkv_merge), which copy no metadata: a new node whose
    output a surviving node now reads where it read a removed node's stands for that removed node and the
    removed nodes behind it; new nodes feeding it (MatMul → Split) share its origins."""
    new_set = set(new)
    took_over: dict[ir.Node, list[ir.Node]] = {}
    for node in new:
        for out in node.outputs:
            for use in out.uses():
                old_inputs = before.inputs.get(use.node)
                old = old_inputs[use.idx] if old_inputs is not None and use.idx < len(old_inputs) else None
                if old is not None and old is not out and before.producer.get(old) in removed:
                    took_over.setdefault(node, []).append(before.producer[old])
    for old, out in zip(before.outputs, graph.outputs):
        if old is not out and out.producer() in new_set and before.producer.get(old) in removed:
            took_over.setdefault(out.producer(), []).append(before.producer[old])
    for root, starts in took_over.items():
        origins: set[int] = set()
        stack, seen = list(starts), set()
        while stack:
            n = stack.pop()
            if n in seen or n not in removed:
                continue
            seen.add(n)
            origins |= _origins(n)
            stack.extend(before.producer.get(v) for v in before.inputs[n] if v is not None and v in before.producer)
        stack = [root]
        while stack:
            n = stack.pop()
            if n in new_set and not _origins(n) >= origins:
                _stamp(n, origins)
                stack.extend(v.producer() for v in n.inputs if v is not None and v.producer() is not None)


def _common_scope(scopes: list[str]) -> str:
    parts = [s.split(".") for s in scopes if s]
    if not parts:
        return ""
    common = parts[0]
    for p in parts[1:]:
        n = 0
        while n < min(len(common), len(p)) and common[n] == p[n]:
            n += 1
        common = common[:n]
    return ".".join(common)


def _summary(ops: list[str]) -> str:
    counts = Counter(ops)
    return ", ".join(op if counts[op] == 1 else f"{op}×{counts[op]}" for op in dict.fromkeys(ops))


# ---------------------------------------------------------------------------------------- numerics


class _Runner:
    """A's session and outputs on the fixed inputs, to compare any number of B graphs against (their
    interfaces checked by :func:`check_interfaces`)."""

    def __init__(self, a_path: Path, options: DiffOptions):
        session = _session(a_path)
        self.feeds = _feeds(a_path, session, options)
        self.names = [o.name for o in session.get_outputs()]
        self.outputs = session.run(None, self.feeds)

    def compare(self, b_path: Path) -> list[OutputDrift]:
        session = _session(b_path)
        got = dict(zip([o.name for o in session.get_outputs()], session.run(None, self.feeds)))
        return [_drift(name, ref, got[name]) for name, ref in zip(self.names, self.outputs)]


def _session(path: Path):  # noqa: ANN202 - onnxruntime.InferenceSession
    import onnxruntime as ort

    try:
        return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001 - ORT's load errors are about the user's file
        raise OmforgeError(f"{path}: ONNX Runtime cannot load it ({_one_line(e)})") from None


def _feeds(path: Path, session, options: DiffOptions) -> dict[str, np.ndarray]:  # noqa: ANN001
    vocab = session.get_outputs()[0].shape[-1]
    if not isinstance(vocab, int):
        raise OmforgeError(f"{path}: the vocabulary size (last dimension of {session.get_outputs()[0].name}) is not static")
    rng = np.random.default_rng(options.seed)
    ids = rng.integers(0, vocab, size=(options.batch, options.seq), dtype=np.int64)
    positions = np.ascontiguousarray(np.broadcast_to(np.arange(options.seq, dtype=np.int64), ids.shape))
    return {"input_ids": ids, "position_ids": positions}


def _drift(name: str, ref: np.ndarray, got: np.ndarray) -> OutputDrift:
    if ref.shape != got.shape:
        raise OmforgeError(f"output {name}: A gives shape {list(ref.shape)}, B gives {list(got.shape)}")
    r, g = ref.astype(np.float64), got.astype(np.float64)
    max_abs = float(np.max(np.abs(r - g))) if r.size else 0.0
    scale = float(np.max(np.abs(r))) if r.size else 0.0
    max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else float("inf"))
    if r.ndim >= 2 and r.shape[-1] > 1:
        agree = int(np.sum(r.argmax(-1) == g.argmax(-1)))
        rows = int(np.prod(r.shape[:-1]))
    else:
        agree = rows = 0
    return OutputDrift(name, list(ref.shape), max_abs, max_rel, agree, rows)


# ---------------------------------------------------------------------------------------- rendering


def render_text(result: DiffResult) -> str:
    """Plain aligned tables for the terminal (the verdict line is the caller's, so it can come last)."""
    s, p, o = result.structure, result.provenance, result.options
    lines = [f"A: {result.a}", f"B: {result.b}", ""]
    totals = "total nodes (≈ kernel launches)"
    per_layer = f"nodes per decoder layer (median of {len(s.layers)})"
    width = max([len(r.op) for r in s.ops] + [len(totals)] + ([len(per_layer)] if s.layers else []))
    lines.append(f"{'op type':<{width}}  {'A':>6}  {'B':>6}  {'delta':>6}")
    for r in s.ops:
        lines.append(f"{r.op:<{width}}  {r.a:>6}  {r.b:>6}  {r.delta:>+6}")
    lines.append(f"{totals:<{width}}  {s.total_a:>6}  {s.total_b:>6}  {s.total_b - s.total_a:>+6}")
    median = s.layer_median()
    if median:
        ma, mb = median
        lines.append(f"{per_layer:<{width}}  {ma:>6g}  {mb:>6g}  {mb - ma:>+6g}")
    lines.append("")
    if p.available:
        lines.append(f"{'fusion':<15} {'matches':>7} {'regions in B':>12}")
        for f in p.fusions:
            absorbed = "; ".join(f"{n} absorbed by {by}" for by, n in f.absorbed_by.items())
            lines.append(f"{f.name:<15} {f.matches:>7} {len(f.regions):>12}" + (f"  ({absorbed})" if absorbed else ""))
        lines.append(f"{p.unattributed} nodes of A removed outside any region (dead code, merged duplicates)")
        lines.append("")
        lines.append(f"fused regions, B runs ← for these nodes of A (up to {EXAMPLES} per fusion; all in --json / --html)")
        for f in p.fusions:
            for region in f.examples:
                lines.append(f"  {f.name:<15} {region.scope or '(no scope)'}")
                lines.append(f"  {'':<15}   {region.fused_summary()} ← {region.replaced_summary()}")
    else:
        lines.append(f"fused regions: {p.note}")
    lines.append("")
    lines.append(f"numeric parity (ONNX Runtime CPU, batch {o.batch}, seq {o.seq}, seed {o.seed}; "
                 "rel = max abs / max |A|)")
    lines.append(f"{'output':<12} {'shape':<18} {'max abs':>10} {'max rel':>10}  top-1 agree")
    for d in result.parity:
        agree = f"{d.top1_agree}/{d.rows}" if d.rows else "-"
        lines.append(f"{d.name:<12} {str(d.shape):<18} {d.max_abs:>10.3g} {d.max_rel:>10.3g}  {agree}")
    if result.per_fusion:
        lines.append("")
        lines.append(f"per-fusion drift on logits (tol {o.tol:g})")
        lines.append(f"{'fusion':<15} {'matches':>7} {'nodes':>6} {'max abs':>10} {'max rel':>10}  result")
        for f in result.per_fusion:
            extra = [e for e in f.enabled if e != f.fusion] if f.fusion != "all" else []
            lines.append(f"{f.fusion:<15} {f.matches:>7} {f.nodes:>6} {f.max_abs:>10.3g} {f.max_rel:>10.3g}  "
                         f"{'ok' if f.passed else 'EXCEEDS TOL'}" + (f"  (with {', '.join(extra)})" if extra else ""))
    return "\n".join(lines)


def render_html(result: DiffResult) -> str:
    """A self-contained page (inline CSS, no scripts) from ``templates/diff.html.j2``."""
    import jinja2

    env = jinja2.Environment(loader=jinja2.PackageLoader("omforge.passes", "templates"), autoescape=True,
                             trim_blocks=True, lstrip_blocks=True)
    env.filters["g"] = lambda x: f"{x:.3g}"
    return env.get_template("diff.html.j2").render(r=result, s=result.structure, p=result.provenance,
                                                   o=result.options, median=result.structure.layer_median())
