"""Tiny mixtures of experts for the MoE tests: a random Qwen3-MoE (q/k norms, GQA, ``norm_topk_prob`` off) and a
random Mixtral (top-k always renormalized) made and saved by transformers, an HF directory written as a GGUF the way
llama.cpp's converter writes it, and the float64 reference of the neutral ``omforge.MoE`` op (passes/ops.py).

The GGUF writer follows llama.cpp's conversion/ (ggml-org/llama.cpp): base.py ``TextModel.set_gguf_parameters``
(``expert_count`` from ``num_local_experts``, ``expert_used_count``; ``ffn_gate_inp`` always F32), qwen.py
``Qwen2MoeModel`` (``expert_feed_forward_length``; per-expert ``gate_proj / up_proj / down_proj`` stacked into
``[E, F, H]`` / ``[E, H, F]``, q/k as they are), llama.py ``LlamaModel`` (Mixtral: ``w1 / w3 / w2`` stacked the same
way, q/k rows permuted). Quantized files are written as llama-quantize leaves them (``gguf.quants.quantize`` of each
layer matrix and expert stack; the router ``ffn_gate_inp`` kept F32)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from helpers import add_llama_hparams, llama_cpp_permute, make_tiny_tokenizer, write_gguf_tensors

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


def make_moe_hf_dir(path: Path, family: str, seed: int = 0, **overrides: Any) -> Path:
    """config.json + model.safetensors (save_pretrained: per-expert hub names) + the tests' tokenizer.json of a random
    ``family`` model of :data:`MOE_HF_CONFIGS`; norm weights perturbed from 1.0, routers rescaled to
    :data:`ROUTER_STD`; ``overrides``: config arguments replacing the family's."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(family, **{**MOE_HF_CONFIGS[family], **overrides})
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


GGUF_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
              "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp"}
GGUF_EXPERTS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}


def write_moe_gguf(hf_dir: Path, out: Path, quant: str) -> Path:
    """The HF directory as a GGUF of llama.cpp's ``qwen3moe`` (Qwen3-MoE) or ``llama`` with experts (Mixtral)
    architecture. The per-expert weights are read from the safetensors as the converter reads them (Mixtral's
    ``w1 / w3 / w2`` are gate / up / down) and stacked over experts; ``quant`` Q8_0 stores every layer matrix
    (the 3-D expert stacks included) in its blocks except the router, norms and embeddings stay F32."""
    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    mixtral = cfg["model_type"] == "mixtral"
    arch = "llama" if mixtral else "qwen3moe"
    w = gguf.GGUFWriter(out, arch)
    add_llama_hparams(w, cfg, cfg["rope_parameters"]["rope_theta"])
    w.add_expert_count(cfg["num_local_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if mixtral:
        w.add_vocab_size(cfg["vocab_size"])
        w.add_rope_dimension_count(cfg["hidden_size"] // cfg["num_attention_heads"])
    else:
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_token_list([f"<t{i}>" for i in range(cfg["vocab_size"])])
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    tensors: list[tuple[str, np.ndarray]] = []
    for name, arr in sorted(load_file(hf_dir / "model.safetensors").items()):
        arr = arr.astype(np.float32)
        name = re.sub(r"block_sparse_moe\.experts\.(\d+)\.w([123])",
                      lambda m: f"mlp.experts.{m[1]}.{ {'1': 'gate_proj', '3': 'up_proj', '2': 'down_proj'}[m[2]]}",
                      name.replace("block_sparse_moe.gate.", "mlp.gate."))
        if e := re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight", name):
            experts.setdefault((e[1], e[3]), {})[int(e[2])] = arr
            continue
        if mixtral and name.endswith(("q_proj.weight", "k_proj.weight")):
            arr = llama_cpp_permute(arr, heads if "q_proj" in name else kv_heads)
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.weight", name)
        tensors.append((f"blk.{m[1]}.{GGUF_LAYER[m[2]]}.weight" if m else top[name], arr))
    for (layer, proj), per_expert in sorted(experts.items()):
        tensors.append((f"blk.{layer}.{GGUF_EXPERTS[proj]}.weight", np.stack([per_expert[i] for i in
                                                                               range(len(per_expert))])))
    write_gguf_tensors(w, tensors, lambda name, arr: gguf.GGMLQuantizationType[quant] if quant != "F32" and
                       name.startswith("blk.") and arr.ndim >= 2 and "ffn_gate_inp" not in name else None)
    return out
