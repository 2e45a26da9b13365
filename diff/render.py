"""``omforge diff``, presentation: aligned tables for the terminal and a self-contained HTML page."""

from __future__ import annotations

from omforge.diff.types import EXAMPLES, DiffResult


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
        lines.append(f"fused regions, B runs ← for these nodes of A (up to {EXAMPLES} per fusion; "
                     "all in --json / --html)")
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

    env = jinja2.Environment(loader=jinja2.PackageLoader("omforge.diff", "templates"), autoescape=True,
                             trim_blocks=True, lstrip_blocks=True)
    env.filters["g"] = lambda x: f"{x:.3g}"
    return env.get_template("diff.html.j2").render(r=result, s=result.structure, p=result.provenance,
                                                   o=result.options, median=result.structure.layer_median())
