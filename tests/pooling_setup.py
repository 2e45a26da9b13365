"""The pooling tests' model: a tiny random Qwen3 saved as a Hugging Face directory (transformers writes it), with
the tests' small BPE tokenizer, compiled as an embed, a score and a generate bundle that share one export."""

from __future__ import annotations

from pathlib import Path

from helpers import compile_bundle, make_tiny_tokenizer, write_recipe

EOS = 0  # the tiny tokenizer's <|endoftext|>, Qwen3-Embedding's appended token
YES, NO = 9, 7  # any two ids of the 256: the score bundle's [no, yes]


def make_tiny_qwen3(path: Path, seed: int = 0) -> Path:
    """Config.json + safetensors of a 2-layer Qwen3 (GQA 4/2 heads, head_dim 32 ≠ 64 / 4, tied embeddings, norms
    perturbed so that a dropped one shows) and tokenizer.json."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("qwen3", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                               rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True, bos_token_id=None,
                               eos_token_id=EOS)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    make_tiny_tokenizer(path / "tokenizer.json")
    return path


def compile_pooling(root: Path, task: str, max_seq_len: int = 128, **pooling: object) -> Path:
    """The tiny model (made once under ``root``) compiled for ``task`` with ``pooling`` settings; every bundle
    uses the same model section, so the export is made once (the stage cache under ``root``)."""
    hf = root / "hf"
    if not (hf / "config.json").is_file():
        make_tiny_qwen3(hf)
    name = f"{task}-{'-'.join(f'{k}{v}' for k, v in sorted(pooling.items())) or 'default'}"
    sections: dict = {"compile": {"max_seq_len": max_seq_len}, "serve": {"max_num_seqs": 16}}
    if task != "generate":
        sections |= {"task": task, "pooling": dict(pooling)}
    recipe = write_recipe(root / f"{name}.yaml", {"name": "tiny-qwen3-pool", "source": "hf", "path": "hf"},
                          **sections)
    return compile_bundle(recipe, root / name, root / "cache")
