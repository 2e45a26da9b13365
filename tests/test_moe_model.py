"""Mixtures of experts, the model side (issue 62): tiny random Qwen3-MoE (q/k norms, GQA, ``norm_topk_prob`` off
and on) and Mixtral checkpoints written by transformers' ``save_pretrained`` load through omforge's loader into its
torch model and its unfused ONNX export with transformers' logits and greedy tokens; transformers 5's fused expert
tensors load as the same per-expert weights; GGUF files written as llama.cpp's converter writes them (F32, F16, BF16,
Q8_0, Q4_0) load to the same weights; bad configs are one-line errors; the parameter counts are the model's.

The GGUF writer (tests/moe_setup.py ``write_moe_gguf``) follows llama.cpp's converter.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from moe_setup import write_moe_gguf

from helpers import hf_reference, make_tiny_tokenizer, write_recipe
from omforge.contract.manifest import ConfigError, ModelConfig
from omforge.export.onnx_export import export_recipe
from omforge.export.weights import WeightsError, load_checkpoint, load_gguf, load_hf_dir
from omforge.models.config import from_hf
from omforge.models.llama import LlamaForCausalLM
from omforge.models.params import describe_counts, parameter_counts
from omforge.passes import quant as quant_lib
from omforge.recipe import load_recipe
from omforge.runtime.full_recompute import ExportedModel

E, K, F, H = 8, 2, 32, 64  # experts, top-k, expert width, hidden
COMMON = dict(vocab_size=256, hidden_size=H, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, bos_token_id=1, eos_token_id=2, num_experts_per_tok=K)
VARIANTS = {
    # Qwen3-MoE: head_dim 32 != 64 / 4, a dense intermediate_size that no layer uses, untied / tied embeddings
    "qwen3_moe": ("qwen3_moe", dict(COMMON, intermediate_size=96, moe_intermediate_size=F, num_experts=E,
                                    head_dim=32, rms_norm_eps=1e-6, rope_theta=1_000_000.0, norm_topk_prob=False)),
    "qwen3_moe_norm": ("qwen3_moe", dict(COMMON, intermediate_size=96, moe_intermediate_size=F, num_experts=E,
                                         head_dim=32, rms_norm_eps=1e-6, rope_theta=1_000_000.0, norm_topk_prob=True,
                                         tie_word_embeddings=True)),
    # Mixtral: Q/K rows permuted in its GGUF, a sliding window shorter than the tested sequences
    "mixtral": ("mixtral", dict(COMMON, intermediate_size=F, num_local_experts=E, rms_norm_eps=1e-5,
                                rope_theta=1_000_000.0, sliding_window=24)),
}
LOGITS_TOL = 1e-4
NEW = 8
PROMPTS = [[int(t) for t in np.random.default_rng(n).integers(3, 256, n)] for n in (5, 13, 30)]


def make_moe_dir(path: Path, variant: str, tokenizer: Path, seed: int = 0) -> Path:
    """config.json + model.safetensors (``save_pretrained``: per-expert names) + tokenizer.json of a random model.
    Norms perturbed from 1.0, the router at std 0.3 (decisive, uneven routing) and the experts at std 0.1, so that
    a wrong expert, weight or renormalization shows in the logits."""
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    family, config = VARIANTS[variant]
    cfg_cls, model_cls = (MixtralConfig, MixtralForCausalLM) if family == "mixtral" else \
        (Qwen3MoeConfig, Qwen3MoeForCausalLM)
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**config)).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.3)
            elif ".experts." in name:
                p.normal_(0.0, 0.1)
    path.mkdir(parents=True)
    model.save_pretrained(path, safe_serialization=True)
    shutil.copy(tokenizer, path / "tokenizer.json")
    return path


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Per variant: the HF directory, transformers' model loaded back from it (eager attention) and its greedy
    tokens for PROMPTS."""
    root = tmp_path_factory.mktemp("moe")
    tokenizer = make_tiny_tokenizer(root / "tokenizer.json")
    out = {}
    for variant in VARIANTS:
        hf_dir = make_moe_dir(root / variant, variant, tokenizer)
        hf = hf_reference(hf_dir)
        with torch.no_grad():
            tokens = [hf.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                                  pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
        out[variant] = {"dir": hf_dir, "hf": hf, "tokens": tokens}
    return out


def feeds(seed: int = 0, batch: int = 2, seq: int = 29) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(batch, seq), dtype=np.int64)


def torch_model(cfg: ModelConfig, tensors) -> LlamaForCausalLM:  # noqa: ANN001 - Mapping[str, np.ndarray]
    model = LlamaForCausalLM(cfg)
    model.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in tensors.items()}, strict=True)
    return model.eval()


def torch_logits(model: LlamaForCausalLM, ids: np.ndarray) -> np.ndarray:
    pos = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)
    with torch.no_grad():
        return model(torch.from_numpy(ids), pos).numpy()


def torch_greedy(model: LlamaForCausalLM, prompt: list[int]) -> list[int]:
    ids = list(prompt)
    for _ in range(NEW):
        ids.append(int(torch_logits(model, np.array([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def hf_logits(moe: dict, variant: str, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return moe[variant]["hf"](torch.from_numpy(ids)).logits.numpy()


# --- (a) the HF directory through our loader into our torch model ------------------------------------------------

@pytest.mark.parametrize("variant", list(VARIANTS))
def test_torch_model_from_the_hf_directory_is_transformers(moe: dict, variant: str) -> None:
    """Config read from config.json, per-expert weights (Mixtral's ``block_sparse_moe.*.w1/w3/w2`` renamed), logits
    within LOGITS_TOL and identical greedy tokens; the other ``norm_topk_prob`` is far off (the check can fail)."""
    hf_dir = moe[variant]["dir"]
    family, config = VARIANTS[variant]
    from safetensors import safe_open

    with safe_open(hf_dir / "model.safetensors", "np") as f:
        stored = set(f.keys())
    assert ("model.layers.1.block_sparse_moe.experts.7.w3.weight" in stored) == (family == "mixtral")
    ckpt = load_hf_dir(hf_dir)
    cfg = ckpt.config
    assert (cfg.family, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (family, E, K, F)
    assert cfg.norm_topk_prob == config.get("norm_topk_prob", True) and cfg.qk_norm == (family == "qwen3_moe")
    assert cfg.intermediate_size == config["intermediate_size"] and cfg.sliding_window == config.get("sliding_window")
    assert cfg.tie_word_embeddings == config.get("tie_word_embeddings", False)
    assert ckpt.tensors.shapes["model.layers.1.mlp.gate.weight"] == (E, H)
    assert ckpt.tensors.shapes["model.layers.1.mlp.experts.7.down_proj.weight"] == (H, F)

    ours, ids = torch_model(cfg, ckpt.tensors), feeds()
    ref = hf_logits(moe, variant, ids)
    drift = float(np.abs(torch_logits(ours, ids) - ref).max())
    assert drift <= LOGITS_TOL, drift
    assert [torch_greedy(ours, p) for p in PROMPTS] == moe[variant]["tokens"]

    other = torch_model(replace(cfg, norm_topk_prob=not cfg.norm_topk_prob), ckpt.tensors)
    assert float(np.abs(torch_logits(other, ids) - ref).max()) > 100 * LOGITS_TOL


@pytest.mark.parametrize("variant", ["qwen3_moe", "mixtral"])
def test_fused_expert_tensors_load_as_the_per_expert_weights(moe: dict, variant: str, tmp_path: Path) -> None:
    """transformers 5's in-memory state (``mlp.experts.gate_up_proj [E, 2F, H]``, ``down_proj [E, H, F]``, the
    router as ``mlp.gate.weight``) saved as it is, in bf16: the loader slices each expert out of the fused tensors
    and gives exactly the per-expert directory's weights (in bf16)."""
    from safetensors.torch import save_file

    state = moe[variant]["hf"].state_dict()
    assert tuple(state["model.layers.0.mlp.experts.gate_up_proj"].shape) == (E, 2 * F, H)
    fused = tmp_path / "fused"
    fused.mkdir()
    shutil.copy(moe[variant]["dir"] / "config.json", fused / "config.json")
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in state.items()}, fused / "model.safetensors")
    got, want = load_hf_dir(fused), load_hf_dir(moe[variant]["dir"])
    assert got.config == want.config and set(got.tensors) == set(want.tensors)
    assert got.tensors.shapes == want.tensors.shapes
    for name in want.tensors:
        expect = torch.from_numpy(want.tensors[name]).to(torch.bfloat16).float().numpy()
        assert np.array_equal(got.tensors[name], expect), name


# --- (b) the unfused ONNX export in onnxruntime -----------------------------------------------------------------

@pytest.mark.parametrize("variant", ["qwen3_moe", "mixtral"])
def test_the_export_runs_transformers_logits_and_tokens(moe: dict, variant: str, tmp_path: Path) -> None:
    """``export_recipe`` of a recipe naming the HF directory: the plain graph (TopK, ScatterElements, every expert
    on every token) in onnxruntime gives transformers' logits and greedy tokens."""
    recipe = write_recipe(tmp_path / "r.yaml", {"name": f"tiny-{variant}", "source": "hf",
                                                "path": str(moe[variant]["dir"]), "family": VARIANTS[variant][0]})
    meta = export_recipe(load_recipe(recipe), tmp_path / "export", quiet=True)
    assert meta["config"]["num_experts"] == E and meta["op_histogram"]["TopK"] == 2
    exported = ExportedModel(tmp_path / "export")
    ids = feeds(1)
    drift = float(np.abs(exported.logits(ids) - hf_logits(moe, variant, ids)).max())
    assert drift <= LOGITS_TOL, drift
    assert [exported.greedy(p, NEW, ignore_eos=True).token_ids for p in PROMPTS] == moe[variant]["tokens"]


# --- (c) GGUF as llama.cpp's converter writes it ------------------------------------------------------------------

@pytest.mark.parametrize("quant", ["F32", "F16", "BF16", "Q8_0", "Q4_0"])
@pytest.mark.parametrize("variant", ["qwen3_moe_norm", "mixtral"])
def test_gguf_loads_the_same_weights(moe: dict, variant: str, quant: str, tmp_path: Path) -> None:
    """The GGUF's config is the HF directory's (llama.cpp always renormalizes the top-k: ``norm_topk_prob``; a
    ``llama`` GGUF has no sliding window key, as llama.cpp's llama graph has no window); its 3-D expert stacks split
    into the per-expert weights: F32 exactly the HF weights (and, with the HF config's window, transformers' greedy
    tokens through our torch model), the other types exactly ``gguf``'s own dequantization of the stored values;
    Q8_0 / Q4_0 blocks are also kept per expert, as passes/quant.py reads them (``from_gguf``: lossless)."""
    path = write_moe_gguf(moe[variant]["dir"], tmp_path / f"{variant}.gguf", quant)
    ckpt, want = load_gguf(path), load_hf_dir(moe[variant]["dir"])
    reader = gguf.GGUFReader(path)
    kinds = {t.name: t.tensor_type.name for t in reader.tensors}
    assert kinds["blk.1.ffn_down_exps.weight"] == quant and kinds["blk.1.ffn_gate_inp.weight"] == "F32"
    window = want.config.sliding_window
    assert ckpt.config == replace(want.config, rms_norm_eps=float(np.float32(want.config.rms_norm_eps)),  # GGUF: f32
                                  sliding_window=None)
    assert set(ckpt.tensors) == set(want.tensors)
    qtype = gguf.GGMLQuantizationType[quant]
    for name in want.tensors:
        got, hf = ckpt.tensors[name], want.tensors[name]
        assert got.dtype == np.float32 and got.shape == hf.shape, name
        stored = quant != "F32" and name.startswith("model.layers.") and hf.ndim == 2 and \
            not name.endswith("mlp.gate.weight")  # in the file as ``quant`` (write_moe_gguf)
        if not stored:
            assert name not in ckpt.blocks and np.array_equal(got, hf), name
            continue
        assert np.array_equal(got, gguf.quants.dequantize(gguf.quants.quantize(hf, qtype), qtype)), name
        assert not np.array_equal(got, hf), name
        if quant not in ("Q8_0", "Q4_0"):
            assert name not in ckpt.blocks, name
            continue
        kind, raw, k = ckpt.blocks[name]
        assert kind == quant and k == hf.shape[1] and raw.shape[0] == hf.shape[0], name
        assert np.array_equal(got, gguf.quants.dequantize(raw, qtype).reshape(hf.shape)), name
        assert np.array_equal(quant_lib.dequantize(quant_lib.from_gguf(kind, raw, k)), got), name
    assert len([n for n in ckpt.blocks if ".experts." in n]) == (2 * 3 * E if quant in ("Q8_0", "Q4_0") else 0)
    if quant == "F32":
        ours = torch_model(replace(ckpt.config, sliding_window=window), ckpt.tensors)
        assert [torch_greedy(ours, p) for p in PROMPTS] == moe[variant]["tokens"]


# --- (d) what is refused, in one line ----------------------------------------------------------------------------

QWEN3_MOE_HF = {"model_type": "qwen3_moe", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
                "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2}


@pytest.mark.parametrize(("edit", "message"), [
    ({"decoder_sparse_step": 2}, r"decoder_sparse_step: 2 is not supported \(every layer must be a mixture of "
                                 r"experts: 1\)"),
    ({"mlp_only_layers": [1]}, r"mlp_only_layers: dense layers \[1\] between the mixtures of experts are not "
                               r"supported \(every layer must be one\)"),
    ({"shared_expert_intermediate_size": 64}, r"shared_expert_intermediate_size: a shared expert \(64\) is not "
                                              r"supported"),
    ({"num_experts_per_tok": 9}, r"num_experts_per_tok: must be between 1 and num_experts \(8\), got 9"),
    ({"num_experts": 1}, r"num_experts: a mixture of experts needs at least 2 \(got 1\)"),
], ids=["sparse_step", "mlp_only_layers", "shared_expert", "top_k", "one_expert"])
def test_bad_hf_configs_are_one_line_errors(edit: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{message}$"):
        from_hf({**QWEN3_MOE_HF, **edit})


def test_hf_config_reading() -> None:
    """Hub Qwen3-MoE says ``num_experts``, transformers 5 ``num_local_experts``; Mixtral's ``sliding_window`` is
    read as Mistral's; ``decoder_sparse_step`` 1 and empty ``mlp_only_layers`` are the supported defaults."""
    hub = from_hf({**QWEN3_MOE_HF, "decoder_sparse_step": 1, "mlp_only_layers": []})
    local = from_hf({**{k: v for k, v in QWEN3_MOE_HF.items() if k != "num_experts"}, "num_local_experts": 8})
    assert hub == local and hub.num_experts == 8 and not hub.norm_topk_prob
    mixtral = from_hf({**QWEN3_MOE_HF, "model_type": "mixtral", "num_local_experts": 8, "sliding_window": 24,
                       "router_jitter_noise": 0.1})
    assert (mixtral.moe_intermediate_size, mixtral.norm_topk_prob, mixtral.sliding_window) == (96, True, 24)


def test_bad_checkpoints_name_the_file_and_the_tensor(moe: dict, tmp_path: Path) -> None:
    hf_dir = Path(shutil.copytree(moe["qwen3_moe"]["dir"], tmp_path / "hf"))
    config = hf_dir / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "mlp_only_layers": [0]}))
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(config))}: mlp_only_layers: dense layers \[0\]"):
        load_hf_dir(hf_dir)
    config.write_text(json.dumps({**json.loads(config.read_text()), "mlp_only_layers": [],
                                  "num_local_experts": 9}))  # a ninth expert the file does not hold
    recipe = write_recipe(tmp_path / "r.yaml", {"name": "t", "source": "hf", "path": str(hf_dir)})
    with pytest.raises(WeightsError, match=rf"^{re.escape(str(hf_dir))}: tensor 'model\.layers\.0\.mlp\.experts\.8\."
                                           r"down_proj\.weight' is missing \(6 missing in all\)$"):
        load_checkpoint(load_recipe(recipe))


@pytest.mark.parametrize(("metadata", "message"), [
    (lambda w: None, r"qwen3moe\.expert_count: missing or 0 \(a qwen3moe file is a mixture of experts\)"),
    (lambda w: (w.add_expert_count(8), w.add_expert_used_count(2), w.add_expert_shared_count(1)),
     r"qwen3moe\.expert_shared_count: a shared expert \(1\) is not supported"),
    (lambda w: (w.add_expert_count(8), w.add_expert_used_count(2), w.add_expert_weights_scale(2.5)),
     r"qwen3moe\.expert_weights_scale: 2\.5 is not supported \(the routing weights unscaled: 1\)"),
], ids=["no_experts", "shared_expert", "weights_scale"])
def test_bad_gguf_metadata_is_one_line_errors(tmp_path: Path, metadata, message: str) -> None:  # noqa: ANN001
    path = tmp_path / "bad.gguf"
    w = gguf.GGUFWriter(path, "qwen3moe")
    for add, value in ((w.add_block_count, 1), (w.add_embedding_length, 64), (w.add_feed_forward_length, 96),
                       (w.add_head_count, 4), (w.add_vocab_size, 256)):
        add(value)
    metadata(w)
    w.add_tensor("token_embd.weight", np.zeros((256, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: {message}$"):
        load_gguf(path)


# --- parameter counts (omforge inspect) --------------------------------------------------------------------------

@pytest.mark.parametrize("variant", [*VARIANTS, "dense"])
def test_parameter_counts_are_the_models(variant: str) -> None:
    """Total: the torch model's parameters (transformers' count too); active: less the unrouted experts."""
    if variant == "dense":
        cfg = ModelConfig(family="qwen3", vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True)
    else:
        cfg = from_hf({"model_type": VARIANTS[variant][0], **VARIANTS[variant][1]})
    with torch.device("meta"):
        total = sum(p.numel() for p in LlamaForCausalLM(cfg).parameters())
    counts = parameter_counts(cfg)
    assert counts.total == total
    unrouted = cfg.num_hidden_layers * (E - K) * 3 * H * F if cfg.is_moe else 0
    assert counts.active == total - unrouted


def test_qwen3_30b_a3b_counts_are_its_model_cards() -> None:
    """Qwen3-30B-A3B's config.json (hub); its model card: "30.5B in total and 3.3B activated", "Number of
    Parameters (Non-Embedding): 29.9B" (the card's figures cut to one decimal)."""
    cfg = from_hf({"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
                   "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
                   "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
                   "norm_topk_prob": True, "tie_word_embeddings": False, "decoder_sparse_step": 1,
                   "mlp_only_layers": []})
    counts = parameter_counts(cfg)
    assert (counts.total // 10**8, counts.active // 10**8) == (305, 33)
    assert (counts.total - 2 * 151936 * 2048) // 10**8 == 299
    assert describe_counts(cfg).startswith("30.53 B total (30,532,122,624), 3.35 B active per token")
    assert describe_counts(cfg).endswith("top 8 of 128 experts 768 wide in every layer, renormalized")
