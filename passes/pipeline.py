"""From an export to the graphs a target runs: fusions → (paged-KV insertion) → lowering, saved with its weights."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Mapping

import onnx_ir as ir

from omforge.passes import lower_ort, manager
from omforge.contract import PagedLayout
from omforge.passes.paged_kv import insert_paged_kv
from omforge.runtime import kernels


@dataclass
class PassReport:
    fusion_counts: dict[str, int]
    num_nodes: int
    op_histogram: dict[str, int]
    layout: PagedLayout | None = None
    extra: dict[str, object] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["layout"] = asdict(self.layout) if self.layout else None
        return d


def interface(model: ir.Model) -> dict[str, list[dict[str, object]]]:
    """The graph's inputs and outputs (name, dtype, shape with symbolic dims as names): the ABI as data."""
    def describe(v: ir.Value) -> dict[str, object]:
        dims = [d if isinstance(d, int) else str(d) for d in v.shape] if v.shape is not None else None
        return {"name": v.name, "dtype": v.dtype.name.lower() if v.dtype is not None else None, "shape": dims}

    return {"inputs": [describe(v) for v in model.graph.inputs], "outputs": [describe(v) for v in model.graph.outputs]}


def histogram(model: ir.Model) -> dict[str, int]:
    return dict(Counter(f"{n.domain + '::' if n.domain not in ('', 'ai.onnx') else ''}{n.op_type}"
                        for n in model.graph).most_common())


def build(export_dir: Path, out_path: Path, *, fusions: Mapping[str, bool] | None = None,
          block_size: int | None = None, target: str = "ort", kv_write: str = "graph",
          kernel: bool | None = None, kv_cache_dtype: str = "float32") -> PassReport:
    """Fuse (switches ``fusions``), page the KV cache when ``block_size`` is given, lower to ``target``,
    and save ``out_path`` with its weights in ``out_path.name + '.data'`` beside it. ``kernel``: lower paged
    attention to omforge's CPU kernel (None: when the kernel library is usable here and ``kv_write="graph"``);
    ``kv_cache_dtype``: the pools' element type (not float32: needs the kernel)."""
    if target != "ort":
        raise ValueError(f"target '{target}' is not lowered here yet")
    model = ir.load(export_dir / "model.onnx")
    counts = manager.run_fusions(model, fusions)
    layout = insert_paged_kv(model, block_size) if block_size else None
    if kernel is None:
        kernel = kv_write == "graph" and kernels.status().available
    lower_ort.lower(model, kv_write=kv_write, kernel=kernel, kv_cache_dtype=kv_cache_dtype)
    if layout is not None:
        layout = replace(layout, kv_dtype=kv_cache_dtype)
    manager.cleanup(model)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    ir.save(model, out_path, external_data=out_path.name + ".data")
    report = PassReport(counts, len(list(model.graph)), histogram(model), layout,
                        {"abi": interface(model), "kv_write": kv_write if layout else None,
                         "paged_attention": ("kernel" if kernel else "plain") if layout else None})
    out_path.with_suffix(".json").write_text(json.dumps(report.to_dict(), indent=2))
    return report
