"""Tiny mixtures of experts for the MoE tests: a random Qwen3-MoE (q/k norms, GQA, ``norm_topk_prob`` off) and a
random Mixtral (top-k always renormalized) made and saved by transformers, and the float64 reference of the neutral
``omforge.MoE`` op (passes/ops.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from helpers import make_tiny_tokenizer

EXPERTS, TOP_K, FFN, HIDDEN, LAYERS = 4, 2, 32, 64, 2
_COMMON = dict(vocab_size=256, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
               num_experts_per_tok=TOP_K, initializer_range=0.1)
MOE_HF_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(_COMMON, head_dim=32, intermediate_size=128, moe_intermediate_size=FFN, num_experts=EXPERTS,
                      norm_topk_prob=False, tie_word_embeddings=True, rope_theta=1_000_000.0),
    "mixtral": dict(_COMMON, intermediate_size=FFN, num_local_experts=EXPERTS, tie_word_embeddings=False,
                    rope_theta=10_000.0),
}
"""Per family: transformers config arguments (Qwen3-MoE: head_dim 32 ≠ 64 / 4, tied embeddings, no top-k
renormalization; Mixtral: untied, always renormalized). Weights of std 0.1, not transformers' 0.02: at 0.02 the tied
Qwen3-MoE repeats its last prompt token whatever its experts say; at 0.1 zeroing the MoE blocks changes most greedy
tokens of either family."""
ROUTER_STD = 0.8
"""The routers' weights rescaled to this std: logits spread enough that no two experts tie within float32 rounding,
so every path picks the same experts (a near tie would flip on a last-bit difference)."""


def make_moe_hf_dir(path: Path, family: str, seed: int = 0) -> Path:
    """config.json + model.safetensors (save_pretrained: per-expert hub names) + the tests' tokenizer.json of a random
    ``family`` model of :data:`MOE_HF_CONFIGS`; norm weights perturbed from 1.0, routers rescaled to
    :data:`ROUTER_STD`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(family, **MOE_HF_CONFIGS[family])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    routers = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):  # transformers 5 names both families' routers so in memory
                p.mul_(ROUTER_STD / cfg.initializer_range)
                routers += 1
    assert routers == LAYERS, f"{family}: {routers} routers rescaled"
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    make_tiny_tokenizer(path / "tokenizer.json")
    return path


_MADE: dict[str, dict[str, Any]] = {}


def moe_export(family: str, tmp_path_factory: Any, block_size: int = 4) -> dict[str, Any]:
    """``{family, hf_dir, recipe, export, cache}``: :func:`make_moe_hf_dir`'s checkpoint, a recipe naming it (KV blocks
    of ``block_size``) and its export in the stage cache ``cache`` (which compile_bundle reuses); made once per test
    process (test_moe_graph.py and test_moe_engine.py share it)."""
    if family not in _MADE:
        from helpers import write_recipe
        from omforge.export.onnx_export import cached_export
        from omforge.recipe import load_recipe

        root = tmp_path_factory.mktemp(family)
        hf_dir = make_moe_hf_dir(root / "hf", family)
        recipe = write_recipe(root / "r.yaml", {"name": f"tiny-{family}", "source": "hf", "path": str(hf_dir),
                                                "family": family}, compile={"kv_block_size": block_size,
                                                                            "max_seq_len": 64})
        export = cached_export(load_recipe(recipe), root / "cache" / "exports", quiet=True)
        _MADE[family] = {"family": family, "hf_dir": hf_dir, "recipe": recipe, "export": export,
                         "cache": root / "cache"}
    return _MADE[family]


def moe_reference(x: np.ndarray, logits: np.ndarray, gate_up: np.ndarray, down: np.ndarray, top_k: int,
                  normalize: bool) -> np.ndarray:
    """``omforge.MoE`` in float64, token by token, only the chosen experts run (the contract, passes/ops.py): ties go
    to the lower expert index (a stable sort of the negated probabilities, as torch.topk)."""
    x64, l64 = x.astype(np.float64).reshape(-1, x.shape[-1]), logits.astype(np.float64).reshape(-1, logits.shape[-1])
    f = gate_up.shape[-1] // 2
    out = np.zeros_like(x64)
    for t in range(x64.shape[0]):
        p = np.exp(l64[t] - l64[t].max())
        p /= p.sum()
        chosen = np.argsort(-p, kind="stable")[:top_k]
        w = p[chosen] / p[chosen].sum() if normalize else p[chosen]
        for weight, e in zip(w, chosen):
            gu = x64[t] @ gate_up[e].astype(np.float64)
            gate, up = gu[:f], gu[f:]
            out[t] += weight * ((gate / (1 + np.exp(-gate)) * up) @ down[e].astype(np.float64))
    return out.reshape(x.shape)
