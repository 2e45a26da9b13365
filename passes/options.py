"""The passes' options: one frozen object per concern, which :class:`~omforge.passes.pipeline.Pipeline` hands to the
pass that reads it. The compile stage builds them once from the recipe (``compile/options.py``, ``compile/ort.py``,
``compile/ascend/stages.py``); tests and ``omforge diff`` build them directly.

  LoraOptions               compile.lora and the model config             → InsertLora
  PoolingOptions            task embed | score and the score token ids    → InsertPooling
  OrtLoweringOptions        KV write, kernel library, KV dtype, experts   → LowerORT (passes/lower_ort.py)
  ExpertOptions             MoE experts' precision, blocks                → LowerORT's expert kernel (moe_kernel.py)
  AscendLoweringOptions     paged-attention mode, SoC, static pool, plain → LowerAscend (passes/ascend/lower.py)
  QuantizeOptions           weight bits, blocks, GEMM op                  → QuantizeWeights (ort) / QuantizeW8A16

Invariants: every object is immutable and checked when made (a bad value is a ValueError naming the field).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from omforge.contract.lora import TARGET_MODULES
from omforge.contract.manifest import POOLING_TASKS, ModelConfig
from omforge.passes.gemm_pack import BLOCKS as EXPERT_BLOCKS

QUANT_MATRICES = ("attention", "mlp", "lm_head")


@dataclass(frozen=True)
class LoraOptions:
    """``compile.lora`` as the LoRA insertion takes it (docs/lora.md): adapter slots (the pools hold ``max_loras +
    1``), the rank every slot is padded to, the targeted modules (contract/lora.py ``TARGET_MODULES``), and the
    export's model ``config``, whose head and MLP widths split fused projections (None: split evenly)."""

    max_loras: int
    max_rank: int
    target_modules: tuple[str, ...] = TARGET_MODULES
    config: ModelConfig | None = None

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"lora.{name}: must be a positive integer (got {value!r})")
        if not isinstance(self.target_modules, tuple):
            raise ValueError(f"lora.target_modules: must be a tuple (got {type(self.target_modules).__name__})")
        unknown = [m for m in self.target_modules if m not in TARGET_MODULES]
        if unknown or not self.target_modules or len(set(self.target_modules)) != len(self.target_modules):
            raise ValueError(f"lora.target_modules: {list(self.target_modules)} is not a non-empty list of distinct "
                             f"modules of {', '.join(TARGET_MODULES)}")


@dataclass(frozen=True)
class PoolingOptions:
    """A pooling step graph (contract/pooling.py): ``task`` embed or score, and for score the ``[no, yes]`` token
    ids whose LM-head columns make the output (present exactly for score)."""

    task: str
    score_token_ids: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.task not in POOLING_TASKS:
            raise ValueError(f"pooling.task: {self.task!r} is not one of {', '.join(POOLING_TASKS)}")
        if (self.task == "score") != (self.score_token_ids is not None):
            raise ValueError("pooling.score_token_ids: given exactly for task score")
        if self.score_token_ids is not None and (not isinstance(self.score_token_ids, tuple)
                                                 or len(self.score_token_ids) != 2):
            raise ValueError(f"pooling.score_token_ids: a (no, yes) pair (got {self.score_token_ids!r})")


EXPERT_PRECISIONS = ("float32", "bfloat16", "int8", "int4")


@dataclass(frozen=True)
class ExpertOptions:
    """The experts of ``omforge.MoE`` nodes as the kernel library's expert op (passes/moe_kernel.py): their weight
    ``precision`` (the recipe's ``compile.weights``; int8 / int4 run with int8 activations), int8 / int4 blocks of
    ``group_size`` along K (32, 64, 128), ``symmetric`` or affine, and a GGUF's ``blocks`` by torch name, taken as
    they are where every expert of a matrix has them in one width."""

    precision: str = "float32"
    group_size: int = 32
    symmetric: bool = True
    blocks: Mapping[str, tuple[str, Any, int]] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.precision not in EXPERT_PRECISIONS:
            raise ValueError(f"experts.precision: {self.precision!r} is not one of {', '.join(EXPERT_PRECISIONS)}")
        if self.precision in ("int8", "int4") and self.group_size not in EXPERT_BLOCKS:
            raise ValueError(f"quantization.group_size: the expert kernel takes blocks of "
                             f"{', '.join(map(str, EXPERT_BLOCKS))} along K (got {self.group_size})")


@dataclass(frozen=True)
class OrtLoweringOptions:
    """The ort lowering (:func:`omforge.passes.lower_ort.lower`): who writes the new KV rows (``graph`` or
    ``runtime``), whether paged attention goes to omforge's kernel library, the pools' element type, the LoRA
    terms' op (``lora_kernel`` None: the kernel library's where ``kernel``) and a mixture of experts' ``experts``."""

    kv_write: str = "graph"
    kernel: bool = False
    kv_cache_dtype: str = "float32"
    lora_kernel: bool | None = None
    experts: ExpertOptions = field(default_factory=ExpertOptions)


@dataclass(frozen=True)
class AscendLoweringOptions:
    """The ascend lowering (:func:`omforge.passes.ascend.lower.lower`, which checks the choices): paged-attention
    mode, attention and RMSNorm forms, ``plain`` (every op as standard ONNX: the tests' twin), the pool's static
    slot count (None: symbolic) and the SoC whose kernels decide the fused ops. ``rmsnorm_plugin`` and
    ``soc_version`` None: the lowering's defaults."""

    paged_attention: str = "gather"
    attention: str = "plain"
    rmsnorm_plugin: str | None = None
    plain: bool = False
    num_slots: int | None = None
    soc_version: str | None = None


LoweringOptions = OrtLoweringOptions | AscendLoweringOptions


@dataclass(frozen=True)
class QuantizeOptions:
    """Weight quantization after the lowering (passes/quantize_weights.py; ascend: passes/ascend/w8a16.py, which
    reads ``group_size`` and ``matrices``): ``bits`` 4 / 8 (16 / 32: the kernel library's bfloat16 / float32 GEMM
    of float weights), block ``group_size`` (0: per channel), symmetric codes, the matrix groups, the embedding
    quantized or float, ORT's ``accuracy_level``, the export's GGUF ``blocks`` taken as they are, and the ``gemm``
    op (``nbits``, ``kernel``, ``kernel_bf16``)."""

    bits: int
    group_size: int = 32
    symmetric: bool = True
    matrices: tuple[str, ...] = QUANT_MATRICES
    embedding: str = "quantized"
    accuracy_level: int = 0
    gemm: str = "nbits"
    blocks: Mapping[str, tuple[str, Any, int]] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.matrices, tuple) or not set(self.matrices) <= set(QUANT_MATRICES):
            raise ValueError(f"quantize.matrices: a tuple of {', '.join(QUANT_MATRICES)} (got {self.matrices!r})")
