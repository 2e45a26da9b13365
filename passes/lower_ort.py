"""Lowering to ONNX Runtime (CPU): neutral ops → ORT kernels, or their plain decomposition where ORT has none.

  RMSNorm     → RMSNormalization (opset 23)
  AddRMSNorm  → com.microsoft SkipSimplifiedLayerNormalization (output 3 is the residual sum); with ``kernel=True``
                ``omforge.kernels.AddRMSNorm`` (one vector pass for the sum and its squares, one for the output:
                ORT's op took 60 µs of 64 × 576 rows inside a decode step, 4.8–5.8% of an int4 step)
  Rotary      → RotaryEmbedding (opset 23) on 4-D [B, H, S, D] with cos/sin caches [B, S, D/2] (no position ids)
  SwiGLU      → with ``kernel=True``: ``omforge.kernels.SwiGLU`` (one pass over gate_up); otherwise plain ops
                (ORT has no CPU SwiGLU kernel; it fuses the Sigmoid·Mul into QuickGelu, the Split stays)
  Attention   → Attention (opset 23), ``is_causal``, GQA through ``q_num_heads``/``kv_num_heads``
  PagedAttention → with ``kernel=True``: ``omforge.kernels.PagedAttention``, omforge's own CPU kernel
                   (runtime/ort/kernels): one node per layer that writes the step's K/V rows in place and attends
                   straight from the pools through the block tables (main and decode group in one call).
                   Otherwise (the plain lowering, any ORT): ScatterND KV write + Gather of the block table +
                   Attention (opset 23, 3-D BSH inputs, so the gathered context needs no transpose) with a boolean
                   mask; plain ops when the attention switch is off; twice per layer: the step's main group and its
                   decode group (inputs ``decode_block_tables``, ``decode_query_index``), so decodes ride along with
                   prefill chunks without being padded to them
  MoE         → with ``kernel=True`` and the library's expert kernel wired (:data:`MOE_KERNEL`):
                :func:`lower_moe_kernel`; otherwise plain ops (:func:`decompose.moe`: every expert on every token,
                combined by the dense routing matrix). The plain ops' stacked weights stay float32 whatever
                ``compile.weights`` says (the quantization passes take 2-D MatMul weights only); the router MatMul
                quantizes as any other
  LoraAdd     → with ``lora_kernel`` (default: ``kernel``, the step graph's): ``omforge.kernels.LoraAdd``, same
                operands (tokens grouped by slot); otherwise plain ops (passes/lora.py ``lower_plain``: two Gathers
                of the pools by slot, two batched MatMuls, Reshape, Add)

After lowering the default-domain opset is 23: the exported ops keep their semantics there (the changes
from 18 to 23 only widen type lists).
"""

from __future__ import annotations

import re

import onnx_ir as ir
from onnx_ir.passes import common
from onnxscript.rewriter import pattern

from omforge.contract import row_elems
from omforge.contract.kernel_abi import DOMAIN as KERNEL_DOMAIN
from omforge.contract.kernel_abi import HEAD_DIMS
from omforge.contract.pooling import POOLING_INPUTS
from omforge.passes import decompose, lora, ops, packed_qkv
from omforge.passes.options import ExpertOptions
from omforge.passes.paged_kv import add_decode_group_inputs, new_rows_as_outputs

ORT_OPSET = 23
MS_DOMAIN = "com.microsoft"


class LowerRMSNorm(decompose.DecomposeRMSNorm):
    def rewrite(self, op, x, weight, y, **_):  # noqa: ANN001, ANN201
        return op.RMSNormalization(x, weight, axis=-1, epsilon=y.producer().attributes["epsilon"].value, stash_type=1)


class LowerAddRMSNorm(decompose.DecomposeAddRMSNorm):
    def rewrite(self, op, a, b, weight, y, **_):  # noqa: ANN001, ANN201
        eps = y.producer().attributes["epsilon"].value
        out, _, _, total = op.SkipSimplifiedLayerNormalization(a, b, weight, epsilon=eps, _domain=MS_DOMAIN, _outputs=4)
        return out, total


class LowerAddRMSNormKernel(decompose.DecomposeAddRMSNorm):
    def rewrite(self, op, a, b, weight, y, **_):  # noqa: ANN001, ANN201
        eps = y.producer().attributes["epsilon"].value
        return op.AddRMSNorm(a, b, weight, epsilon=eps, _domain=KERNEL_DOMAIN, _outputs=2)


class LowerRotary(decompose.DecomposeRotary):
    def rewrite(self, op, x, cos, sin, **_):  # noqa: ANN001, ANN201
        half = x.shape[-1] // 2
        axis, step = op.Constant(value_ints=[-1]), op.Constant(value_ints=[1])
        start, end, squeeze = op.Constant(value_ints=[0]), op.Constant(value_ints=[half]), op.Constant(value_ints=[1])
        cos_cache = op.Squeeze(op.Slice(cos, start, end, axis, step), squeeze)
        sin_cache = op.Squeeze(op.Slice(sin, start, end, axis, step), squeeze)
        return op.RotaryEmbedding(x, cos_cache, sin_cache, interleaved=0)


class LowerAttention(decompose.DecomposeAttention):
    def rewrite(self, op, q, k, v, o, **_):  # noqa: ANN001, ANN201
        a = o.producer().attributes
        if decompose.window_of(o.producer()):  # Attention-23's is_causal has no window: the plain ops
            return super().rewrite(op, q, k, v, o)
        return op.Attention(q, k, v, is_causal=1, scale=a["scale"].value, q_num_heads=a["q_heads"].value,
                            kv_num_heads=a["kv_heads"].value)


class LowerPagedAttention(decompose.DecomposePagedAttention):
    """Paged attention, one rule with the KV write as its parameter (``lower(kv_write=…, kernel=…)``):

    ``graph`` — ScatterND into the pool (bound in place by IOBinding), block gather, then the fused ``Attention``
    with a boolean mask, once for the step's main group and once for its decode group (``decode_group``: the
    graph inputs ``contract.DECODE_GROUP_INPUTS``). ``kernel`` — omforge's native kernel
    (``omforge.kernels.PagedAttention*``, contract in runtime/ort/kernels/custom_op.cpp): the same step inputs plus
    the decode group, the pools written in place; the ``graph`` form where no kernel exists for the head size or
    the recipe switched the attention fusion off. ``runtime`` — the pools are read-only inputs, the step's new rows
    are outputs (``key_new.N``) that the executor stores at ``slot_mapping``, and attention sees them through a
    scatter into the small gathered context.
    """

    def __init__(self, name: str, write: str = "graph", decode_group: tuple[ir.Value, ir.Value] | None = None,
                 kv_dtype: str = "float32"):
        super().__init__(name)
        self.write, self.decode_group, self.kv_dtype = write, decode_group, kv_dtype

    def rewrite(self, op, q, k, v, kc, vc, slots, tables, qidx, tidx, pos, o, **_):  # noqa: ANN001, ANN201
        node = o.producer()
        a = {name: node.attributes[name].value for name in ("scale", "q_heads", "kv_heads", "block_size")}
        window = decompose.window_of(node)
        if self.write == "runtime":
            return decompose.paged_attention_new_rows(op, q, k, v, kc, vc, tables, qidx, tidx, pos, **a,
                                                      attend=self.attend(node), window=window)
        if self.write == "kernel" and o.shape[-1] in HEAD_DIMS and node.attributes["fused_attention"].value:
            d_tables, d_qidx = self.decode_group
            return getattr(op, KERNEL_OPS[self.kv_dtype])(q, k, v, kc, vc, slots, tables, qidx, tidx, pos, d_tables,
                                                          d_qidx, **a, window=window, _domain=KERNEL_DOMAIN, _outputs=3)
        return decompose.paged_attention(op, q, k, v, kc, vc, slots, tables, qidx, tidx, pos, **a,
                                         attend=self.attend(node), decode_group=self.decode_group, window=window)

    def attend(self, node: ir.Node):  # noqa: ANN201
        a = node.attributes
        if not a["fused_attention"].value:  # the recipe switched the attention fusion off
            return None

        def fused(op, q, k, v, hide):  # noqa: ANN001, ANN202
            return op.Attention(q, k, v, op.Not(hide), scale=a["scale"].value, q_num_heads=a["q_heads"].value,
                                kv_num_heads=a["kv_heads"].value)

        return fused


class LowerSwiGLUKernel(decompose.DecomposeSwiGLU):
    """SwiGLU as omforge's kernel: one read of gate_up, one write of the result (no Split copy)."""

    def rewrite(self, op, gate_up, **_):  # noqa: ANN001, ANN201
        return op.SwiGLU(gate_up, _domain=KERNEL_DOMAIN)


MOE_KERNEL = True
"""Whether :func:`lower` (``kernel=True``) sends ``omforge.MoE`` to the kernel library's expert op (runtime/ort/kernels/
moe*) when the library here runs it; the plain decomposition otherwise."""


def lower_moe_kernel(graph: ir.Graph, experts: ExpertOptions | None = None,
                     report: dict[str, dict[str, object]] | None = None, kernel: bool = True) -> int:
    """The neutral ``omforge.MoE`` nodes of ``graph`` as the kernel library's expert op in ``experts``' precision
    (:func:`omforge.passes.moe_kernel.lower_moe_to_kernel`: the stacked weights packed in that op's layout, a GGUF's
    blocks as they are) when :data:`MOE_KERNEL` is on and the library here runs it; returns how many. The rest take
    the plain decomposition with float32 weights (and all of them without ``kernel``). ``report`` gets one entry per
    MoE node (by the experts' torch name): op, bits, block, where each matrix came from, bytes — or why plain ops."""
    experts = experts or ExpertOptions()
    nodes = [n for n in graph if n.op_type == "MoE" and n.domain == ops.DOMAIN]
    if not nodes:
        return 0
    from omforge.passes import moe_kernel

    if not kernel:
        why: str | None = "the kernel lowering is off"
    elif not MOE_KERNEL:
        why = "disabled (passes/lower_ort.py MOE_KERNEL)"
    else:
        why = moe_kernel.kernel_runs(experts.precision)
    if why is not None:
        if report is not None:
            for node in nodes:
                report[moe_kernel.experts_name(node)] = {"bits": 32, "block": None, "op": "plain ops",
                                                         "source": f"float32 (plain ops: {why})"}
        return 0
    for node in nodes:
        moe_kernel.lower_moe_to_kernel(graph, node, experts.precision, group_size=experts.group_size,
                                       symmetric=experts.symmetric, blocks=experts.blocks, report=report)
    return len(nodes)


KV_WRITES = ("runtime", "graph")
KERNEL_OPS = {"float32": "PagedAttention", "bfloat16": "PagedAttentionBF16", "int8": "PagedAttentionInt8"}
_POOL_TYPES = {"float32": ir.DataType.FLOAT, "bfloat16": ir.DataType.BFLOAT16, "int8": ir.DataType.INT8}


def lower(model: ir.Model, kv_write: str = "graph", kernel: bool = False, kv_cache_dtype: str = "float32",
          lora_kernel: bool | None = None, experts: ExpertOptions | None = None,
          experts_report: dict[str, dict[str, object]] | None = None) -> int:
    """Lower every neutral op in ``model`` in place; returns the number of ops lowered. ``kv_write`` says who
    writes the new K/V rows of a step graph: the graph itself (default: ScatterND into the pool the executor
    binds in place) or the runtime (the graph returns the rows; attention sees them through a scatter into the
    gathered context; the graph write is the faster: benchmarks/RESULTS.md, "kv_write"). ``kernel`` (with
    ``kv_write="graph"``) lowers paged attention to omforge's CPU kernel instead of plain ops; the session must
    then register the kernel library (runtime/ort/kernels). ``kv_cache_dtype`` other than float32 (the pools'
    element type, see ``contract.KV_DTYPES``) needs the kernel. ``lora_kernel``: LoRA terms (``omforge.LoraAdd``)
    through the kernel library's ``LoraAdd`` (None: where the kernel lowering is used; False: plain ops, e.g. a library
    that predates the op). ``experts``: a mixture of experts' expert precision and blocks (:func:`lower_moe_kernel`,
    with the kernel), each MoE node's entry written to ``experts_report``."""
    if kv_write not in KV_WRITES:
        raise ValueError(f"kv_write={kv_write!r} is not one of {KV_WRITES}")
    if kernel and kv_write != "graph":
        raise ValueError("the kernel lowering writes the pools in the graph (kv_write='graph')")
    if kv_cache_dtype not in KERNEL_OPS:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not one of {tuple(KERNEL_OPS)}")
    if kv_cache_dtype != "float32" and not kernel:
        raise ValueError(f"a {kv_cache_dtype} KV cache needs the kernel lowering")
    model.opset_imports[""] = max(model.opset_imports.get("", 18), ORT_OPSET)
    paged = any(n.op_type == "PagedAttention" and n.domain == ops.DOMAIN for n in model.graph)
    # a decode group of its own (graph write): decodes share steps with prefill chunks, unpadded
    group = add_decode_group_inputs(model.graph) if kv_write == "graph" and paged else None
    # the kernel library serves step graphs (the experts a pooling step graph's too); a plain graph stays plain ops
    pooling = {v.name for v in model.graph.inputs} >= set(POOLING_INPUTS)
    moe_kernel = kernel and (group is not None or pooling)
    kernel = kernel and group is not None
    rules = pattern.RewriteRuleSet([
        LowerPagedAttention.rule("ort_paged_attention", "kernel" if kernel else kv_write, group, kv_cache_dtype),
        LowerAddRMSNormKernel.rule("ort_add_rms_norm_kernel") if kernel else LowerAddRMSNorm.rule("ort_add_rms_norm"),
        LowerRMSNorm.rule("ort_rms_norm"),
        LowerRotary.rule("ort_rotary"),
        LowerSwiGLUKernel.rule("ort_swiglu_kernel") if kernel else decompose.RULES["SwiGLU"],
        LowerAttention.rule("ort_attention"),
        decompose.RULES["MoE"],
    ])
    count = lower_moe_kernel(model.graph, experts, experts_report, moe_kernel)
    if kernel or count:
        model.opset_imports[KERNEL_DOMAIN] = 1
    count += rules.apply_to_model(model)
    if (kernel if lora_kernel is None else lora_kernel and kernel):
        model.opset_imports[KERNEL_DOMAIN] = 1
        count += lora.lower_kernel(model.graph)
    else:
        count += lora.lower_plain(model.graph)
    if kernel:  # after merging each layer's twin cos/sin slices (one Rotary lowering each for q and k)
        common.CommonSubexpressionEliminationPass()(model)
        count += packed_qkv.fuse(model.graph, tuple(KERNEL_OPS.values()))
    if kv_write == "runtime":
        new_rows_as_outputs(model.graph)  # the rows are outputs; slot_mapping is host-side only
    if kv_cache_dtype != "float32":
        _retype_pools(model.graph, kv_cache_dtype)
    ops.check_lowered(model, "ORT lowering")
    model.opset_imports.pop(ops.DOMAIN, None)
    return count


def _retype_pools(graph: ir.Graph, kv_cache_dtype: str) -> None:
    """The pools' inputs and outputs to ``kv_cache_dtype`` (int8 rows carry their scale: ``head_dim + 4``)."""
    for value in [*graph.inputs, *graph.outputs]:
        if re.fullmatch(r"(key|value)_cache(_out)?\.\d+", value.name or ""):
            if any(use.op_type not in KERNEL_OPS.values() for use, _ in value.uses()):
                raise ValueError(f"{value.name}: a {kv_cache_dtype} pool read by plain ops "
                                 "(head size without a kernel?)")
            *lead, head_dim = value.shape
            value.dtype = _POOL_TYPES[kv_cache_dtype]
            value.shape = ir.Shape([*lead, row_elems(head_dim, kv_cache_dtype)])
