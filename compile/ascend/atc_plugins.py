"""Our ONNX parser plugins for ATC (reference/ascend.md §1.7, §2.2): one C++ plugin per op type the ascend lowering
marks ``own_plugin``, mapping ``ai.onnx::<opset>::<op>`` to a GE op and copying the node's attributes, built into
``libcust_onnx_parsers.so`` and installed as the OPP vendor ``omforge`` (see :mod:`omforge.compile.ascend.atc` for
what is known and unverified about them). Sources are rendered from ``templates/``; none was compiled against a real
CANN toolkit here: the tests compile them against stub headers (tests/stubs/)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from omforge.compile.ascend.render import PLUGIN_LIBRARY, PLUGIN_VENDOR, AtcError, PluginProject, templates, write_file
from omforge.passes.ascend.lower import AscendLowering, CustomOp

AttrKind = Literal["float", "int", "bool", "string"]


@dataclass(frozen=True)
class PluginAttr:
    """One ONNX attribute a plugin copies to the GE op."""

    onnx: str
    ge: str
    kind: AttrKind


@dataclass(frozen=True)
class PluginSpec:
    """How our plugin maps one ONNX op type: its attributes and what to say about it in the source."""

    attrs: tuple[PluginAttr, ...]
    notes: tuple[str, ...]


def _attrs(*items: tuple[str, AttrKind]) -> tuple[PluginAttr, ...]:
    return tuple(PluginAttr(name, name, kind) for name, kind in items)


PLUGINS: dict[str, PluginSpec] = {
    "OmRmsNorm": PluginSpec(_attrs(("epsilon", "float")), (
        "CANN's own NPURmsNorm plugin sets epsilon to 1e-6 whatever the node says (its source in the ops-nn repo);",
        "this one carries the model's epsilon to the same GE RmsNorm kernel. No kernel of ours is needed.",
    )),
    "OmAddRmsNorm": PluginSpec(_attrs(("epsilon", "float")), (
        "CANN's own NPUAddRmsNorm plugin sets epsilon to 1e-6 whatever the node says (its source in the ops-nn repo);",
        "this one carries the model's epsilon to the same GE AddRmsNorm kernel (outputs y, rstd, x = x1 + x2).",
        "No kernel of ours is needed.",
    )),
    "SwiGlu": PluginSpec(_attrs(("dim", "int")), (
        "CANN has no ONNX plugin for SwiGlu (none in its ONNX operator list). GE SwiGlu computes",
        "silu(x[..., :F]) * x[..., F:] along dim, our [gate | up] merge. torch_npu lists it for Atlas A2 only,",
        "not 310P [unverified on other SoCs]. No kernel of ours is needed.",
    )),
    "NPUPromptFlashAttention": PluginSpec(_attrs(
        ("num_heads", "int"), ("input_layout", "string"), ("scale_value", "float"), ("pre_tokens", "int"),
        ("next_tokens", "int"), ("num_key_value_heads", "int"), ("sparse_mode", "int"), ("inner_precise", "int"),
    ), (
        "CANN's own PFA plugin registers ai.onnx 11-16 and 19, not 17 or 18 (its source in ops-transformer); this adds",
        "the export's opset. CANN's plugin maps the node to a PartitionedCall subgraph (ParseOpToGraphFn) to",
        "handle PFA's optional inputs; this one maps it straight to GE PromptFlashAttention, and the lowering",
        "leaves pse_shift (input 3) empty. [unverified] that the parser keeps atten_mask at IR input 4 then,",
        "and that this registration coexists with CANN's (OpRegistry keys GE type + original type).",
    )),
    "OmRotaryPositionEmbedding": PluginSpec(_attrs(("mode", "int")), (
        "CANN's built-in plugin for NPURotaryPositionEmbedding is in no indexed hicann/ops-transformer commit, only in",
        "third-party mirrors (e.g. libochao-huawei/ops-transformer 5778144, posembedding/rotary_position_embedding/",
        "framework/): an ATC without it stops with E16002. This maps our key to the",
        "GE op RotaryPositionEmbedding (x, cos, sin; mode; Atlas A2/A3 only). No kernel of ours is needed.",
    )),
    "OmScatterPaKvCache": PluginSpec(_attrs(("cache_mode", "string")), (
        "GE ScatterPaKvCache (a 2026-08 mirror of ops-transformer, attention/scatter_pa_kv_cache/op_graph/",
        "scatter_pa_kv_cache_proto.h:137-153): key, key_cache, slot_mapping, value, value_cache are IR inputs 0-4, the",
        "optional compress inputs after them stay unset; key_cache / value_cache are ref outputs (same names), so on a",
        "RefData pool the write is in place (inner_identity_add_pass.cc:30-60). No kernel of ours is needed.",
    )),
    "OmFusedInferAttentionScore": PluginSpec(_attrs(
        ("num_heads", "int"), ("num_key_value_heads", "int"), ("scale", "float"), ("input_layout", "string"),
        ("sparse_mode", "int"), ("block_size", "int"), ("inner_precise", "int"),
    ), (
        "CANN ships no ONNX plugin for FusedInferAttentionScore. The node carries every input at its GE IR index",
        "(empty names for the optional ones between: pse_shift 3, quant/antiquant 7-13), so the positional mapping",
        "puts block_table at 14. key and value are DYNAMIC_INPUTs (one tensor each here). [unverified] that the",
        "parser's positional mapping registers a dynamic input of one: CANN's own IFA plugin",
        "(npu_incre_flash_attention_onnx_plugin.cpp:99-165) instead registers a PartitionedCall with",
        "DynamicInputRegister and builds the op in ParseOpToGraphFn (create_dynamic_input_key) — the form to switch",
        "to if ATC refuses this one. No kernel of ours is needed.",
    )),
    "OmFusedInferAttentionScoreLse": PluginSpec(_attrs(
        ("num_heads", "int"), ("num_key_value_heads", "int"), ("scale", "float"), ("input_layout", "string"),
        ("sparse_mode", "int"), ("block_size", "int"), ("inner_precise", "int"), ("softmax_lse_flag", "bool"),
    ), (
        "The readonly paged attention's FusedInferAttentionScore: as OmFusedInferAttentionScore (every input at its",
        "GE IR index: query 0, key 1, value 2, lengths 5-6, block_table 14; no mask, sparse_mode 0) plus",
        "softmax_lse_flag, a GE Bool (fused_infer_attention_score_def.cpp:555; ONNX int -> bool), and the second",
        "output softmax_lse, float32 [B, N, Q_S, 1] (def.cpp:544; aclnnFusedInferAttentionScoreV4.md:714).",
        "[unverified] the same positional-mapping question as OmFusedInferAttentionScore. No kernel of ours is needed.",
    )),
    # the MoE chain (passes/ascend/moe.py); GE prototypes at hicann/ops-transformer c29bc10
    "OmMoeGatingTopKSoftmax": PluginSpec(_attrs(("k", "int")), (
        "GE MoeGatingTopKSoftmax (moe/moe_gating_top_k_softmax/op_graph/moe_gating_top_k_softmax_proto.h:37-44): x is",
        "IR input 0 (the optional finished, 1, is left out); outputs y, expert_idx, row_idx. CANN's own plugin for",
        "NPUMoeGatingTopKSoftmax is in a 2026 mirror only (libochao-huawei/ops-transformer 5778144).",
        "No kernel of ours is needed.",
    )),
    "OmMoeInitRouting": PluginSpec(_attrs(("active_num", "int")), (
        "GE MoeInitRouting (moe/moe_init_routing/op_graph/moe_init_routing_proto.h:39-49): x, row_idx, expert_idx are",
        "IR inputs 0-2; outputs expanded_x, expanded_row_idx, expanded_expert_idx. CANN's NPUMoeInitRouting plugin is",
        "in the 2026 mirror only. No kernel of ours is needed.",
    )),
    "OmMoeComputeExpertTokens": PluginSpec(_attrs(("num_experts", "int")), (
        "GE MoeComputeExpertTokens (moe/moe_compute_expert_tokens/op_graph/moe_compute_expert_tokens_proto.h:31-36):",
        "sorted_experts is IR input 0. CANN's plugin is in the 2026 mirror only. No kernel of ours is needed.",
    )),
    "OmGroupedMatmul": PluginSpec(_attrs(("split_item", "int"), ("group_type", "int"), ("group_list_type", "int")), (
        "GE GroupedMatmul (gmm/grouped_matmul/op_host/grouped_matmul_def.cpp:22-154): no ONNX plugin exists in any",
        "source read. The node carries x at IR input 0 and weight at 1 (DYNAMIC inputs, one tensor each), bias, scale,",
        "offset, antiquant_scale, antiquant_offset (2-6, DYNAMIC) empty and group_list (int64) at 7. [unverified] that",
        "the parser's positional mapping registers a dynamic input of one tensor and of none: CANN's IFA plugin",
        "(npu_incre_flash_attention_onnx_plugin.cpp:99-165) registers a PartitionedCall with DynamicInputRegister",
        "instead — the form to switch to if ATC refuses this one. No kernel of ours is needed.",
    )),
    "OmMoeFinalizeRoutingV2": PluginSpec(_attrs(("drop_pad_mode", "int")), (
        "GE MoeFinalizeRoutingV2 (moe/moe_finalize_routing_v2/op_graph/moe_finalize_routing_v2_proto.h:52-62):",
        "expanded_x 0, expanded_row_idx 1, the optional x1, x2, bias (2-4) empty, scales 5, expert_idx (6) left out.",
        "CANN's NPUMoeFinalizeRoutingV2 plugin is in the 2026 mirror only. No kernel of ours is needed.",
    )),
}
"""Every op type our plugins map (attributes copied under the same names: the GE ops use the ONNX ones)."""

_KINDS: dict[AttrKind, tuple[type, ...]] = {"float": (float, int), "int": (int,), "bool": (int,), "string": (str,)}
_C_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ONNX_KEY = re.compile(r"ai\.onnx::\d+::[A-Za-z_][A-Za-z0-9_]*")


def plugin_ops(lowering: AscendLowering | Mapping[str, Any]) -> list[CustomOp]:
    """The custom ops that need our own plugin, from :func:`lower`'s result or its ``to_dict()`` (cached stages)."""
    raw = lowering.custom_ops if isinstance(lowering, AscendLowering) else lowering.get("custom_ops", {})
    ops = [op if isinstance(op, CustomOp) else CustomOp(**op) for op in raw.values()]
    return sorted((op for op in ops if op.own_plugin), key=lambda op: op.op_type)


def _check_plugin_op(op: CustomOp) -> PluginSpec:
    spec = PLUGINS.get(op.op_type)
    if spec is None:
        raise AtcError(f"the lowering needs an own plugin for '{op.op_type}' ({op.onnx_key}) but omforge has no "
                       f"plugin template for it (known: {', '.join(sorted(PLUGINS))})")
    if not (_ONNX_KEY.fullmatch(op.onnx_key) and _C_IDENTIFIER.fullmatch(op.op_type)
            and _C_IDENTIFIER.fullmatch(op.ge_type)):
        raise AtcError(f"plugin for '{op.op_type}': unexpected names {op.onnx_key!r} / {op.ge_type!r}")
    mapped = {a.onnx: a for a in spec.attrs}
    for name, values in op.attributes.items():
        attr = mapped.get(name)
        if attr is None:
            raise AtcError(f"'{op.op_type}' nodes carry attribute '{name}', which its plugin does not copy "
                           f"(it copies {', '.join(mapped)}): the lowering and compile/ascend/atc.py PLUGINS disagree")
        bad = [v for v in values if isinstance(v, bool) or not isinstance(v, _KINDS[attr.kind])]
        if bad:
            raise AtcError(f"'{op.op_type}' attribute '{name}': values {bad} are not {attr.kind}")
    return spec


def _snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()


def render_plugins(lowering: AscendLowering | Mapping[str, Any], out_dir: Path) -> PluginProject | None:
    """Write the custom-op project for every op type the lowering marks ``own_plugin`` into ``out_dir``; None (and
    nothing written) when none needs one. Its ``build.sh`` builds ``libcust_onnx_parsers.so`` and installs it as
    the OPP vendor ``omforge`` (reference/ascend.md §1.7)."""
    ops = plugin_ops(lowering)
    if not ops:
        return None
    env = templates()
    out_dir.mkdir(parents=True, exist_ok=True)
    project = PluginProject(out_dir, ops)
    sources = []
    for op in ops:
        spec = _check_plugin_op(op)
        source = f"{_snake(op.op_type)}_onnx_plugin.cc"
        attrs = [{"onnx": a.onnx, "ge": a.ge, "kind": a.kind, "var": a.onnx} for a in spec.attrs]
        text = env.get_template("onnx_plugin.cc.j2").render(op=op, attrs=attrs, notes=spec.notes)
        sources.append(source)
        project.files.append(write_file(out_dir / source, text))
    project.files.append(write_file(out_dir / "omforge_onnx_attrs.h",
                                    env.get_template("omforge_onnx_attrs.h.j2").render()))
    context = dict(ops=ops, sources=sources, library=PLUGIN_LIBRARY, vendor=PLUGIN_VENDOR,
                   own_kernels=project.own_kernels)
    for template, name, mode in (("plugins_CMakeLists.txt.j2", "CMakeLists.txt", 0o644),
                                 ("plugins_build.sh.j2", "build.sh", 0o755),
                                 ("plugins_README.md.j2", "README.md", 0o644)):
        project.files.append(write_file(out_dir / name, env.get_template(template).render(**context), mode))
    return project
