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
         "310P wants FRACTAL_NZ int8 weights, which we do not build (passes/ascend_w8a16.py refuses it)"),
    _row("PromptFlashAttention", "ascend910b ascend910_93 ascend310p",
         "hicann/ops-transformer attention/prompt_flash_attention/op_host/prompt_flash_attention_def.cpp:113-114,"
         "115-191 (310P: float16 only),192", "310P: float16 only, no GQA (reference/ascend.md §2.3)"),
)}
"""Every fused GE op the lowering can emit, keyed by GE op type. Our own ``PagedAttention`` has no row: its kernel
is ours and not provided (``paged_attention="plugin"`` is refused on every SoC)."""

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
