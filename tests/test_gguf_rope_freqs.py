"""A Llama 3 GGUF (``rope_freqs.weight``: the llama3 rope scaling as per-frequency factors) imports, compiles and
generates what transformers generates from the Hugging Face checkpoint it was converted from.

The GGUF is written here the way llama.cpp's converter writes one (F32 outtype): its metadata keys, Q/K rows
permuted, no ``lm_head`` for tied embeddings, and ``rope_freqs.weight`` computed by :func:`llama3_rope_factors`, a
copy of the converter's code. Source: llama.cpp as vendored in llama-cpp-python 0.3.36 (sdist),
vendor/llama.cpp/conversion/llama.py: ``LlamaModel.set_gguf_parameters`` (vocab_size, rope dimension count),
``LlamaModel.permute``, ``LlamaModel.generate_extra_tensors`` (the factors); conversion/base.py writes no
``rope.scaling.*`` key for ``rope_type: llama3`` ("Handled in generate_extra_tensors").
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import onnxruntime as ort
import pytest
import torch
from safetensors.numpy import load_file

from helpers import compile_bundle, hf_reference, make_tiny_hf_dir, write_recipe
from omforge.contract.manifest import ConfigError, ModelConfig, load_manifest
from omforge.export.onnx_export import export_recipe
from omforge.export.weights import load_checkpoint, load_gguf, load_hf_dir
from omforge.models.llama import rope_inv_freq
from omforge.recipe import load_recipe
from omforge.runtime.llm import LLM
from omforge.runtime.sampling_params import SamplingParams

LOGITS_TOL = 1e-5
"""Max abs logit difference, ONNX export of the GGUF vs transformers on the HF directory (seen: 3.6e-7; ignoring
rope_freqs gives 3.5e-3)."""
INV_FREQ_RTOL = 1e-6
"""Relative difference allowed between ``inv / factor`` (ggml's order) and transformers' llama3 float32 expression:
the factors are rounded to float32 and divided, transformers multiplies and adds; a few float32 ulps (≈ 6e-8)."""

GGUF_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}


def llama3_rope_factors(rope: dict, dim: int) -> torch.Tensor:
    """llama.cpp's ``LlamaModel.generate_extra_tensors`` (conversion/llama.py), line for line: the
    ``rope_freqs`` tensor it writes for ``rope_type: llama3`` (``rope``: the converter's ``rope_parameters``)."""
    base = rope.get("rope_theta", 10000.0)
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = rope.get("factor", 8.0)
    low_freq_factor = rope.get("low_freq_factor", 1.0)
    high_freq_factor = rope.get("high_freq_factor", 4.0)
    old_context_len = rope.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    rope_factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            rope_factors.append(1)
        elif wavelen > low_freq_wavelen:
            rope_factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            rope_factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(rope_factors, dtype=torch.float32)


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """``LlamaModel.permute`` (conversion/llama.py) on q_proj / k_proj."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf in fixed:
        return fixed[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{GGUF_LAYER[module]}.{kind}"


def convert_to_gguf(hf_dir: Path, path: Path, rope_freqs: np.ndarray | None = None) -> Path:
    """The F32 GGUF llama.cpp's converter writes for a Llama-3-style HF directory; ``rope_freqs`` replaces the
    factors it computes (for the malformed-file tests)."""
    cfg = load_hf_dir(hf_dir).config
    hf = json.loads((hf_dir / "config.json").read_text())
    w = gguf.GGUFWriter(path, "llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_ids[0])
    tensors = load_file(hf_dir / "model.safetensors")
    for name, arr in sorted(tensors.items()):
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            arr = permute(arr, cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads)
        w.add_tensor(gguf_name(name), np.ascontiguousarray(arr, dtype=np.float32))
    if rope_freqs is None:
        # conversion/base.py (TextModel.__init__): rope_parameters, else rope_scaling, with rope_theta mirrored in
        rope = {"rope_theta": hf.get("rope_theta"), **(hf.get("rope_parameters") or hf["rope_scaling"])}
        rope_freqs = llama3_rope_factors(rope, cfg.head_dim).numpy()
    w.add_tensor("rope_freqs.weight", rope_freqs)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def llama3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(HF dir, GGUF converted from it, recipe ``source: gguf`` with the HF dir's tokenizer)."""
    root = tmp_path_factory.mktemp("gguf-llama3")
    hf_dir = make_tiny_hf_dir(root / "hf", "llama3")  # factor 8, low 1, high 4, original context 64
    path = convert_to_gguf(hf_dir, root / "tiny-llama3.gguf")
    recipe = write_recipe(root / "recipe.yaml", {"name": "tiny-llama3-gguf", "source": "gguf",
                                                 "path": "tiny-llama3.gguf", "family": "llama",
                                                 "tokenizer": "hf/tokenizer.json"},
                          compile={"max_seq_len": 256})
    return hf_dir, path, recipe


def test_rope_freqs_read_as_factors(llama3: tuple[Path, Path, Path]) -> None:
    hf_dir, path, _ = llama3
    hf_cfg, ckpt = load_hf_dir(hf_dir).config, load_gguf(path)
    s = ckpt.config.rope_scaling
    assert s is not None and s["rope_type"] == "freq_factors" and len(s["factors"]) == hf_cfg.head_dim // 2
    # the tiny config's frequencies fall in all three llama3 bands: kept (1), smoothed, divided by 8
    assert s["factors"][0] == 1.0 and 1.0 < s["factors"][1] < 8.0 and s["factors"][2:] == [8.0] * 6
    assert "rope_freqs.weight" not in ckpt.tensors  # not a parameter
    for name, arr in load_hf_dir(hf_dir).tensors.items():
        assert np.array_equal(ckpt.tensors[name], arr), name
    # everything else in the config is the HF one (GGUF keeps rms_norm_eps as a float32)
    assert np.float32(ckpt.config.rms_norm_eps) == np.float32(hf_cfg.rms_norm_eps)
    differ = ("rope_scaling", "rms_norm_eps")
    assert {k: v for k, v in ckpt.config.to_dict().items() if k not in differ} == {
        k: v for k, v in hf_cfg.to_dict().items() if k not in differ}
    got, want = rope_inv_freq(ckpt.config), rope_inv_freq(hf_cfg)
    assert not torch.equal(want, rope_inv_freq(replace(hf_cfg, rope_scaling=None)))
    rel = float(((got - want).abs() / want).max())
    assert rel <= INV_FREQ_RTOL, f"inv_freq relative difference {rel:.3g} > {INV_FREQ_RTOL}"
    assert ModelConfig.from_dict(ckpt.config.to_dict()) == ckpt.config  # manifest / export.json round trip


def test_export_logits_match_transformers(llama3: tuple[Path, Path, Path], tmp_path: Path) -> None:
    hf_dir, _, recipe = llama3
    export_recipe(load_recipe(recipe), tmp_path / "export", quiet=True)
    ids = np.random.default_rng(1).integers(0, 256, size=(2, 80), dtype=np.int64)  # past original context 64
    pos = np.ascontiguousarray(np.broadcast_to(np.arange(80, dtype=np.int64), ids.shape))
    session = ort.InferenceSession(str(tmp_path / "export" / "model.onnx"), providers=["CPUExecutionProvider"])
    out = session.run(None, {"input_ids": ids, "position_ids": pos})[0]
    with torch.no_grad():
        ref = hf_reference(hf_dir)(torch.from_numpy(ids)).logits.numpy()
    diff = float(np.abs(out - ref).max())
    print(f"GGUF export vs transformers: max abs logit diff {diff:.3g}")
    assert diff <= LOGITS_TOL, f"max abs diff {diff:.3g} > {LOGITS_TOL}"


def test_compiled_bundle_generates_like_transformers(llama3: tuple[Path, Path, Path], tmp_path: Path) -> None:
    """``omforge compile`` of the GGUF recipe; greedy tokens from the bundle equal transformers' generate()."""
    hf_dir, _, recipe = llama3
    bundle = compile_bundle(recipe, tmp_path / "bundle", tmp_path / "cache")
    manifest = load_manifest(bundle)
    assert manifest.model.config.rope_scaling["rope_type"] == "freq_factors"
    assert manifest.model.config == load_checkpoint(load_recipe(recipe)).config
    prompt = np.random.default_rng(3).integers(3, 256, 70).tolist()  # generation runs past position 64
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    got = LLM(bundle, num_kv_blocks=64).generate([prompt], params, use_tqdm=False)[0].token_ids
    with torch.no_grad():
        ref = hf_reference(hf_dir).generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16,
                                            do_sample=False, pad_token_id=0)
    assert got == ref[0, len(prompt):].tolist()


@pytest.mark.parametrize(("freqs", "message"), [
    (np.ones(7, np.float32), r"rope_freqs\.weight: shape \[7\], expected \[8\] \(head_dim 16 / 2\)"),
    (np.ones(8, np.float16), r"rope_freqs\.weight: type F16, expected F32"),
    (np.array([1, 1, 0, 1, 1, 1, 1, 1], np.float32), r"rope_freqs\.weight: factor 2 is 0\.0; factors must be"),
], ids=["wrong_length", "f16", "zero"])
def test_malformed_rope_freqs(llama3: tuple[Path, Path, Path], tmp_path: Path, freqs: np.ndarray,
                              message: str) -> None:
    hf_dir, _, _ = llama3
    path = convert_to_gguf(hf_dir, tmp_path / "bad.gguf", rope_freqs=freqs)
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: {message}"):
        load_gguf(path)


def test_config_checks_factors() -> None:
    base = dict(family="llama", vocab_size=8, hidden_size=16, intermediate_size=8, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    ModelConfig(**base, rope_scaling={"rope_type": "freq_factors", "factors": [1.0, 1.5, 8.0, 8]})
    with pytest.raises(ConfigError, match=r"rope_scaling\.factors: expected a list of head_dim / 2 = 4 numbers, "
                                          r"got 3 items"):
        ModelConfig(**base, rope_scaling={"rope_type": "freq_factors", "factors": [1.0, 1.0, 1.0]})
    with pytest.raises(ConfigError, match=r"rope_scaling\.factors: every factor must be a positive finite number "
                                          r"\(got nan\)"):
        ModelConfig(**base, rope_scaling={"rope_type": "freq_factors", "factors": [1.0, float("nan"), 1.0, 1.0]})
