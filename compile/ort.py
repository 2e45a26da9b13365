"""The ort target's passes stage: an export → the fused, paged, lowered step graph ``step.onnx`` with its weights
beside it, and a :class:`PassReport` of what the passes did (``step.json`` beside the graph: its counts, layout and
the manifest sections, in the form bundles have always carried). The pass sequence is :class:`Pipeline`'s; here
its lowering and quantization options are decided (the kernel or the plain lowering of paged attention, the weights'
GEMM) from the recipe's values and handed in with the LoRA and pooling options the compile built.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import onnx_ir as ir

from omforge.compile.pass_report import PassReport
from omforge.contract import kernel_library
from omforge.contract.manifest import LoraSection, StepAbi, Weights
from omforge.errors import OmforgeError
from omforge.passes.options import (
    EXPERT_BLOCKS,
    ExpertOptions,
    LoraOptions,
    OrtLoweringOptions,
    PoolingOptions,
    QuantizeOptions,
)
from omforge.passes.pipeline import Pipeline, histogram, interface
from omforge.recipe import ACTIVATION_LEVELS, QuantizationSection

WEIGHT_BITS = {"int8": 8, "int4": 4}
_GEMM_OP = {"int8": "MatMulQ", "int4": "MatMulQ", "bfloat16": "MatMulBF16", "float32": "MatMulF32"}


def gemm_lowering(weights: str, quantization: QuantizationSection | None, kernel: bool, paged: bool = True,
                  float_gemm: str = "auto") -> str | None:
    """Which op the weight MatMuls become, as :class:`QuantizeWeights`' ``gemm``. float32: the kernel library's
    MatMulF32 ("kernel") in a paged step graph whose attention is the kernel's, where the library's AVX-512 path
    runs here; else None (ORT's MatMul: the library's portable path is slower than MLAS, and an unpaged graph —
    ``omforge diff``'s — keeps the exported MatMuls so that its drift is the fusions'); the recipe's
    ``float_gemm`` MatMul always None, MatMulF32 the kernel in a paged graph or a one-line error. bfloat16: the
    kernel library's MatMulBF16 ("kernel") or a one-line error. int8 / int4 (recipe ``quantization.gemm`` and
    ``activations``): bfloat16 activations — omforge's ``MatMulQBF16`` ("kernel_bf16") or a one-line error;
    ``auto`` — omforge's ``MatMulQ`` ("kernel") where int8 activations are asked for (accuracy level 4, the
    default) and the kernel library here has the GEMM, else ORT's MatMulNBits ("nbits"; float32 activations,
    accuracy level 0, are exact and slow); ``MatMulQ`` — the kernel or an error naming why it cannot be;
    ``MatMulNBits`` — always ORT's op."""
    why = kernel_library.status().reason or "paged attention is not lowered to it"
    if weights == "float32":
        if float_gemm == "MatMulF32" and paged and not (kernel and kernel_library.status().f32):
            raise OmforgeError("compile.float_gemm: MatMulF32 needs omforge's kernel library, unavailable here "
                               f"({why}); use auto or MatMul")
        if float_gemm == "MatMul" or not (kernel and paged):
            return None
        return "kernel" if float_gemm == "MatMulF32" or kernel_library.status().f32 == "avx512f" else None
    if weights == "bfloat16":
        if not (kernel and kernel_library.status().bf16):
            raise OmforgeError("compile.weights: bfloat16 needs omforge's kernel library (its MatMulBF16), "
                               f"unavailable here ({why}); use float32")
        return "kernel"
    q = quantization or QuantizationSection()
    choice, act = q.gemm, q.activation_type
    usable = kernel and kernel_library.status().weight_layout is not None
    if act == "bfloat16":
        if not (usable and kernel_library.status().qbf16):
            raise OmforgeError("compile.quantization.activations: bfloat16 needs omforge's kernel library with its "
                               f"MatMulQBF16, unavailable here ({why if not usable else 'the library predates it'})")
        return "kernel_bf16"
    if choice == "MatMulQ" and not usable:
        raise OmforgeError(f"compile.quantization.gemm: MatMulQ needs omforge's kernel library with its GEMM, "
                           f"unavailable here ({why})")
    if choice == "MatMulNBits":
        return "nbits"
    return "kernel" if usable and act == "int8" else "nbits"


def _activation_report(weights: str, quantization: QuantizationSection | None) -> dict[str, Any]:
    """The manifest's ``weights.accuracy_level`` (None: not quantized, or bfloat16 activations: no ORT level) and
    ``activations`` (int8 / bfloat16 / float32; absent for float weights and ORT's own levels 1–3)."""
    q = quantization or QuantizationSection()
    if weights in ("float32", "bfloat16"):
        return {"accuracy_level": None if weights == "float32" else q.accuracy_level}
    act = q.activation_type
    level = ACTIVATION_LEVELS.get(act or "", q.accuracy_level) if act != "bfloat16" else None
    return {"accuracy_level": level, **({"activations": act} if act else {})}


def quantize_options(weights: str, quantization: QuantizationSection | None,
                     blocks: Mapping[str, tuple[str, Any, int]] | None, gemm: str = "nbits") -> QuantizeOptions | None:
    """:class:`QuantizeWeights`' options for the recipe's ``weights`` and ``quantization``; None for float."""
    if weights == "float32":  # through MatMulF32 (its panels) when the kernel runs it, else ORT's MatMul as exported
        return QuantizeOptions(bits=32, embedding="float", gemm="kernel") if gemm == "kernel" else None
    if weights == "bfloat16":  # every weight MatMul in bfloat16 through MatMulBF16; the embedding stays float32
        return QuantizeOptions(bits=16, embedding="float", gemm="kernel")
    if weights not in WEIGHT_BITS:
        raise ValueError(f"weights {weights!r}: the ort pipeline builds float32, int8 or int4 weights")
    q = quantization or QuantizationSection()
    return QuantizeOptions(bits=WEIGHT_BITS[weights], group_size=q.group_size, symmetric=q.symmetric,
                           matrices=tuple(q.matrices), embedding=q.embedding,
                           accuracy_level=ACTIVATION_LEVELS.get(q.activations or "", q.accuracy_level),
                           blocks=blocks if q.source_blocks else None, gemm=gemm)


def expert_options(weights: str, quantization: QuantizationSection | None,
                   blocks: Mapping[str, tuple[str, Any, int]] | None, moe: bool) -> ExpertOptions:
    """A mixture of experts' expert precision (the MoE kernel lowering's :class:`ExpertOptions`) from the recipe's
    ``weights`` and ``quantization``: the dense matrices' precision, int8 / int4 with its block and symmetry and the
    export's GGUF ``blocks`` (when ``source_blocks``); float32 experts where ``quantization.matrices`` leaves ``mlp``
    out. The expert kernel's int8 / int4 path (MoEQ) runs int8 activations and blocks of 32, 64 or 128: another
    choice is a one-line error naming the key. A dense model (``moe`` False) gets the defaults, never read."""
    if not moe or weights in ("float32", "bfloat16"):
        return ExpertOptions(weights if moe else "float32")
    q = quantization or QuantizationSection()
    if "mlp" not in q.matrices:
        return ExpertOptions()
    if q.activation_type != "int8":
        raise OmforgeError(f"compile.quantization.activations: {weights} experts run with int8 activations (the "
                           f"expert kernel MoEQ); {q.activation_type} activations are not built for a mixture of "
                           "experts — use activations: int8, or leave mlp out of quantization.matrices")
    if q.group_size not in EXPERT_BLOCKS:
        raise OmforgeError(f"compile.quantization.group_size: the expert kernel takes blocks of "
                           f"{', '.join(map(str, EXPERT_BLOCKS))} along K, got {q.group_size}")
    return ExpertOptions(weights, q.group_size, q.symmetric, blocks if q.source_blocks else None)


def lora_kernel() -> bool:
    """Whether the kernel library here has ``LoraAdd`` (its info reports a ``lora`` path); else the ort lowering
    writes the LoRA terms as plain ops."""
    return kernel_library.status().lora is not None


def build(export_dir: Path, out_path: Path, *, fusions: Mapping[str, bool] | None = None,
          block_size: int | None = None, target: str = "ort", kv_write: str = "graph",
          kernel: bool | None = None, kv_cache_dtype: str = "float32", weights: str = "float32",
          quantization: QuantizationSection | None = None,
          blocks: Mapping[str, tuple[str, Any, int]] | None = None, float_gemm: str = "auto",
          pooling: PoolingOptions | None = None, lora: LoraOptions | None = None) -> PassReport:
    """Fuse (switches ``fusions``), page the KV cache when ``block_size`` is given, lower to ``target``,
    and save ``out_path`` with its weights in ``out_path.name + '.data'`` beside it. ``kernel``: lower paged
    attention to omforge's CPU kernel (None: when the kernel library is usable here and ``kv_write="graph"``);
    ``kv_cache_dtype``: the pools' element type (not float32: needs the kernel). ``weights`` float32: the weight
    MatMuls of a paged graph through the kernel library's MatMulF32 where its AVX-512 path runs (``float_gemm``, the
    recipe's choice: :func:`gemm_lowering`); bfloat16: every weight
    MatMul in bfloat16 through the kernel library's MatMulBF16 (the embedding gather stays float32); int8 / int4:
    weight-only quantization with the recipe's ``quantization`` (None: its defaults), taking
    the export's GGUF ``blocks`` as they are where they fit (``passes/quantize_weights.py``). ``pooling``: a pooling
    bundle's step graph instead of a paged one (its weight MatMuls take the kernels a paged graph's would).
    ``lora``: LoRA pool inputs and terms (passes/lora.py; the term through the kernel library's LoraAdd where it has
    one, :func:`lora_kernel`); the report's ``lora`` is the manifest section. A mixture of experts' experts take the
    weights' precision (:func:`expert_options`)."""
    if target != "ort":
        raise ValueError(f"target '{target}' is built by compile/ascend/stages.py, not here")
    model = ir.load(export_dir / "model.onnx")
    if kernel is None:
        kernel = kv_write == "graph" and kernel_library.status().available
    gemm = gemm_lowering(weights, quantization, kernel, paged=block_size is not None or pooling is not None,
                         float_gemm=float_gemm)
    moe = any(".mlp.experts." in name for name in model.graph.initializers)  # the export's per-expert weights
    lowering = OrtLoweringOptions(kv_write=kv_write, kernel=kernel, kv_cache_dtype=kv_cache_dtype,
                                  lora_kernel=kernel and lora_kernel() if lora is not None else None,
                                  experts=expert_options(weights, quantization, blocks, moe))
    run = Pipeline(target, fusions or {}, block_size, lowering,
                   quantize_options(weights, quantization, blocks, gemm or "nbits"), pooling=pooling,
                   lora=lora).run(model)
    counts, layout = run.fusion_counts, run.layout
    if layout is not None:
        layout = replace(layout, kv_dtype=kv_cache_dtype)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    ir.save(model, out_path, external_data=out_path.name + ".data")
    abi, lora_section = interface(model), run.lora
    weights_entry = {"precision": weights, "quantized": run.quantized, **_activation_report(weights, quantization),
                     **({"gemm": _GEMM_OP[weights] if gemm == "kernel" else
                         "MatMulQBF16" if gemm == "kernel_bf16" else "MatMulNBits"} if gemm else {})}
    report = PassReport(out_path.name, counts, len(list(model.graph)), histogram(model), StepAbi.from_dict(abi, "abi"),
                        layout, Weights.from_dict(weights_entry, "weights"),
                        paged_attention=("kernel" if kernel else "plain") if layout else None,
                        kv_write=kv_write if layout else None, pooled_width=run.pooled_width, lora=lora_section)
    out_path.with_suffix(".json").write_text(json.dumps(_step_json(report, abi, lora_section, weights_entry), indent=2))
    return report


def _step_json(report: PassReport, abi: dict[str, Any], lora: LoraSection | None,
               weights: dict[str, Any]) -> dict[str, Any]:
    """``step.json``, the report beside the step graph (``omforge diff`` reads its ``fusion_counts``), in the form
    bundles have always carried: the counts and layout, the rest under ``extra``."""
    return {"fusion_counts": report.fusion_counts, "num_nodes": report.num_nodes, "op_histogram": report.op_histogram,
            "layout": asdict(report.layout) if report.layout else None,
            "extra": {"abi": abi, "kv_write": report.kv_write, "pooled_width": report.pooled_width,
                      "lora": lora.to_dict() if lora is not None else None, "paged_attention": report.paged_attention,
                      "weights": weights}}
