"""Parameter counts of a model configuration: all of them, and those one token runs through.

Pure Python (no torch). Invariant: ``total`` is the number of elements of
:class:`omforge.models.llama.LlamaForCausalLM`'s parameters for the same config (a tied embedding counted once);
``active`` is ``total`` less, in every layer, the experts a token is not routed to (``num_experts -
num_experts_per_tok`` of them): the embeddings, attention, norms and routers count in full (the convention of
Qwen3-30B-A3B's "3.3B activated"). A dense model has ``active == total``.
"""

from __future__ import annotations

from typing import NamedTuple

from omforge.contract.manifest import ModelConfig


class ParameterCounts(NamedTuple):
    total: int
    active: int


def parameter_counts(cfg: ModelConfig) -> ParameterCounts:
    """Total and active-per-token parameter counts of ``cfg`` (see the module's invariant)."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    attention = 2 * h * q + 2 * h * kv + (q + 2 * kv if cfg.qkv_bias else 0) + (h if cfg.o_bias else 0) \
        + (2 * d if cfg.qk_norm else 0)
    layer = attention + 2 * h  # + the two RMSNorms
    if cfg.is_moe:
        expert = 3 * h * cfg.moe_intermediate_size
        layer += cfg.num_experts * h  # the router
        total_ffn, active_ffn = cfg.num_experts * expert, cfg.num_experts_per_tok * expert
    else:
        total_ffn = active_ffn = 3 * h * cfg.intermediate_size
    outside = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2) + h  # embeddings (+ lm_head), final norm
    layers = cfg.num_hidden_layers
    return ParameterCounts(outside + layers * (layer + total_ffn), outside + layers * (layer + active_ffn))


def readable(n: int) -> str:
    """``n`` in thousands, millions or billions: ``3.35 B``, ``135.0 M``, ``812.3 K``."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.{2 if unit == 'B' else 1}f} {unit}"
    return str(n)


def describe_counts(cfg: ModelConfig) -> str:
    """One line for ``omforge inspect``: the total, and for a mixture of experts the active count and its routing."""
    counts = parameter_counts(cfg)
    if not cfg.is_moe:
        return f"{readable(counts.total)} ({counts.total:,})"
    return (f"{readable(counts.total)} total ({counts.total:,}), {readable(counts.active)} active per token "
            f"({counts.active:,}): top {cfg.num_experts_per_tok} of {cfg.num_experts} experts "
            f"{cfg.moe_intermediate_size} wide in every layer"
            f"{', renormalized' if cfg.norm_topk_prob else ''}")
