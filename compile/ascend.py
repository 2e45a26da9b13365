"""The ascend target's compile stages: the lowered, simplified step graph, then everything the ATC step needs.

``lower_step_graph`` (cached with the passes): fusions → paged KV → Ascend lowering → onnxsim → ``step.onnx``.
``prepare_and_run`` (in the bundle): one ATC model per bucket profile (prefill, decode) with its exact
command line, the fusion switch file, plugin sources for our own op types, ``build.sh``; then ``atc`` is run
when it is on PATH. Without it, :class:`AtcMissing` names the step left and the command: never a fake .om.
"""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import onnx
import onnx_ir as ir


from omforge.passes import lower_ascend, manager
from omforge.passes.paged_kv import insert_paged_kv
from omforge.passes.pipeline import histogram, interface
from omforge.recipe import Recipe


def lower_step_graph(export_dir: Path, out: Path, recipe: Recipe, block_size: int) -> dict[str, Any]:
    model = ir.load(export_dir / "model.onnx")
    counts = manager.run_fusions(model, recipe.compile.fusions)
    layout = insert_paged_kv(model, block_size)
    lowering = lower_ascend.lower(model)
    manager.cleanup(model)
    ir.save(model, out / "step.onnx", external_data="step.onnx.data")
    simplified = _onnxsim(out / "step.onnx")
    final = ir.load(out / "step.onnx")
    return {"fusion_counts": counts, "num_nodes": len(list(final.graph)), "op_histogram": histogram(final),
            "abi": interface(final), "layout": asdict(layout), "graph": "step.onnx",
            "lowering": lowering.to_dict(), "onnxsim": simplified}


def _onnxsim(path: Path) -> str:
    """Simplify in place with onnxsim (constant folding, dead code); keep the input graph if onnxsim cannot
    handle it (our own op types are unknown to its ORT-based folding) and say why."""
    import onnxsim

    try:
        proto = onnx.load(str(path))
        simplified, ok = onnxsim.simplify(proto, check_n=0, skip_shape_inference=True)
    except Exception as e:  # onnxsim raises anything from ORT / onnx; the unsimplified graph is still valid
        print(f"[compile] onnxsim skipped: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
        return f"skipped: {type(e).__name__}"
    if not ok:
        return "skipped: check failed"
    data = path.with_name(path.name + ".data")
    data.unlink(missing_ok=True)
    onnx.save(simplified, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=data.name)
    return f"simplified: {len(proto.graph.node)} → {len(simplified.graph.node)} nodes"
