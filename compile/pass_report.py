"""The passes stage's report: what a target's passes made and did, typed, as the manifest writer
(``compile/compiler.py``) reads it. The ort build (``compile/ort.py``) and the ascend stage (``compile/ascend/
stages.py``) return one; the stage cache keeps it in the stage's ``stage.json`` (:meth:`PassReport.to_dict` /
:meth:`PassReport.from_dict`, an exact round trip).

Invariants: ``layout`` is None exactly in a graph without a KV pool (a pooling graph, or an unpaged one);
``pooled_width`` is set exactly in a pooling graph; ``ascend`` is set exactly in an ascend stage's report.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from omforge.contract import PagedLayout
from omforge.contract.manifest import LoraSection, PassCounts, StepAbi, Weights


@dataclass(frozen=True)
class AscendPassInfo:
    """What the ascend stage adds: the lowering record (passes/ascend/lower.py ``AscendLowering.to_dict()``: the
    custom ops the plugin sources are rendered for, the RefData inputs), the paged-attention mode and why (None: a
    pooling graph), what onnxsim did, and how many Constants were rewritten to the ``value`` form ATC reads."""

    lowering: dict[str, Any]
    paged_attention: str | None
    paged_attention_note: str | None
    onnxsim: str
    constants_as_value: int


@dataclass(frozen=True)
class PassReport:
    """A passes stage's step graph (``graph``: its file in the stage folder) and what made it: rewrites per fusion,
    the final node count and op histogram (the manifest's ``passes``), the step ABI, the KV layout, the weights'
    section, ort's paged-attention lowering (``kernel`` | ``plain``; None without paged attention and on ascend,
    whose mode is in ``ascend``) and KV write, a pooling graph's output width, the LoRA section."""

    graph: str
    fusion_counts: dict[str, int]
    num_nodes: int
    op_histogram: dict[str, int]
    abi: StepAbi
    layout: PagedLayout | None
    weights: Weights
    paged_attention: str | None = None
    kv_write: str | None = None
    pooled_width: int | None = None
    lora: LoraSection | None = None
    ascend: AscendPassInfo | None = None

    @property
    def counts(self) -> PassCounts:
        """The manifest's ``passes`` section."""
        return PassCounts(self.fusion_counts, self.num_nodes, self.op_histogram)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (stage.json): sections in their manifest form, the layout and ascend record as objects."""
        return {"graph": self.graph, "fusion_counts": self.fusion_counts, "num_nodes": self.num_nodes,
                "op_histogram": self.op_histogram, "abi": self.abi.to_dict(),
                "layout": asdict(self.layout) if self.layout is not None else None,
                "weights": self.weights.to_dict(), "paged_attention": self.paged_attention,
                "kv_write": self.kv_write, "pooled_width": self.pooled_width,
                "lora": self.lora.to_dict() if self.lora is not None else None,
                "ascend": asdict(self.ascend) if self.ascend is not None else None}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PassReport:
        """The report from :meth:`to_dict`'s form (KeyError / BundleError: not a report of this omforge)."""
        layout, lora, ascend = data["layout"], data["lora"], data["ascend"]
        return cls(graph=data["graph"], fusion_counts=data["fusion_counts"], num_nodes=data["num_nodes"],
                   op_histogram=data["op_histogram"], abi=StepAbi.from_dict(data["abi"], "abi"),
                   layout=PagedLayout(**layout) if layout is not None else None,
                   weights=Weights.from_dict(data["weights"], "weights"), paged_attention=data["paged_attention"],
                   kv_write=data["kv_write"], pooled_width=data["pooled_width"],
                   lora=LoraSection.from_dict(lora, "lora") if lora is not None else None,
                   ascend=AscendPassInfo(**ascend) if ascend is not None else None)
