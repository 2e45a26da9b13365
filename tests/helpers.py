"""Test helpers: tiny Hugging Face checkpoints made with transformers, a small real BPE tokenizer, recipes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
SMOLLM2_RECIPE = REPO / "models" / "smollm2-135m.yaml"
TINY_RECIPE = REPO / "tests" / "recipes" / "tiny-llama.yaml"

# Tiny configs, one per family variant the acceptance names. Values keep every code path live:
# GQA (4 heads / 2 KV heads), untied and tied embeddings, q/k/v bias, llama3 rope scaling whose
# bands fall inside the tested positions.
TINY_HF_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(model_type="llama", tie_word_embeddings=False, rope_theta=10000.0),
    "llama3": dict(model_type="llama", tie_word_embeddings=True, rope_theta=500000.0,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=True, rope_theta=1000000.0),
    "mistral": dict(model_type="mistral", tie_word_embeddings=False, rope_theta=10000.0, sliding_window=4096),
}


def make_tiny_tokenizer(path: Path) -> Path:
    """Train a real byte-level BPE tokenizer (vocab 256) on a few sentences and save tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=256, special_tokens=["<|endoftext|>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["the quick brown fox jumps over the lazy dog", "hello world, this is omforge",
              "a compiler and server for large language models"] * 20
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(path))
    return path


def make_tiny_hf_dir(path: Path, variant: str, seed: int = 0, shard: bool = False) -> Path:
    """A Hugging Face directory (config.json + safetensors + tokenizer.json) for a tiny random model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(TINY_HF_CONFIGS[variant])
    model_type = spec.pop("model_type")
    cfg = AutoConfig.for_model(model_type, vocab_size=256, hidden_size=64, intermediate_size=128,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
                               **spec)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # norms start at 1.0; perturb them so a dropped norm weight shows in the logits
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True, max_shard_size="100KB" if shard else "5GB")
    make_tiny_tokenizer(path / "tokenizer.json")
    return path


def write_recipe(path: Path, model: dict[str, Any], **sections: Any) -> Path:
    path.write_text(yaml.safe_dump({"model": model, **sections}))
    return path


def hf_reference(path: Path):  # noqa: ANN201 - transformers model
    """The transformers reference for a directory, eager attention (the same matmul/softmax order as ours)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return model.eval()
