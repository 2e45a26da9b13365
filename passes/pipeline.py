"""From an export to the graphs a target runs: each target's pass sequence as data, run by onnx-ir's pass manager.

  ort:    fusions (recipe switches) → cleanup → [LoRA insertion] → paged-KV insertion (with a block size) → ORT lowering
          → weight quantization (int8 / int4 weights: MatMulNBits) → cleanup
  ascend: fusions (recipe switches) → cleanup → [LoRA insertion] → paged-KV insertion → Ascend lowering → cleanup
  a pooling bundle (task embed | score) takes the pooling insertion in place of the paged-KV one
  [LoRA insertion]: with ``lora`` (``compile.lora``, passes/lora.py): ``omforge.LoraAdd`` on each targeted projection

:class:`Pipeline` is the one description that the ort build (``compile/ort.py``), the ascend stage
(``compile/ascend/stages.py``) and ``omforge diff``'s replay run; they decide its options (which lowering, which
weights) and hand them in, one frozen object per concern (passes/options.py). Every pass is an ``onnx_ir``
in-place pass; its ``requires`` / ``ensures`` hooks state the contract between them (the paged-KV insertion needs
fused or fusible attention and leaves the step ABI's inputs; a lowering leaves no neutral op).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import onnx_ir as ir

from omforge.contract import STEP_INPUTS, PagedLayout
from omforge.contract.manifest import LoraSection
from omforge.contract.pooling import POOLING_INPUTS
from omforge.passes import lower_ort, manager, ops
from omforge.passes.ascend import lower as lower_ascend
from omforge.passes.ascend.w8a16 import QuantizeW8A16
from omforge.passes.float16 import CastToFloat16
from omforge.passes.lora import InsertLora, LoraTargetMissing
from omforge.passes.options import (
    AscendLoweringOptions,
    LoraOptions,
    LoweringOptions,
    OrtLoweringOptions,
    PoolingOptions,
    QuantizeOptions,
)
from omforge.passes.paged_kv import insert_paged_kv
from omforge.passes.pooling import insert_pooling
from omforge.passes.quantize_weights import QuantizeWeights

TARGETS = ("ort", "ascend")


class InsertPagedKV(ir.passes.InPlacePass):
    """The step graph: KV pools, slot mapping and block tables in, ``PagedAttention`` in place of attention."""

    def __init__(self, block_size: int):
        super().__init__()
        self.block_size, self.layout = block_size, None

    def requires(self, model: ir.Model) -> None:
        names = {v.name for v in model.graph.inputs}
        if not {"input_ids", "position_ids"} <= names:
            raise ir.passes.PreconditionError("paged-KV insertion needs an export's input_ids and position_ids")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.layout = insert_paged_kv(model, self.block_size)
        return ir.passes.PassResult(model, modified=True)

    def ensures(self, model: ir.Model) -> None:
        missing = set(STEP_INPUTS) - {v.name for v in model.graph.inputs}
        if missing:
            raise ir.passes.PostconditionError(f"the step graph lacks the step ABI inputs {sorted(missing)}")


class InsertPooling(ir.passes.InPlacePass):
    """A pooling bundle's step graph (task embed | score, :mod:`omforge.passes.pooling`): no KV pool, the last
    position of each sequence pooled; ``width``: the pooled output's."""

    def __init__(self, options: PoolingOptions):
        super().__init__()
        self.options, self.width = options, None

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.width = insert_pooling(model, self.options.task, self.options.score_token_ids)
        return ir.passes.PassResult(model, modified=True)

    def ensures(self, model: ir.Model) -> None:
        missing = set(POOLING_INPUTS) - {v.name for v in model.graph.inputs}
        if missing or any(n.op_type == "PagedAttention" for n in model.graph):
            raise ir.passes.PostconditionError(f"not a pooling step graph (missing inputs {sorted(missing)})")


class LowerORT(ir.passes.InPlacePass):
    """:func:`lower_ort.lower` with its :class:`OrtLoweringOptions`."""

    def __init__(self, options: OrtLoweringOptions):
        super().__init__()
        self.options, self.count = options, 0
        self.experts: dict[str, dict[str, object]] = {}  # per MoE node: its experts' op, bits, source

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        o = self.options
        self.count = lower_ort.lower(model, kv_write=o.kv_write, kernel=o.kernel, kv_cache_dtype=o.kv_cache_dtype,
                                     lora_kernel=o.lora_kernel, experts=o.experts, experts_report=self.experts)
        return ir.passes.PassResult(model, modified=self.count > 0)

    def ensures(self, model: ir.Model) -> None:
        ops.check_lowered(model, "ORT lowering")


class LowerAscend(ir.passes.InPlacePass):
    """:func:`lower_ascend.lower` with its :class:`AscendLoweringOptions`; ``result``: the
    :class:`lower_ascend.AscendLowering` record."""

    def __init__(self, options: AscendLoweringOptions):
        super().__init__()
        self.options, self.result = options, None

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        o = self.options
        defaults = {k: v for k, v in (("rmsnorm_plugin", o.rmsnorm_plugin), ("soc_version", o.soc_version))
                    if v is not None}  # None: the lowering's own
        self.result = lower_ascend.lower(model, paged_attention=o.paged_attention, attention=o.attention,
                                         plain=o.plain, num_slots=o.num_slots, **defaults)
        return ir.passes.PassResult(model, modified=True)

    def ensures(self, model: ir.Model) -> None:
        ops.check_lowered(model, "ascend lowering")
        if set(model.opset_imports) != {""}:
            raise ir.passes.PostconditionError(f"ATC takes one opset import, got {sorted(model.opset_imports)}")


LOWERINGS: dict[str, type[ir.passes.InPlacePass]] = {"ort": LowerORT, "ascend": LowerAscend}
LOWERING_OPTIONS: dict[str, type[LoweringOptions]] = {"ort": OrtLoweringOptions, "ascend": AscendLoweringOptions}


@dataclass(frozen=True)
class Pipeline:
    """A target's pass sequence: ``fusions`` (recipe switches, default all on), the paged-KV insertion when
    ``block_size`` is given, the ``target``'s lowering with ``lowering`` options (None: that target's defaults),
    cleanups between. Every option is a frozen object of passes/options.py (a dict is refused)."""

    target: str = "ort"
    fusions: Mapping[str, bool] = field(default_factory=dict)
    block_size: int | None = None
    lowering: LoweringOptions | None = None
    # weight quantization: QuantizeWeights (ort) or QuantizeW8A16 (ascend, on the float16 graph); None: float weights
    quantize: QuantizeOptions | None = None
    float16: bool = False  # ascend: the lowered graph in float16 with float32 islands (passes/float16.py)
    # a pooling bundle (task embed | score): InsertPooling in place of the paged-KV insertion
    pooling: PoolingOptions | None = None
    # multi-LoRA (docs/lora.md): InsertLora after the fusions and before the paged-KV insertion; None: no LoRA
    # input, no LoRA node
    lora: LoraOptions | None = None

    def __post_init__(self) -> None:
        if self.target not in TARGETS:
            raise ValueError(f"target {self.target!r} is not one of {TARGETS}")
        if self.lowering is None:
            object.__setattr__(self, "lowering", LOWERING_OPTIONS[self.target]())
        for name, kind in (("lowering", LOWERING_OPTIONS[self.target]), ("quantize", QuantizeOptions),
                           ("pooling", PoolingOptions), ("lora", LoraOptions)):
            value = getattr(self, name)
            if value is not None and not isinstance(value, kind):
                raise TypeError(f"Pipeline {name}: expected {kind.__name__} (passes/options.py) for target "
                                f"{self.target}, got {type(value).__name__}")
        if self.float16 and self.target != "ascend":
            raise ValueError(f"a float16 graph is built for the ascend target, not {self.target}")
        if self.quantize is not None and self.target == "ascend" and not self.float16:
            raise ValueError("W8A16 on ascend quantizes the float16 graph: set float16")
        if self.lora is not None and self.pooling is not None:
            raise ValueError("LoRA is for generate step graphs, not pooling ones")

    def passes(self) -> list[ir.passes.PassBase]:
        """Fresh pass objects, in order (each records what it did: ``Fusion.count``, ``InsertPagedKV.layout``…)."""
        seq: list[ir.passes.PassBase] = [*manager.fusion_passes(self.fusions), manager.Cleanup()]
        if self.lora is not None:
            seq.append(InsertLora(self.lora))
        if self.pooling is not None:
            seq.append(InsertPooling(self.pooling))
        elif self.block_size:
            seq.append(InsertPagedKV(self.block_size))
        seq.append(LOWERINGS[self.target](self.lowering))
        if self.float16:
            seq.append(CastToFloat16())
        q = self.quantize
        if q is not None and self.target == "ort":
            seq.append(QuantizeWeights(q.bits, q.group_size, q.symmetric, q.matrices, q.embedding, q.accuracy_level,
                                       q.blocks, q.gemm))
        elif q is not None:
            assert isinstance(self.lowering, AscendLoweringOptions)
            seq.append(QuantizeW8A16(q.group_size, q.matrices, plain=self.lowering.plain))
        seq.append(manager.Cleanup())
        return seq

    def run(self, model: ir.Model) -> PipelineRun:
        passes = self.passes()
        try:
            ir.passes.PassManager(passes)(model)
        except ir.passes.PassError as error:  # the pass manager wraps what a pass raises: a user's error unwrapped
            cause: BaseException | None = error
            while cause is not None and not isinstance(cause, LoraTargetMissing):
                cause = cause.__cause__
            if cause is None:
                raise
            raise cause from None
        return PipelineRun(passes)


@dataclass
class PipelineRun:
    """What a pipeline's passes recorded."""

    passes: list[ir.passes.PassBase]

    @property
    def fusion_counts(self) -> dict[str, int]:
        counts = {p.name: p.count for p in self.passes if isinstance(p, manager.Fusion)}
        return {name: counts.get(name, 0) for name in manager.FUSIONS}

    @property
    def layout(self) -> PagedLayout | None:
        layout = next((p.layout for p in self.passes if isinstance(p, InsertPagedKV)), None)
        if layout is not None and any(isinstance(p, CastToFloat16) for p in self.passes):
            layout = replace(layout, kv_dtype="float16")
        return layout

    @property
    def pooled_width(self) -> int | None:
        """A pooling step graph's output width (hidden size, or 2 for score); None for a paged step graph."""
        return next((p.width for p in self.passes if isinstance(p, InsertPooling)), None)

    @property
    def lora(self) -> LoraSection | None:
        """The manifest's ``lora`` section (the projections that carry a LoRA term); None without LoRA."""
        return next((p.section for p in self.passes if isinstance(p, InsertLora)), None)

    @property
    def lowering(self) -> ir.passes.InPlacePass:
        return next(p for p in self.passes if isinstance(p, tuple(LOWERINGS.values())))

    @property
    def quantized(self) -> dict[str, dict[str, object]]:
        """Per quantized weight: bits, block, where it came from (GGUF blocks or round to nearest), bytes; a mixture
        of experts' experts by their torch name (``…mlp.experts``) with the op they run as."""
        experts = next((p.experts for p in self.passes if isinstance(p, LowerORT)), {})
        return {**next((p.report for p in self.passes if isinstance(p, QuantizeWeights | QuantizeW8A16)), {}),
                **experts}


def interface(model: ir.Model) -> dict[str, list[dict[str, object]]]:
    """The graph's inputs and outputs (name, dtype, shape with symbolic dims as names): the ABI as data."""
    def describe(v: ir.Value) -> dict[str, object]:
        dims = [d if isinstance(d, int) else str(d) for d in v.shape] if v.shape is not None else None
        return {"name": v.name, "dtype": v.dtype.name.lower() if v.dtype is not None else None, "shape": dims}

    return {"inputs": [describe(v) for v in model.graph.inputs], "outputs": [describe(v) for v in model.graph.outputs]}


def histogram(model: ir.Model) -> dict[str, int]:
    return dict(Counter(f"{n.domain + '::' if n.domain not in ('', 'ai.onnx') else ''}{n.op_type}"
                        for n in model.graph).most_common())
