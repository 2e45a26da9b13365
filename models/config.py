"""Reading a Llama-family (Llama, Qwen2, Qwen3, Mistral; the mixtures of experts Qwen3-MoE and Mixtral) model's
configuration (contract/manifest.py's :class:`ModelConfig`) from a Hugging Face ``config.json`` or a recipe's
``model.config``; export/weights.py reads GGUF metadata into the same type.

Pure Python (no torch).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from omforge.contract.manifest import FAMILIES, MOE_FAMILIES, ConfigError, ModelConfig


def from_recipe(d: dict[str, Any]) -> ModelConfig:
    """A recipe's ``model.config`` (family included; ``head_dim`` defaults to ``hidden_size //
    num_attention_heads``). Unknown keys are an error listing the allowed ones."""
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ConfigError(f"{unknown[0]}: unknown model config key; allowed: {', '.join(sorted(names))}")
    d = dict(d)
    if {"hidden_size", "num_attention_heads"} <= d.keys():
        d.setdefault("head_dim", d["hidden_size"] // d["num_attention_heads"])
    if "eos_token_ids" in d:
        d["eos_token_ids"] = tuple(d["eos_token_ids"])
    try:
        return ModelConfig(**d)
    except TypeError as e:
        raise ConfigError(f"model config: {e}") from None


def from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Read a Hugging Face ``config.json`` (transformers 4.x ``rope_scaling`` or 5.x ``rope_parameters``); a mixture
    of experts' fields by :func:`_experts`."""
    family = hf.get("model_type", "llama")
    if family not in FAMILIES:
        raise ConfigError(f"model_type: '{family}' is not a supported family; supported: {', '.join(FAMILIES)}")
    if hf.get("mlp_bias"):
        raise ConfigError("mlp_bias: biased MLP projections are not supported")
    rope = dict(hf.get("rope_parameters") or {})
    theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    scaling = rope or dict(hf.get("rope_scaling") or {})
    if scaling:
        scaling["rope_type"] = scaling.pop("type", None) or scaling.get("rope_type", "default")
        if scaling["rope_type"] == "default":
            scaling = {}
    heads = hf["num_attention_heads"]
    eos = hf.get("eos_token_id")
    sliding = hf.get("sliding_window") if (family in ("mistral", "mixtral") or hf.get("use_sliding_window")) \
        else None
    return ModelConfig(
        family=family,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_hidden_layers=hf["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling or None,
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=family == "qwen2" or bool(hf.get("attention_bias", False)),  # Qwen3: attention_bias (false)
        o_bias=family != "qwen2" and bool(hf.get("attention_bias", False)),
        sliding_window=sliding,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=tuple(eos if isinstance(eos, list) else ([eos] if eos is not None else [])),
        **(_experts(hf, family) if family in MOE_FAMILIES else {}),
    )


def _experts(hf: dict[str, Any], family: str) -> dict[str, Any]:
    """The MoE fields of a ``qwen3_moe`` / ``mixtral`` config.json. The expert count is ``num_experts`` (hub
    Qwen3-MoE) or ``num_local_experts`` (Mixtral; transformers 5 writes it for both); transformers' defaults where a
    key is absent; Mixtral's experts are ``intermediate_size`` wide and always renormalize the top-k. Refused in one
    line: dense layers between the sparse ones (``decoder_sparse_step`` != 1, ``mlp_only_layers``) and a shared
    expert (``shared_expert_intermediate_size``, Qwen2-MoE's). Mixtral's ``router_jitter_noise`` is training only."""
    if (step := hf.get("decoder_sparse_step", 1)) != 1:
        raise ConfigError(f"decoder_sparse_step: {step} is not supported (every layer must be a mixture of experts: 1)")
    if hf.get("mlp_only_layers"):
        raise ConfigError(f"mlp_only_layers: dense layers {hf['mlp_only_layers']} between the mixtures of experts "
                          "are not supported (every layer must be one)")
    if hf.get("shared_expert_intermediate_size"):
        raise ConfigError(f"shared_expert_intermediate_size: a shared expert "
                          f"({hf['shared_expert_intermediate_size']}) is not supported")
    mixtral = family == "mixtral"
    experts = hf.get("num_experts") or hf.get("num_local_experts") or (8 if mixtral else 128)  # transformers' defaults
    return {"num_experts": experts, "num_experts_per_tok": hf.get("num_experts_per_tok", 2 if mixtral else 8),
            "moe_intermediate_size": hf["intermediate_size"] if mixtral else hf.get("moe_intermediate_size", 768),
            "norm_topk_prob": mixtral or bool(hf.get("norm_topk_prob", False))}
