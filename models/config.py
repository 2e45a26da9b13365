"""The Llama-family model configuration: one small dataclass read from config.json, GGUF metadata or a recipe.

Pure Python (no torch): the runtime reads it back from the export/bundle metadata.

Invariants: ``num_attention_heads % num_key_value_heads == 0`` (GQA groups are whole);
``head_dim`` is even (rotary pairs); ``rope_scaling`` is None or a dict whose ``rope_type`` is one of
:data:`ROPE_TYPES`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from omforge.errors import OmforgeError

FAMILIES = ("llama", "qwen2", "mistral")
ROPE_TYPES = ("default", "linear", "llama3")


class ConfigError(OmforgeError):
    """A model configuration that omforge cannot build; the message names the field."""


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder (Llama 2/3, SmolLM2, Qwen2, Mistral)."""

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ConfigError(f"family: '{self.family}' is not supported; supported: {', '.join(FAMILIES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be a positive integer (got {getattr(self, name)!r})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"num_key_value_heads: {self.num_key_value_heads} does not divide "
                              f"num_attention_heads ({self.num_attention_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim: must be even for rotary embeddings (got {self.head_dim})")
        if self.rope_scaling is not None and self.rope_scaling.get("rope_type") not in ROPE_TYPES:
            raise ConfigError(f"rope_scaling: type {self.rope_scaling.get('rope_type')!r} is not supported; "
                              f"supported: {', '.join(ROPE_TYPES)}")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from :meth:`to_dict` output or a recipe's ``model.config`` (unknown keys are an error)."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(f"{unknown[0]}: unknown model config key; allowed: {', '.join(sorted(names))}")
        d = dict(d)
        (d.setdefault("head_dim", d["hidden_size"] // d["num_attention_heads"])
         if {"hidden_size", "num_attention_heads"} <= d.keys() else None)
        if "eos_token_ids" in d:
            d["eos_token_ids"] = tuple(d["eos_token_ids"])
        try:
            return cls(**d)
        except TypeError as e:
            raise ConfigError(f"model config: {e}") from None

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Read a Hugging Face ``config.json`` (transformers 4.x ``rope_scaling`` or 5.x ``rope_parameters``)."""
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
        sliding = hf.get("sliding_window") if (family == "mistral" or hf.get("use_sliding_window")) else None
        return cls(
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
            qkv_bias=family == "qwen2" or bool(hf.get("attention_bias", False)),
            o_bias=family != "qwen2" and bool(hf.get("attention_bias", False)),
            sliding_window=sliding,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(eos if isinstance(eos, list) else ([eos] if eos is not None else [])),
        )
