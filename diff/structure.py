"""``omforge diff``, structure: op-type histograms of A and B, totals, nodes per decoder layer (from the
exporter's ``omforge.scope`` metadata), and the provenance of B's fused regions (:mod:`~omforge.diff.provenance`)."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping

import onnx_ir as ir

from omforge.diff.provenance import Replay, op_key, scope_of, trace_fusions
from omforge.diff.types import LayerCount, OpCount, Provenance, Structure
from omforge.errors import one_line

_LAYER = re.compile(r"^model\.layers\.(\d+)(?:\.|$)")


def compare_structure(a: ir.Model, b: ir.Model, switches: Mapping[str, bool] | None) -> tuple[Structure, Provenance]:
    """Histograms of ``a`` and ``b``, and the provenance of ``b``'s fused regions (``a`` is consumed: the
    fusions are replayed on it)."""
    hist_a, hist_b = Counter(op_key(n) for n in a.graph), Counter(op_key(n) for n in b.graph)
    layers_a = _layer_counts(a.graph, {})
    new_ops = {op for op in hist_b if op not in hist_a}
    try:
        replay: Replay | None = trace_fusions(a, switches)
    except Exception as e:
        replay, failure = None, f"replaying the fusions on A failed ({type(e).__name__}: {one_line(e)})"
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

