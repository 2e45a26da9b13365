"""The LoRA tests' model and adapters: the tiny random llama (with a one-line chat template) compiled with or
without ``compile.lora``, and PEFT LoRA adapters of it with random A and B, saved as PEFT directories."""

from __future__ import annotations

from pathlib import Path

from helpers import compile_bundle, make_tiny_hf_dir, write_recipe

BASE = "tiny-lora"  # the recipe's model name: the served name
ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_model(root: Path) -> Path:
    """The tiny llama's Hugging Face directory under ``root`` (made once)."""
    hf = root / "hf"
    if not (hf / "config.json").is_file():
        make_tiny_hf_dir(hf, "llama")
        (hf / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    return hf


def make_peft_adapter(hf: Path, out: Path, seed: int, rank: int = 4,
                      targets: tuple[str, ...] = ALL_MODULES) -> Path:
    """A PEFT LoRA adapter of the model at ``hf`` with random A and B (``init_lora_weights=False``, scaled up so it
    changes the greedy tokens), ``lora_alpha = 2r``, saved to ``out``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets),
                                                  init_lora_weights=False))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.mul_(3.0)
    peft_model.save_pretrained(out)
    return out


def compile_lora_bundle(root: Path, name: str, lora: dict | None, max_seq_len: int = 64) -> Path:
    """The model compiled for ort with ``compile.lora: lora`` (None: without), 8 sequences, a ``max_seq_len``
    context, KV blocks of 16 tokens (prompts of a few blocks hit the prefix cache)."""
    make_model(root)
    compile_section: dict = {"max_seq_len": max_seq_len, "max_batch_size": 8, "max_num_tokens": 64,
                             "kv_block_size": 16}
    if lora is not None:
        compile_section["lora"] = lora
    recipe = write_recipe(root / f"{name}.yaml", {"name": BASE, "source": "hf", "path": "hf"},
                          compile=compile_section, serve={"max_num_seqs": 8})
    return compile_bundle(recipe, root / name, root / "cache")
