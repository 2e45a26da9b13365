"""Lowering to Ascend (ATC → OM): neutral ops → nodes CANN's ONNX plugins map, plugins of our own, or plain ops.

ATC's ONNX parser keys every node as ``"<domain>::<opset>::<op_type>"`` (empty domain → ``ai.onnx``) and accepts
a node only if some plugin registered that exact key; a node in the default domain is accepted only when the
model has exactly ONE ``opset_import`` entry (reference/ascend.md §1.6). So every node here is in the default
domain and the lowered model imports only ``""``, at the export's opset (18 by default; 11..18 accepted, ≤ 18
being what the parser documents). What CANN's built-in plugins register (their sources in ops-transformer /
ops-nn; ascend.md §2.1, the rotary one read from its plugin source):

  NPURmsNorm, NPUAddRmsNorm, NPURotaryPositionEmbedding   ai.onnx 11–18 (and npu::1)
  NPUPromptFlashAttention                                  ai.onnx 11–16 and 19 only (and npu::1): NOT 17 or 18

The lowering, op by op (``own plugin`` = one the compile stage renders; a plugin may map a node to an existing
GE op, so most need no kernel of ours, §1.7):

  RMSNorm     → NPURmsNorm(x, gamma) -> (y, rstd)                  rmsnorm_plugin="cann"
              → OmRmsNorm(x, gamma; epsilon) -> (y, rstd)          rmsnorm_plugin="omforge": own plugin → GE RmsNorm
                Qwen3's per-head q/k norms are the same node over x [B, S, H, D] with gamma [D]: RmsNorm normalizes
                over gamma's dims, ``gamma_shape = x_shape[n:]`` (hicann/ops-nn norm/rms_norm/docs/aclnnRmsNorm_en.md;
                Atlas 300I/310P: the last axis ≥ 32 bytes, i.e. head_dim ≥ 16 in float16)
  AddRMSNorm  → NPUAddRmsNorm / OmAddRmsNorm(x1, x2, gamma) -> (y, rstd, x1 + x2): our (y, sum) are outputs 0, 2
  Rotary      → NPURotaryPositionEmbedding(x, cos, sin; mode=0), cos/sin [B, 1, S, D] as inputs: mode 0 is
                rotate_half (1 = interleaved) and the plugin rejects a node without ``mode`` (plugin source;
                npu_rotary_position_embedding docs).

Per SoC (``soc_version``): each fused op above is emitted only where its CANN kernel ships for the chip
(:mod:`omforge.passes.ascend_kernels`, read from the ops repositories' ``*_def.cpp``); elsewhere it is lowered to its
plain decomposition and :attr:`AscendLowering.kernel_fallbacks` says why — e.g. RotaryPositionEmbedding ships for
Atlas A2/A3 only, so Atlas 300I/310P gets plain rotary, and Atlas 200I/500 A2 (310B) gets plain ops throughout.
  SwiGLU      → SwiGlu(x; dim=-1): no built-in plugin; ours maps it to the GE op SwiGlu (Atlas A2), whose
                ``silu(x[..., :F]) · x[..., F:]`` matches our [gate | up] merge.
  Attention   → plain ops by default (``attention="plain"``): at opset 18 no built-in plugin has the PFA key,
                and PFA computes in fp16/bf16/int8 only. ``attention="pfa"`` emits
                NPUPromptFlashAttention(query, key, value, pse_shift="", atten_mask; input_layout="BNSD",
                num_heads, num_key_value_heads, scale_value, pre_tokens=2147483647, next_tokens=0, sparse_mode=0,
                inner_precise=0) with the whole causal mask ``[S, S]`` bool, True = masked (PFA docs: sparse mode 0
                takes the full q_S × kv_S mask; modes 2–4 a compressed 2048 × 2048 one); it needs an own plugin
                registering ``ai.onnx::18::NPUPromptFlashAttention`` → GE PromptFlashAttention (no kernel).
                [unverified: that such a registration coexists with CANN's; that the parser passes the empty
                pse_shift input through; PFA under fp32 graphs and ATC's precision modes]
  PagedAttention → the step graph, out of place (an OM cannot update an input, §0.2 / §2.4), over ONE pool
                ``kv_cache [num_slots, num_layers, 2, kv_heads, head_dim]`` (slot-major: every layer's K and V
                row of a slot side by side, §2.4 / §5.1) with a static slot count (``num_slots``), so the pool
                stays out of ATC's ``--input_shape`` and the dims list of the gears (≤ 128, §3.4). Instead of
                ``key_cache_out.N``/``value_cache_out.N`` the graph outputs the step's new rows of every layer as
                ``kv_new [num_tokens, num_layers, 2, kv_heads, head_dim]``: the new rows of consecutive slots are
                one contiguous range in both, so the runtime stores a run of slots with ONE device copy.
                ``slot_mapping`` is then unused and leaves the graph's inputs. Within the step, attention still
                sees the new tokens:
                  ``paged_attention="plain"`` (default: our plugin needs a CANN build to exist): gather each
                  sequence's slots of layer N's K (and V) rows from the not-yet-updated pool, viewed as rows
                  ``[num_slots · 2L, kv·D]`` (row ``slot·2L + 2N + kind``: only that layer's rows are read), into a
                  small context ``[B, M·bs, kv·D]``, ScatterND the new rows into it at (sequence, position), then
                  plain-op attention; cost follows the context, never the pool;
                  ``paged_attention="plugin"``: our op ``PagedAttention(query, key, value, kv_cache, block_tables,
                  query_index, token_index, position_ids; scale_value, num_heads, num_key_value_heads, block_size,
                  layer, num_layers) -> attention_out`` with the same semantics (own plugin AND own kernel).
  LoraAdd     → plain ops always (passes/lora.py ``lower_plain``): Reshape of ``lora_slots`` to ``[T]`` (int64),
                ``Gather(axis=0)`` of each pool by it (GatherV2: int64 indices), 3-D batched ``MatMul``s
                (BatchMatMulV2), ``Shape`` / ``Reshape`` to the projection's shape, ``Add``; every form a row of
                compile/cann_matrix.py already covers. The ACL executor does not feed the pools yet (runtime/ascend
                refuses such a bundle).
  anything else neutral → its plain decomposition (:mod:`omforge.passes.decompose`).

``plain=True`` lowers every op to standard ONNX ops *with the numerics of the chosen lowering*: with
``rmsnorm_plugin="cann"`` the norms are decomposed at CANN's fixed epsilon 1e-6, so the graph shows on any CPU what
the NPU will compute; with ``"omforge"`` it equals the ORT lowering. It is also the graph for a toolchain without
our plugins built.

Epsilon (§2.2): CANN's NPURmsNorm/NPUAddRmsNorm plugins set epsilon to 1e-6 whatever the node says; Llama and
SmolLM2 use 1e-5. Measured on SmolLM2-135M (the plain-op graph on ORT CPU, model eps 1e-5 vs eps forced to
1e-6, i.e. ``plain=True`` with ``"omforge"`` vs ``"cann"``): on a 64-token prompt max |Δlogits| = 0.0122 over all
positions and 0.0028 at the last one (logits std ≈ 6), no argmax changed at any position; greedy 32 tokens
identical on 3 of 3 chat prompts. That drift is above the 1e-3 we call negligible, so the default is
``rmsnorm_plugin="omforge"`` (our plugin carries the model's epsilon to the same GE RmsNorm/AddRmsNorm kernels,
exact numerics); ``"cann"`` needs no plugin build and records the mismatch in
:attr:`AscendLowering.epsilon_note`; its documented tolerance is the drift above (the SmolLM2 test bounds it).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import onnx_ir as ir
from onnxscript.rewriter import pattern

from omforge.contract.ascend import KV_NEW, KV_POOL
from omforge.passes import ascend_kernels, decompose, lora, ops

CANN_RMSNORM_EPS = 1e-6
"""The epsilon CANN's NPURmsNorm/NPUAddRmsNorm plugins hard-code (reference/ascend.md §2.2)."""
MAX_OPSET = 18
"""The highest default-domain opset ATC's ONNX parser documents (reference/ascend.md §1.6)."""

RMSNORM_PLUGINS = ("cann", "omforge")
ATTENTION_MODES = ("plain", "pfa")
PAGED_ATTENTION_MODES = ("plain", "plugin")
DEFAULT_RMSNORM_PLUGIN = "omforge"  # CANN's fixed epsilon moves SmolLM2's logits by up to 0.012 (module docstring)

_NORM_OPS = {"cann": ("NPURmsNorm", "NPUAddRmsNorm"), "omforge": ("OmRmsNorm", "OmAddRmsNorm")}
_FUSED_KERNEL = {"RMSNorm": "RmsNorm", "AddRMSNorm": "AddRmsNorm", "Rotary": "RotaryPositionEmbedding",
                 "SwiGLU": "SwiGlu", "Attention": "PromptFlashAttention"}
"""Neutral op → the CANN kernel its fused lowering needs (:data:`ascend_kernels.KERNELS`); without it: plain ops."""
DEFAULT_SOC_VERSION = "Ascend910B3"
_INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class OpSpec:
    """How a non-standard ONNX op type reaches the OM: the GE IR op it becomes and who provides what."""

    ge_type: str
    cann_opsets: tuple[int, ...]  # ai.onnx versions CANN's built-in plugin registers (empty: none exists)
    own_kernel: bool  # False: the GE op exists, a plugin (CANN's or ours) only maps the node to it
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


_CANN_11_18 = tuple(range(11, 19))
SPECS: dict[str, OpSpec] = {
    "NPURmsNorm": OpSpec("RmsNorm", _CANN_11_18, False, ("x", "gamma"), ("y", "rstd")),
    "NPUAddRmsNorm": OpSpec("AddRmsNorm", _CANN_11_18, False, ("x1", "x2", "gamma"), ("y", "rstd", "x")),
    "OmRmsNorm": OpSpec("RmsNorm", (), False, ("x", "gamma"), ("y", "rstd")),
    "OmAddRmsNorm": OpSpec("AddRmsNorm", (), False, ("x1", "x2", "gamma"), ("y", "rstd", "x")),
    "NPURotaryPositionEmbedding": OpSpec("RotaryPositionEmbedding", _CANN_11_18, False, ("x", "cos", "sin"), ("y",)),
    "SwiGlu": OpSpec("SwiGlu", (), False, ("x",), ("y",)),
    "NPUPromptFlashAttention": OpSpec("PromptFlashAttention", (*range(11, 17), 19), False,
                                      ("query", "key", "value", "pse_shift", "atten_mask"), ("attention_out",)),
    "PagedAttention": OpSpec("PagedAttention", (), True,
                             ("query", "key", "value", "kv_cache", "block_tables", "query_index", "token_index",
                              "position_ids"), ("attention_out",)),
}
"""Every non-standard op type this lowering can emit."""


@dataclass
class CustomOp:
    """One non-standard op type in the lowered graph: what the compile stage renders a plugin (or kernel) for."""

    op_type: str
    onnx_key: str  # the key ATC's parser looks up: "ai.onnx::<opset>::<op_type>"
    ge_type: str
    count: int
    attributes: dict[str, list[Any]]  # attribute → its distinct values over the nodes
    own_plugin: bool  # no built-in plugin registers onnx_key: ours must
    own_kernel: bool
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


@dataclass
class AscendLowering:
    """What :func:`lower` did, for the compile stage (plugin sources, manifest) and the runtime (KV write-back)."""

    opset: int
    options: dict[str, Any]
    lowered: dict[str, int]  # neutral op type → nodes lowered
    custom_ops: dict[str, CustomOp] = field(default_factory=dict)
    epsilon_note: str | None = None
    kernel_fallbacks: dict[str, str] = field(default_factory=dict)  # neutral op → why its fused kernel was not used
    new_kv_outputs: list[str] = field(default_factory=list)  # kv_new: the rows the host copies to slot_mapping
    removed_inputs: list[str] = field(default_factory=list)  # the per-layer pools and slot_mapping

    @property
    def own_plugins(self) -> list[str]:
        return sorted(t for t, c in self.custom_ops.items() if c.own_plugin)

    @property
    def own_kernels(self) -> list[str]:
        return sorted(t for t, c in self.custom_ops.items() if c.own_kernel)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "own_plugins": self.own_plugins, "own_kernels": self.own_kernels}


class RMSNormRule(decompose.DecomposeRMSNorm):
    """RMSNorm → ``op_type`` (x, gamma) -> (y, rstd), or plain ops when ``op_type`` is None. The node carries the
    model's epsilon (CANN's NPURmsNorm plugin ignores it); ``epsilon`` replaces it in the plain ops."""

    def __init__(self, op_type: str | None, epsilon: float | None = None):
        super().__init__(f"ascend_rms_norm_{op_type or 'plain'}")
        self.op_type, self.epsilon = op_type, epsilon  # epsilon: override the node's (CANN's fixed value)

    def rewrite(self, op, x, weight, y, **_):  # noqa: ANN001, ANN201
        eps = self.epsilon if self.epsilon is not None else y.producer().attributes["epsilon"].value
        if self.op_type is None:
            return decompose.rms_norm(op, x, weight, eps)
        return getattr(op, self.op_type)(x, weight, epsilon=eps, _outputs=2)[0]


class AddRMSNormRule(decompose.DecomposeAddRMSNorm):
    """AddRMSNorm → ``op_type`` (x1, x2, gamma) -> (y, rstd, x1 + x2), or plain ops when ``op_type`` is None."""

    def __init__(self, op_type: str | None, epsilon: float | None = None):
        super().__init__(f"ascend_add_rms_norm_{op_type or 'plain'}")
        self.op_type, self.epsilon = op_type, epsilon

    def rewrite(self, op, a, b, weight, y, **_):  # noqa: ANN001, ANN201
        eps = self.epsilon if self.epsilon is not None else y.producer().attributes["epsilon"].value
        if self.op_type is None:
            total = op.Add(a, b)
            return decompose.rms_norm(op, total, weight, eps), total
        out, _, total = getattr(op, self.op_type)(a, b, weight, epsilon=eps, _outputs=3)
        return out, total


class NPURotary(decompose.DecomposeRotary):
    def rewrite(self, op, x, cos, sin, **_):  # noqa: ANN001, ANN201
        return op.NPURotaryPositionEmbedding(x, cos, sin, mode=0)


class OwnSwiGlu(decompose.DecomposeSwiGLU):
    def rewrite(self, op, gate_up, **_):  # noqa: ANN001, ANN201
        return op.SwiGlu(gate_up, dim=-1)


class NPUPromptFlashAttention(decompose.DecomposeAttention):
    """Full-sequence causal attention → PFA in BNSD with the whole causal mask (sparse mode 0)."""

    def rewrite(self, op, q, k, v, o, **_):  # noqa: ANN001, ANN201
        a = o.producer().attributes
        seq = op.Gather(op.Shape(q), op.Constant(value_int=2), axis=0)
        r = op.Range(op.Constant(value_int=0), seq, op.Constant(value_int=1))
        mask = op.Greater(op.Unsqueeze(r, op.Constant(value_ints=[0])), op.Unsqueeze(r, op.Constant(value_ints=[1])))
        return op.NPUPromptFlashAttention(
            q, k, v, None, mask, input_layout="BNSD", num_heads=a["q_heads"].value,
            num_key_value_heads=a["kv_heads"].value, scale_value=a["scale"].value, pre_tokens=_INT32_MAX,
            next_tokens=0, sparse_mode=0, inner_precise=0)


class PagedAttentionNewRows(decompose.DecomposePagedAttention):
    """PagedAttention → (o, new K rows, new V rows) over the interleaved pool ``pool``: plain ops, or our
    ``PagedAttention`` op when ``plugin``. The layer is the one of the node's ``key_cache.N`` input."""

    def __init__(self, plugin: bool, pool: ir.Value, num_layers: int):
        super().__init__(f"ascend_paged_attention_{'plugin' if plugin else 'plain'}")
        self.plugin, self.pool, self.num_layers = plugin, pool, num_layers

    def rewrite(self, op, q, k, v, kc, vc, slots, tables, qidx, tidx, pos, o, **_):  # noqa: ANN001, ANN201
        a = {name: o.producer().attributes[name].value for name in ("scale", "q_heads", "kv_heads", "block_size")}
        layer = int(kc.name.rsplit(".", 1)[1])
        if not self.plugin:
            head_dim = q.shape[-1]
            rows = op.Reshape(self.pool, op.Constant(value_ints=[-1, a["kv_heads"] * head_dim]))

            def gather(op, pool, block_tables):  # noqa: ANN001, ANN202 - layer `layer`'s K (or V) rows of each slot
                kind = 0 if pool is kc else 1
                bs, two_l = a["block_size"], 2 * self.num_layers
                slot = op.Add(op.Mul(op.Unsqueeze(block_tables, op.Constant(value_ints=[2])),
                                     op.Constant(value_int=bs)), op.Constant(value_ints=list(range(bs))))
                row = op.Add(op.Mul(slot, op.Constant(value_int=two_l)), op.Constant(value_int=2 * layer + kind))
                return op.Gather(rows, op.Reshape(row, op.Constant(value_ints=[0, -1])), axis=0)

            return decompose.paged_attention_new_rows(op, q, k, v, kc, vc, tables, qidx, tidx, pos, **a,
                                                      gather=gather)
        out = op.PagedAttention(q, k, v, self.pool, tables, qidx, tidx, pos, scale_value=a["scale"],
                                num_heads=a["q_heads"], num_key_value_heads=a["kv_heads"], block_size=a["block_size"],
                                layer=layer, num_layers=self.num_layers)
        return out, decompose.token_major(op, k), decompose.token_major(op, v)


def _pool_input(graph: ir.Graph, num_slots: int | None) -> tuple[ir.Value, int] | None:
    """The interleaved pool input (not yet in the graph) shaped after the per-layer ``key_cache.N`` pools, and
    the layer count; None without pools."""
    pools = [v for v in graph.inputs if re.fullmatch(r"key_cache\.\d+", v.name or "")]
    if not pools:
        return None
    _, kv_heads, head_dim = pools[0].shape
    shape = ir.Shape([num_slots if num_slots is not None else "num_slots", len(pools), 2, kv_heads, head_dim])
    return ir.Value(name=KV_POOL, shape=shape, type=pools[0].type), len(pools)


class PoolTooLarge(ValueError):
    """The interleaved pool has more elements than the whole-pool Gather can index (:func:`_check_gather_bound`)."""

    def __init__(self, elements: int, max_slots: int):
        super().__init__(
            f"the KV pool holds {elements:,} elements, above 2^31 - 1: the plain paged attention gathers from the "
            "whole pool, and the only open GatherV2 kernel switches to 64-bit offsets explicitly above INT32_MAX "
            "(hicann/ops-nn index/gather_v2/op_host/arch35/gather_v2_tiling.cpp) while the closed one of 910B/310P "
            f"documents no bound [unverified]; use at most {max_slots:,} slots")
        self.elements, self.max_slots = elements, max_slots


def _check_gather_bound(pool: ir.Value) -> None:
    """Refuse a pool whose element count passes 2^31 - 1 (the Gather's data tensor; reference/ascend.md §5.2)."""
    slots, *row = pool.shape
    per_slot = math.prod(row)
    if slots * per_slot > _INT32_MAX:
        raise PoolTooLarge(slots * per_slot, _INT32_MAX // per_slot)


def _stack_new_rows(graph: ir.Graph, pool: ir.Value, num_layers: int) -> list[str]:
    """Replace the per-layer pool inputs by ``pool`` and the per-layer new-row outputs (left under the names
    ``key_cache_out.N`` / ``value_cache_out.N``) by one ``kv_new [num_tokens, L, 2, kv, D]``; drop the then
    unused ``slot_mapping``. Returns the inputs removed."""
    rows: dict[tuple[int, int], ir.Value] = {}
    for value in graph.outputs:
        m = re.fullmatch(r"(key|value)_cache_out\.(\d+)", value.name or "")
        if m is not None:
            rows[int(m[2]), 0 if m[1] == "key" else 1] = value
    if sorted(rows) != [(n, k) for n in range(num_layers) for k in (0, 1)]:
        raise RuntimeError(f"ascend lowering: new K/V rows of {num_layers} layers expected, found {sorted(rows)}")
    nodes: list[ir.Node] = []
    axis1 = ir.node("Constant", [], attributes={"value_ints": [1]}, name="kv_new_axis")
    nodes.append(axis1)
    parts = []
    for n in range(num_layers):
        for k in (0, 1):
            nodes.append(ir.node("Unsqueeze", [rows[n, k], axis1.outputs[0]], name=f"kv_new_unsqueeze_{n}_{k}"))
            parts.append(nodes[-1].outputs[0])
    nodes.append(ir.node("Concat", parts, attributes={"axis": 1}, name="kv_new_concat"))
    *_, kv_heads, head_dim = pool.shape
    nodes.append(ir.node("Constant", [], attributes={"value_ints": [0, num_layers, 2, kv_heads, head_dim]},
                         name="kv_new_shape"))
    nodes.append(ir.node("Reshape", [nodes[-2].outputs[0], nodes[-1].outputs[0]], name="kv_new_reshape"))
    out = nodes[-1].outputs[0]
    out.name, out.type = KV_NEW, rows[0, 0].type
    out.shape = ir.Shape(["num_tokens", num_layers, 2, kv_heads, head_dim])
    graph.extend(nodes)
    kept = [v for v in graph.outputs if v not in rows.values()]
    graph.outputs.clear()
    graph.outputs.extend([*kept, out])
    for (n, k), value in rows.items():  # the per-layer rows stay, as the Unsqueezes' inputs, no longer outputs
        value.name = f"{('key', 'value')[k]}_new.{n}"
        value.shape = ir.Shape(["num_tokens", kv_heads, head_dim])
    removed = []
    for value in list(graph.inputs):
        if (re.fullmatch(r"(key|value)_cache\.\d+", value.name or "") or value.name == "slot_mapping") \
                and not value.uses():
            graph.inputs.remove(value)
            removed.append(value.name)
    graph.inputs.append(pool)
    return removed


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"ascend lowering: {name}={value!r} is not one of {', '.join(map(repr, allowed))}")


def lower(model: ir.Model, *, rmsnorm_plugin: Literal["cann", "omforge"] = DEFAULT_RMSNORM_PLUGIN,
          attention: Literal["plain", "pfa"] = "plain", paged_attention: Literal["plain", "plugin"] = "plain",
          plain: bool = False, num_slots: int | None = None,
          soc_version: str = DEFAULT_SOC_VERSION) -> AscendLowering:
    """Lower every neutral op in ``model`` in place for ATC (see the module docstring for each choice).
    ``num_slots``: the pool's slot count, static in the graph (ATC needs it so: §3.4); None keeps it symbolic.
    ``soc_version``: a fused op whose CANN kernel does not ship for that chip (:mod:`ascend_kernels`) is lowered
    to its plain decomposition instead, and the result's ``kernel_fallbacks`` says why."""
    _choice("rmsnorm_plugin", rmsnorm_plugin, RMSNORM_PLUGINS)
    _choice("attention", attention, ATTENTION_MODES)
    _choice("paged_attention", paged_attention, PAGED_ATTENTION_MODES)
    opset = model.opset_imports.get("", None)
    if opset is None or not 11 <= opset <= MAX_OPSET:
        raise ValueError(f"ascend lowering needs a default-domain opset in 11..{MAX_OPSET}, the model has {opset}")
    foreign = set(model.opset_imports) - {"", ops.DOMAIN}
    if foreign or model.functions:
        raise ValueError(f"ascend lowering: the model imports {sorted(foreign)} / has {len(model.functions)} "
                         "functions; ATC accepts one opset_import (the default domain) and no functions")
    neutral = Counter(n.op_type for n in model.graph if n.domain == ops.DOMAIN)
    if any(decompose.window_of(n) for n in model.graph if n.domain == ops.DOMAIN):
        raise ValueError("ascend lowering: sliding-window attention (the model's sliding_window) is not supported "
                         "on the ascend target yet; compile for ort")
    epsilons = sorted({float(n.attributes["epsilon"].value) for n in model.graph
                       if n.domain == ops.DOMAIN and n.op_type in ("RMSNorm", "AddRMSNorm")})

    fallbacks = {neutral_op: ascend_kernels.missing_reason(ge_op, soc_version)
                 for neutral_op, ge_op in _FUSED_KERNEL.items()
                 if (neutral_op != "Attention" or attention == "pfa") and neutral.get(neutral_op)
                 and not ascend_kernels.ships(ge_op, soc_version)}
    fused = {op: not plain and op not in fallbacks for op in _FUSED_KERNEL}
    norm = _NORM_OPS[rmsnorm_plugin][0] if fused["RMSNorm"] else None
    add_norm = _NORM_OPS[rmsnorm_plugin][1] if fused["AddRMSNorm"] else None
    plain_eps = CANN_RMSNORM_EPS if plain and rmsnorm_plugin == "cann" else None  # emulate CANN's numerics
    pfa = attention == "pfa" and fused["Attention"]
    pool = _pool_input(model.graph, num_slots) if neutral.get("PagedAttention") else None
    if pool is not None and num_slots is not None and (paged_attention == "plain" or plain):
        _check_gather_bound(pool[0])
    rules = pattern.RewriteRuleSet([
        *([PagedAttentionNewRows.rule(plugin=paged_attention == "plugin" and not plain, pool=pool[0],
                                      num_layers=pool[1])] if pool is not None else []),
        AddRMSNormRule.rule(add_norm, plain_eps),
        RMSNormRule.rule(norm, plain_eps),
        NPURotary.rule("ascend_rotary") if fused["Rotary"] else decompose.RULES["Rotary"],
        OwnSwiGlu.rule("ascend_swiglu") if fused["SwiGLU"] else decompose.RULES["SwiGLU"],
        NPUPromptFlashAttention.rule("ascend_pfa") if pfa else decompose.RULES["Attention"],
    ])
    rules.apply_to_model(model)
    lora.lower_plain(model.graph)
    left = sorted({n.op_type for n in model.graph if n.domain not in ("", "ai.onnx")})
    if left:
        raise RuntimeError(f"ascend lowering left ops outside the default domain: {left}")
    model.opset_imports.clear()
    model.opset_imports[""] = opset

    result = AscendLowering(opset=opset, lowered=dict(neutral), options=dict(
        rmsnorm_plugin=rmsnorm_plugin, attention=attention, paged_attention=paged_attention, plain=plain,
        soc_version=soc_version), kernel_fallbacks=fallbacks)
    if pool is not None:
        result.removed_inputs += _stack_new_rows(model.graph, *pool)
        result.new_kv_outputs.append(KV_NEW)
    result.custom_ops = _custom_ops(model.graph, opset)
    if rmsnorm_plugin == "cann" and any(abs(e - CANN_RMSNORM_EPS) > 1e-12 for e in epsilons):
        result.epsilon_note = (
            f"NPURmsNorm/NPUAddRmsNorm run at epsilon {CANN_RMSNORM_EPS:g} (fixed by CANN's plugin); the model uses "
            f"{', '.join(f'{e:g}' for e in epsilons)}. Measured on SmolLM2-135M (1e-5 vs 1e-6): max |dlogits| 0.0122 "
            "on a 64-token prompt, greedy 32 tokens unchanged on 3 prompts. rmsnorm_plugin='omforge' is exact.")
    return result


def _custom_ops(graph: ir.Graph, opset: int) -> dict[str, CustomOp]:
    found: dict[str, CustomOp] = {}
    for node in graph:
        spec = SPECS.get(node.op_type)
        if spec is None or node.domain not in ("", "ai.onnx"):
            continue
        entry = found.get(node.op_type)
        if entry is None:
            entry = found[node.op_type] = CustomOp(
                node.op_type, f"ai.onnx::{opset}::{node.op_type}", spec.ge_type, 0, {},
                own_plugin=opset not in spec.cann_opsets, own_kernel=spec.own_kernel, inputs=spec.inputs,
                outputs=spec.outputs)
        entry.count += 1
        for name, attr in node.attributes.items():
            values = entry.attributes.setdefault(name, [])
            if attr.value not in values:
                values.append(attr.value)
    return found
