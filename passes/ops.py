"""The neutral fused ops the fusions produce, in domain ``omforge`` (version 1), before lowering to a target.

Each op is a contract: its semantics below, a plain-op decomposition in :mod:`omforge.passes.decompose`
(the fallback any target can run), and per-target lowerings in ``lower_ort`` / ``lower_ascend``.

  RMSNorm(x, weight; epsilon) -> y                          y = weight * x / sqrt(mean(x², -1) + eps)
  AddRMSNorm(x, residual, weight; epsilon) -> (y, sum)      sum = x + residual; y = RMSNorm(sum)
  Rotary(x, cos, sin) -> y        x [B, H, S, D], cos/sin [B, 1, S, D]: y = x·cos + rotate_half(x)·sin;
                                  cos/sin repeat their halves (cat(c, c), as RoPE builds them): kernels that
                                  take a [.., D/2] cache (ORT RotaryEmbedding, CANN) rely on it
  SwiGLU(gate_up) -> y            gate_up [..., 2F]: y = silu(gate_up[..., :F]) · gate_up[..., F:]
  Attention(q, k, v; scale, q_heads, kv_heads[, window]) -> o
                                  q [B, Hq, S, D], k/v [B, Hkv, S, D], causal over S, GQA by head groups;
                                  ``window`` W > 0 (sliding window): key j visible to query i iff i - W < j <= i
  PagedAttention(q, k, v, key_cache, value_cache, slot_mapping, block_tables, query_index, token_index,
                 position_ids; scale, q_heads, kv_heads, block_size, fused_attention[, window])
                 -> (o, key_cache_out, value_cache_out)
                                  see :mod:`omforge.passes.paged_kv` and the step ABI in docs/compile.md
  MoE(x, router_logits, gate_up_weight, down_weight; top_k, normalize) -> y
                                  x [..., H]; router_logits [..., E] (the router MatMul stays outside the op);
                                  gate_up_weight [E, H, 2F] (each expert's gate columns, then its up columns),
                                  down_weight [E, F, H]; p = softmax(router_logits) (float32); (w, i) = top_k(p)
                                  (ties: the lower expert first); normalize 1: w /= Σ w;
                                  y[t] = Σ_j w[t, j] · SwiGLU(x[t] @ gate_up_weight[i[t, j]]) @ down_weight[i[t, j]];
                                  see :mod:`omforge.passes.moe`
  LoraAdd(y, x, lora_a, lora_b, lora_slots) -> y'
                                  y [..., out], x [..., in], lora_a [S, P·R, in], lora_b [S, out, P·R], lora_slots
                                  [1, T] int64: y'[t] = y[t] + lora_b[slot_t] · (lora_a[slot_t] · x[t]); see
                                  :mod:`omforge.passes.lora` and docs/lora.md
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import onnx_ir as ir

DOMAIN = "omforge"
VERSION = 1


def neutral_ops(model: ir.Model) -> list[str]:
    """The op types of domain :data:`DOMAIN` still in ``model``'s graph (none after a lowering)."""
    return sorted({n.op_type for n in model.graph if n.domain == DOMAIN})


def check_lowered(model: ir.Model, who: str) -> None:
    """The lowering's postcondition: no neutral op left (each has a target form or a plain decomposition)."""
    left = neutral_ops(model)
    if left:
        raise RuntimeError(f"{who} left neutral ops: {left}")
