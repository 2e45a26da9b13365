"""``omforge diff``, provenance: every fused region of B and the original nodes of A it replaced.

Recorded by replaying the pipeline's passes (:class:`~omforge.passes.pipeline.Pipeline`, fusions and the ORT
lowering) on A, one pass at a time, with every original node tagged in its metadata: the onnxscript rewriter
merges the metadata of the nodes a rule matched into the nodes it creates, so each fused node carries the tags
of everything it stands for, through rewrites of rewrites (AddRMSNorm takes in an RMSNorm; lowering expands a
neutral op). Around each pass the node sets are diffed for the rest: what a hand-written rewrite (qkv_merge)
replaced, and the dead code a rewrite left (a causal mask, shape arithmetic), charged to the rewrite that read it.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import onnx_ir as ir

from omforge.contract import FUSIONS
from omforge.diff.types import FusedRegion, FusionSummary, NodeRef, Provenance
from omforge.passes import manager
from omforge.passes.pipeline import Pipeline

LOWERING = "ort_lowering"


def op_key(node: ir.Node) -> str:
    """``Op`` for the default domain, ``domain::Op`` otherwise (as :func:`pipeline.histogram`)."""
    return f"{node.domain}::{node.op_type}" if node.domain not in ("", "ai.onnx") else node.op_type


def scope_of(node: ir.Node) -> str:
    return node.metadata_props.get("omforge.scope", "")



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
    def of(cls, graph: ir.Graph) -> _Snapshot:
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
    """Fuse and lower ``model`` in place as the ort build (``compile/ort.py``) does (without paging), one pass at a
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
