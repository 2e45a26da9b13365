"""Which fused CANN kernels ship for which SoC: the table the Ascend lowering consults per ``compile.soc_version``.

An op is usable on a chip only if its AI Core kernel ships for that chip: ``this->AICore().AddConfig("<soc>")`` in
the op's ``op_host/<op>_def.cpp`` of CANN's open ops repositories (a SoC without an AddConfig has no kernel for the
op), with the prebuilt binaries under ``op_host/config/<soc>/`` and the aclnn doc's "supported products" line
(reference/ascend.md §5.2). ATC fails at op selection when a node's kernel is missing, so the lowering emits a
fused op only where its row lists the SoC's family and falls back to the op's plain decomposition elsewhere.

Rows read at hicann/ops-nn e5c3fa93 (2026-08-22) and hicann/ops-transformer c29bc106 (2025-11-15). The family of a
``--soc_version`` is GE's ``Short_SoC_version`` lower-cased (hicann/ge ffdcbc9f
``tests/engines/nn_engine/config/data/platform_config/Ascend910B1.ini:6`` ``Short_SoC_version=Ascend910B``,
``Ascend310P3.ini:6`` ``=Ascend310P``, ``Ascend310B1.ini:6`` ``=Ascend310B``; read by ``platform_utils.cc:263``).
The closed CANN 8.0 releases may differ from these open sources [unverified]; none of it has run on hardware.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class KernelRow:
    """One GE op we emit: the SoC families whose kernel ships, with the file that shows it."""

    ge_op: str
    families: frozenset[str]
    source: str
    note: str = ""


def _row(ge_op: str, families: str, source: str, note: str = "") -> KernelRow:
    return KernelRow(ge_op, frozenset(families.split()), source, note)


KERNELS: dict[str, KernelRow] = {r.ge_op: r for r in (
    _row("RotaryPositionEmbedding", "ascend910b ascend910_93",
         "hicann/ops-transformer posembedding/rotary_position_embedding/op_host/rotary_position_embedding_def.cpp:"
         "51-52,59 (op_host/config/: ascend910b, ascend910_93 only); docs/aclnnRotaryPositionEmbedding.md:7-8",
         "not on Atlas 300I/310P or 200I/500 A2 (310B)"),
    _row("RmsNorm", "ascend910b ascend910_93 ascend310p",
         "hicann/ops-nn norm/rms_norm/op_host/rms_norm_def.cpp:47-48,77,103-106; docs/aclnnRmsNorm.md:11-23",
         "310P: float16 and float32 only; 310B: not supported"),
    _row("AddRmsNorm", "ascend910b ascend910_93 ascend310p",
         "hicann/ops-nn norm/add_rms_norm/op_host/add_rms_norm_def.cpp:61-62,102-104,147; "
         "docs/aclnnAddRmsNorm.md:11-23", "310P: float16 and float32 only; 310B: not supported"),
    _row("SwiGlu", "ascend910b ascend910_93 ascend310p",
         "hicann/ops-nn activation/swi_glu/op_host/swi_glu_def.cpp:33-34,36-47,56; docs/aclnnSwiGlu.md:11-23,138",
         "310P: float16 and float32 only, the last dim 64-byte aligned; 310B: not supported"),
    _row("WeightQuantBatchMatmulV2", "ascend910b ascend910_93 ascend310p",
         "hicann/ops-nn matmul/weight_quant_batch_matmul_v2/op_host/weight_quant_batch_matmul_v2_def.cpp:211-253,"
         "574-575; docs/aclnnWeightQuantBatchMatmulV2.md:11-23",
         "310P wants FRACTAL_NZ int8 weights, which we do not build (passes/ascend/w8a16.py refuses it)"),
    _row("PromptFlashAttention", "ascend910b ascend910_93 ascend310p",
         "hicann/ops-transformer attention/prompt_flash_attention/op_host/prompt_flash_attention_def.cpp:113-114,"
         "115-191 (310P: float16 only),192", "310P: float16 only, no GQA (reference/ascend.md §2.3)"),
    # the in-place paged attention (compile.paged_attention: inplace)
    _row("ScatterPaKvCache", "ascend910b ascend910_93",
         "libochao-huawei/ops-transformer 5778144 (a 2026-08 mirror; not in hicann/ops-transformer c29bc10) "
         "attention/scatter_pa_kv_cache/op_host/scatter_pa_kv_cache_def.cpp:20-23,202-210,331-332 (and ascend950)",
         "910B/910_93: key/value/caches one dtype of int8/float16/bfloat16, slot_mapping int32 or int64; not 310P "
         "or 310B"),
    _row("FusedInferAttentionScore", "ascend910b ascend910_93",
         "hicann/ops-transformer attention/fused_infer_attention_score/op_host/fused_infer_attention_score_def.cpp:"
         "27-48 (query float16/bfloat16/int8),570-571",
         "no float32: a float32 graph keeps the gather path"),
    _row("IncreFlashAttention", "ascend910b ascend910_93 ascend310p",
         "hicann/ops-transformer attention/incre_flash_attention/op_host/incre_flash_attention_def.cpp:302-303,394",
         "310P: float16, ND, no GQA (reference/ascend.md §2.3, §5.3); not emitted: 310P has no in-place KV write "
         "(see ScatterNdUpdate)"),
    _row("ScatterNdUpdate", "ascend910b ascend910_93",
         "hicann/ops-nn index/scatter_nd_update/op_host/scatter_nd_update_def.cpp:86,144-145",
         "no 310P AI Core config; ScatterElementsV2 has one (scatter_elements_v2_def.cpp:112) but its prototype "
         "says Atlas A2/A3 only (scatter_elements_v2_proto.h:44-45): 310P keeps the gather path"),
    # the MoE chain (passes/ascend/moe.py; issue 62): every kernel at hicann/ops-transformer c29bc106
    _row("MoeGatingTopKSoftmax", "ascend910b ascend910_93",
         "hicann/ops-transformer moe/moe_gating_top_k_softmax/op_host/moe_gating_top_k_softmax_def.cpp:25,51-52",
         "a 310P config is in a 2026-08 mirror only (libochao-huawei/ops-transformer 5778144 "
         "op_host/config/ascend310p)"),
    _row("MoeInitRouting", "ascend910b ascend910_93",
         "hicann/ops-transformer moe/moe_init_routing/op_host/moe_init_routing_def.cpp:25,63-64 (and ascend910_95, 71)",
         "not 310P or 310B (aclnnMoeInitRouting.md: Atlas inference series not supported)"),
    _row("MoeComputeExpertTokens", "ascend910b ascend910_93",
         "hicann/ops-transformer moe/moe_compute_expert_tokens/op_host/moe_compute_expert_tokens_def.cpp:26,45-46"),
    _row("GroupedMatmul", "ascend910b ascend910_93",
         "hicann/ops-transformer gmm/grouped_matmul/op_host/grouped_matmul_def.cpp:24,36,167-168 (310P: 170-222)",
         "float16/bfloat16/float32 x and weight on 910B/910_93; 310P has a kernel for float16 x with FRACTAL_NZ "
         "weights only (def.cpp:171-178), which we do not build: 310P takes the plain MoE"),
    _row("MoeFinalizeRoutingV2", "ascend910b ascend910_93",
         "hicann/ops-transformer moe/moe_finalize_routing_v2/op_host/moe_finalize_routing_v2_def.cpp:26,82-83 "
         "(and ascend910_95, 189)", "a 310P line is in the 2026-08 mirror's doc only"),
    # plain ONNX ops whose CANN kernel is per SoC (issue 60 item 6)
    _row("TensorScatterUpdate", "",
         "hicann/ops-math common/src/framework/similar_opp_onnx_plugin.cpp:70 (ONNX ScatterND -> "
         "TensorScatterUpdate); tensor_scatter_update_proto.h:34,46 (\"EXPERIMENTAL. Please do not use\"); only an "
         "AI CPU kernel in the open sources (reference/ascend.md §5.3)",
         "no AI Core kernel on any SoC: the ascend graphs emit no ONNX ScatterND (the gather path writes the "
         "step's rows into the context by Concat + mask)"),
    _row("GatherV2", "ascend910b ascend910_93 ascend310p ascend310b",
         "ONNX Gather -> GatherV2 (reference/ascend.md §1.6); the 910B/310P kernel is the closed legacy one; the "
         "open one is hicann/ops-nn index/gather_v2 (arch35) [unverified per SoC]",
         "int32 or int64 indices; pools above 2^31 elements refused (lower.PoolTooLarge)"),
    _row("RealDiv", "",
         "hicann/ops-math: ONNX Div -> RealDiv; no int64 RealDiv AI Core kernel is listed [unverified]",
         "the ascend graphs divide no int64 tensor (the gather path's token_index // Q is gone)"),
)}
"""Every GE op the lowering can emit whose kernel is per SoC, keyed by GE op type (an empty family list: the
lowering must not emit it on any SoC)."""

MOE_KERNELS = ("MoeGatingTopKSoftmax", "MoeInitRouting", "MoeComputeExpertTokens", "GroupedMatmul", "SwiGlu",
               "MoeFinalizeRoutingV2")
"""What the fused MoE lowering emits (passes/ascend/moe.py): all of them, or the plain MoE."""
INPLACE_KERNELS = ("ScatterPaKvCache", "FusedInferAttentionScore")
"""What ``compile.paged_attention: inplace`` emits on 910B / 910_93 (passes/ascend/lower.py)."""
READONLY_KERNELS = ("FusedInferAttentionScore",)
"""What ``compile.paged_attention: readonly`` emits on 910B / 910_93 (passes/ascend/readonly.py): no write op."""
INPLACE_DTYPES = ("float16", "bfloat16")
"""The graph dtypes FIA computes in (its query: float16 / bfloat16 / int8, def.cpp:27-48)."""
PAGED_ATTENTION_CHOICES = ("auto", "inplace", "readonly", "gather")
"""``compile.paged_attention``: ``auto`` resolves per SoC and graph dtype (:func:`paged_attention_mode`)."""

FAMILIES = ("ascend910b", "ascend910_93", "ascend310p", "ascend310b", "ascend910")
"""The SoC families named by the rows and ATC's chip names (``Ascend910`` alone: the Atlas training series, 910A)."""


def soc_family(soc_version: str) -> str | None:
    """``Ascend910B3`` → ``ascend910b``, ``Ascend910_9392`` → ``ascend910_93``, ``Ascend310P3`` → ``ascend310p``,
    ``Ascend310B1`` → ``ascend310b``, ``Ascend910A`` / ``Ascend910ProB`` → ``ascend910``; None for any other chip."""
    for pattern, family in ((r"Ascend910B\d.*", "ascend910b"), (r"Ascend910_93\d*", "ascend910_93"),
                            (r"Ascend310P\d*", "ascend310p"), (r"Ascend310B\d*", "ascend310b"),
                            (r"Ascend910(A|ProA|ProB|PremiumA)?", "ascend910")):
        if re.fullmatch(pattern, soc_version):
            return family
    return None


def ships(ge_op: str, soc_version: str) -> bool:
    """True when ``ge_op``'s kernel ships for ``soc_version``'s family (an unknown chip: no fused kernel)."""
    row = KERNELS.get(ge_op)
    return row is not None and soc_family(soc_version) in row.families


def missing_reason(ge_op: str, soc_version: str) -> str:
    """One line: why ``ge_op`` is not emitted for ``soc_version``, with the row's source."""
    row = KERNELS[ge_op]
    family = soc_family(soc_version)
    return (f"{ge_op}: no kernel ships for {soc_version} ({family or 'a SoC family no row names'}); "
            f"it ships for {', '.join(sorted(row.families))} [{row.source}]")


def paged_block_size_problem(block_size: int) -> str | None:
    """Why FIA's paged mode refuses ``block_size`` (non-zero, at most 512, a multiple of 16 for float16/bfloat16:
    aclnnFusedInferAttentionScoreV4.md:912, :1936), or None."""
    if not 0 < block_size <= 512 or block_size % 16:
        return (f"block size {block_size}: FusedInferAttentionScore's paged mode takes a non-zero multiple of 16 up "
                "to 512 in float16/bfloat16 (aclnnFusedInferAttentionScoreV4.md:912, :1936)")
    return None


def _unbuildable(kernels: tuple[str, ...], soc_version: str, graph_dtype: str, block_size: int | None) -> list[str]:
    """Why a paged-attention mode needing ``kernels`` cannot be built for this SoC, dtype and block size (empty:
    it can), each reason with its source."""
    missing = [missing_reason(op, soc_version) for op in kernels if not ships(op, soc_version)]
    if graph_dtype not in INPLACE_DTYPES:
        missing.append(f"FusedInferAttentionScore computes in float16/bfloat16/int8, the graph is {graph_dtype} "
                       f"[{KERNELS['FusedInferAttentionScore'].source}]")
    if block_size is not None and (problem := paged_block_size_problem(block_size)) is not None:
        missing.append(problem)
    return missing


def paged_attention_mode(requested: str, soc_version: str, graph_dtype: str,
                         block_size: int | None = None) -> tuple[str, str]:
    """``(mode, note)``: the paged-attention mode a bundle is built with and why (one line, printed at compile and
    recorded in the manifest's ``ascend.paged_attention_note``). ``auto``: ``inplace`` where every kernel of
    :data:`INPLACE_KERNELS` ships for ``soc_version`` and the graph is float16/bfloat16, else ``gather``.
    ``readonly`` (never chosen by auto): where :data:`READONLY_KERNELS` ship and the graph is float16/bfloat16.
    Raises ValueError (one line) for ``inplace`` / ``readonly`` where it cannot be built."""
    if requested not in PAGED_ATTENTION_CHOICES:
        raise ValueError(f"paged_attention {requested!r} is not one of {', '.join(PAGED_ATTENTION_CHOICES)}")
    if requested == "readonly":
        missing = _unbuildable(READONLY_KERNELS, soc_version, graph_dtype, block_size)
        if missing:
            raise ValueError(f"paged_attention 'readonly' cannot be built: {missing[0]}")
        return "readonly", (f"readonly: FusedInferAttentionScore (with its log-sum-exp) ships for {soc_version}; "
                            "the recipe chose it: the step's rows come out as kv_new and are copied into the pools")
    if requested == "gather":
        return "gather", "gather: the recipe chose it"
    missing = _unbuildable(INPLACE_KERNELS, soc_version, graph_dtype, block_size)
    if not missing:
        return "inplace", (f"inplace: ScatterPaKvCache and FusedInferAttentionScore ship for {soc_version}"
                           f"{' (the recipe chose it)' if requested == 'inplace' else ''}")
    if requested == "inplace":
        raise ValueError(f"paged_attention 'inplace' cannot be built: {missing[0]}")
    return "gather", f"gather: {'; '.join(missing)}"
