"""A plain torch definition of the Llama family (Llama 2/3, SmolLM2, Qwen2, Qwen3, Mistral) and its mixtures of
experts (Qwen3-MoE, Mixtral), written to export cleanly.

Only primitive tensor operations: no ``scaled_dot_product_attention``, no ``rms_norm``, so the
exported ONNX graph holds primitive ops and every fusion is left to ``omforge.passes``.
Parameter names follow Hugging Face's ``LlamaForCausalLM`` (and ``Qwen3ForCausalLM``'s ``self_attn.q_norm`` /
``k_norm``) so safetensors load without renaming.

Forward contract: ``input_ids [batch, seq]`` int64 and ``position_ids [batch, seq]`` int64 in,
``logits [batch, seq, vocab]`` float32 out; attention is causal over the ``seq`` axis (full recompute,
no KV cache; the paged-KV pass adds the cache to the exported graph).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from omforge.contract.manifest import ModelConfig


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Rotary inverse frequencies ``[head_dim // 2]`` (float32), with linear, Llama-3 or per-frequency scaling applied.

    The same float32 operations, in the same order, as transformers' ``_compute_default_rope_parameters`` /
    ``_compute_linear_scaling_rope_parameters`` / ``_compute_llama3_parameters``, so the constant baked into
    the export is bit-identical to the reference. ``freq_factors`` (a GGUF's ``rope_freqs.weight``) divides the
    default frequencies by the factors, as ggml's rope divides theta by ``freq_factors[i]`` (ggml-cpu/ops.cpp,
    ``ggml_rope_cache_init``): within a float32 rounding of ``llama3`` for factors the converter computed from it.
    """
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))
    s = cfg.rope_scaling or {}
    if s.get("rope_type") == "linear":
        inv = inv / s["factor"]
    elif s.get("rope_type") == "llama3":
        factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old_len = s["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    elif s.get("rope_type") == "freq_factors":
        inv = inv / torch.tensor(s["factors"], dtype=torch.float32)
    return inv


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` in the order transformers computes it."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * self.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:  # Qwen3: RMSNorm of each head's q and k over head_dim, before rotary
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.scale = self.head_dim ** -0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim)
        k = self.k_proj(x).view(b, s, self.kv_heads, self.head_dim)
        if self.qk_norm:  # on [b, s, heads, head_dim], as transformers' Qwen3Attention does
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        groups = self.heads // self.kv_heads
        if groups > 1:  # GQA: each KV head serves `groups` query heads
            k = (k[:, :, None].expand(b, self.kv_heads, groups, s, self.head_dim)
                 .reshape(b, self.heads, s, self.head_dim))
            v = (v[:, :, None].expand(b, self.kv_heads, groups, s, self.head_dim)
                 .reshape(b, self.heads, s, self.head_dim))
        scores = torch.matmul(q, k.transpose(2, 3)) * self.scale
        scores = scores.masked_fill(mask, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1)
        out = torch.matmul(probs, v).transpose(1, 2).reshape(b, s, self.heads * self.head_dim)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, width: int | None = None):
        super().__init__()
        width = width or cfg.intermediate_size
        self.gate_proj = nn.Linear(cfg.hidden_size, width, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, width, bias=False)
        self.down_proj = nn.Linear(width, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x)
        return self.down_proj(gate * torch.sigmoid(gate) * self.up_proj(x))


class SparseMoeBlock(nn.Module):
    """A mixture of experts (Qwen3-MoE, Mixtral), written densely: every expert runs on every token and the
    router's weights (zero for the experts not chosen) combine them. Parameter names: Qwen3-MoE's
    (``mlp.gate.weight [E, H]``, ``mlp.experts.<e>.{gate,up,down}_proj.weight``); export/weights.py renames
    Mixtral's and transformers 5's fused ones to these.

    The reference the passes fuse (passes/moe.py matches this graph): ``p = softmax(x @ Wr.T)``; ``(w, i) =
    top_k(p)``; ``w /= Σw`` when ``norm_topk_prob``; routing = ``scatter(zeros, i, w)`` ``[…, E]``;
    ``y = Σ_e routing[…, e] · expert_e(x)`` as ``ReduceSum(routing[…, None] · stack(expert_e(x), -2), -2)``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(cfg, cfg.moe_intermediate_size) for _ in range(cfg.num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        routing = torch.zeros_like(probs).scatter(-1, chosen, weights)
        outputs = torch.stack([expert(x) for expert in self.experts], dim=-2)
        return (routing.unsqueeze(-1) * outputs).sum(dim=-2)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoeBlock(cfg) if cfg.is_moe else MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Decoder-only transformer; ``state_dict`` keys match transformers' ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` /
    ``Qwen3ForCausalLM``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        freqs = position_ids.to(torch.float32)[:, :, None] * self.inv_freq[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [batch, 1, seq, head_dim]
        cos, sin = emb.cos(), emb.sin()
        idx = torch.arange(input_ids.shape[1], device=input_ids.device)
        mask = idx[None, :] > idx[:, None]  # True above the diagonal: a future token
        if self.config.sliding_window:  # and keys that fell out of the window (Mistral): i - j >= window
            mask = mask | ((idx[:, None] - idx[None, :]) >= self.config.sliding_window)
        for layer in self.model.layers:
            x = layer(x, cos, sin, mask)
        x = self.model.norm(x)
        if self.lm_head is None:
            return torch.matmul(x, self.model.embed_tokens.weight.t())
        return self.lm_head(x)
