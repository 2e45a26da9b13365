"""``omforge diff``'s option and result types, in one module that imports no other of the tool's: the views compute
them (:mod:`~omforge.diff.structure`, :mod:`~omforge.diff.provenance`, :mod:`~omforge.diff.parity`, the bundle diff
:mod:`~omforge.diff.bundles`), :mod:`~omforge.diff.render` presents them."""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import asdict, dataclass, field

EXAMPLES = 3
"""Fused regions per fusion shown in the terminal (all of them in --json / --html)."""


# ---------------------------------------------------------------------------------------- graph diff


@dataclass
class DiffOptions:
    seq: int = 32
    batch: int = 1
    seed: int = 0
    tol: float = 1e-3
    per_fusion: bool = False


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


@dataclass
class OutputDrift:
    name: str
    shape: list[int]
    max_abs: float
    max_rel: float
    top1_agree: int
    rows: int


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


def _summary(ops: list[str]) -> str:
    counts = Counter(ops)
    return ", ".join(op if counts[op] == 1 else f"{op}×{counts[op]}" for op in dict.fromkeys(ops))


# ---------------------------------------------------------------------------------------- bundle diff


@dataclass
class PromptDrift:
    prompt: str
    steps: int
    max_abs: float          # max |logits A − logits B| over the teacher-forced steps
    top1_agreement: float   # fraction of those steps where both bundles' argmax agree
    identical_prefix: int   # free-running greedy: leading tokens identical


@dataclass
class BundleDiff:
    a: str
    b: str
    kv_dtypes: tuple[str, str]
    paged_attention: tuple[str, str]
    max_tokens: int
    prompts: list[PromptDrift]
    weights: tuple[str, str] = ("float32", "float32")  # compile.weights of A and B

    @property
    def max_abs(self) -> float:
        return max(p.max_abs for p in self.prompts)

    @property
    def identical_outputs(self) -> float:
        """Fraction of prompts whose whole greedy output is identical in both bundles."""
        return sum(p.identical_prefix == self.max_tokens for p in self.prompts) / len(self.prompts)

    def to_dict(self) -> dict:
        return {**asdict(self), "max_abs": self.max_abs, "identical_outputs": self.identical_outputs}
