"""Weight sources: a Hugging Face directory, a GGUF file (dequantized to fp32), a file in a Python package, random.

Every loader returns a :class:`Checkpoint` whose ``tensors`` use transformers' ``LlamaForCausalLM``
names and give float32 numpy arrays. Invariant: the names are exactly the parameters of
:class:`omforge.models.llama.LlamaForCausalLM` for ``config`` (checked by :func:`check_names`). A mixture of experts
has Qwen3-MoE's per-expert names (``mlp.gate.weight [E, H]``, ``mlp.experts.<e>.{gate,up,down}_proj.weight``) whatever
the source held: Mixtral's ``block_sparse_moe.*.w1/w3/w2``, transformers 5's fused ``mlp.experts.gate_up_proj
[E, 2F, H]`` / ``down_proj [E, H, F]``, or a GGUF's ``ffn_{gate,up,down}_exps`` (one 3-D tensor per layer), each
expert read as its own slice.

``tensors`` is lazy (:class:`TensorMap`): shapes are known up front, each array is read (safetensors slice,
GGUF block dequantization, seeded generation) when it is asked for and not kept, so an export streams the
weights one tensor at a time — an 8B checkpoint never sits in memory as float32.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from omforge.contract.manifest import ConfigError, ModelConfig
from omforge.errors import OmforgeError
from omforge.models.config import from_hf, from_recipe
from omforge.recipe import Recipe


class WeightsError(OmforgeError):
    """Weights that do not fit the model; the message names the file and the tensor."""


GGUF_KEPT_BLOCKS = ("Q4_0", "Q4_1", "Q8_0")  # block types the ORT lowering takes as they are (passes/quant.py)


class TensorMap(Mapping[str, np.ndarray]):
    """Named float32 tensors, read on access (never cached): ``shapes`` up front, ``load(name)`` per access."""

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], load: Callable[[str], np.ndarray]):
        self.shapes = dict(shapes)
        self._load = load

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self.shapes:
            raise KeyError(name)
        arr = np.asarray(self._load(name), dtype=np.float32)
        if arr.shape != self.shapes[name]:
            raise WeightsError(f"tensor '{name}': read shape {arr.shape}, declared {self.shapes[name]}")
        return arr

    def __contains__(self, name: object) -> bool:  # Mapping's default would read the tensor
        return name in self.shapes

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


@dataclass
class Checkpoint:
    config: ModelConfig
    tensors: Mapping[str, np.ndarray]  # a TensorMap from the loaders; a dict works too
    source: Path | None  # file or directory the weights came from (None for random)
    # GGUF: the raw blocks of the tensors stored as GGUF_KEPT_BLOCKS, by the same names: (type, uint8 rows
    # [N, bytes per row] after the Q/K row un-permutation, K); tensors[name] is their dequantization
    blocks: dict[str, tuple[str, np.ndarray, int]] = field(default_factory=dict)


def expected_names(cfg: ModelConfig) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not cfg.tie_word_embeddings:
        names.add("lm_head.weight")
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        if cfg.is_moe:
            names.add(p + "mlp.gate.weight")
            names |= {p + f"mlp.experts.{e}.{n}_proj.weight" for e in range(cfg.num_experts)
                      for n in ("gate", "up", "down")}
        else:
            names |= {p + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")}
        names |= {p + f"self_attn.{n}_proj.weight" for n in "qkvo"}
        if cfg.qkv_bias:
            names |= {p + f"self_attn.{n}_proj.bias" for n in "qkv"}
        if cfg.o_bias:
            names.add(p + "self_attn.o_proj.bias")
        if cfg.qk_norm:
            names |= {p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"}
    return names


def check_names(ckpt: Checkpoint) -> None:
    want, have = expected_names(ckpt.config), set(ckpt.tensors)
    where = ckpt.source or "random weights"
    if missing := sorted(want - have):
        raise WeightsError(f"{where}: tensor '{missing[0]}' is missing ({len(missing)} missing in all)")
    if extra := sorted(have - want):
        raise WeightsError(f"{where}: unexpected tensor '{extra[0]}' ({len(extra)} unexpected in all)")


def load_checkpoint(recipe: Recipe) -> Checkpoint:
    """Load the weights a recipe names. Raises :class:`WeightsError` / :class:`ConfigError` with a clear message."""
    m = recipe.model
    if m.source == "random":
        ckpt = random_checkpoint(_config_from_recipe(recipe), m.seed)
    else:
        path = recipe.weights_path()
        ckpt = load_gguf(path) if path.is_file() else load_hf_dir(path)
    if m.family is not None and ckpt.config.family != m.family:
        raise WeightsError(f"{recipe.path}: model.family: recipe says '{m.family}' but the weights are "
                           f"'{ckpt.config.family}'")
    check_names(ckpt)
    return ckpt


def _config_from_recipe(recipe: Recipe) -> ModelConfig:
    d = dict(recipe.model.config or {})
    d.setdefault("family", recipe.model.family or "llama")
    try:
        return from_recipe(d)
    except (ConfigError, KeyError) as e:
        raise ConfigError(f"{recipe.path}: model.config.{e}") from None


def random_checkpoint(cfg: ModelConfig, seed: int) -> Checkpoint:
    """Random weights with a fixed seed (normal, std 0.02; norm weights near 1 so they matter numerically).
    Each tensor has its own stream, seeded by ``(seed, its index in name order)``: any tensor is made alone, in
    any order, with the same values."""
    import torch  # torch only when building from scratch

    from omforge.models.llama import LlamaForCausalLM

    with torch.device("meta"):  # shapes only: no memory for the parameters
        shapes = {k: tuple(v.shape) for k, v in LlamaForCausalLM(cfg).state_dict().items()}
    index = {name: i for i, name in enumerate(sorted(shapes))}

    def make(name: str) -> np.ndarray:
        x = np.random.default_rng([seed, index[name]]).standard_normal(shapes[name], dtype=np.float32)
        if name.endswith("norm.weight"):
            return np.float32(1.0) + np.float32(0.1) * x
        x *= np.float32(0.02)
        return x

    return Checkpoint(cfg, TensorMap(shapes, make), None)


def load_hf_dir(path: Path) -> Checkpoint:
    """A Hugging Face directory: config.json and one or more *.safetensors (sharded via the index)."""
    import ml_dtypes  # noqa: F401 - registers numpy's bfloat16: most Hugging Face checkpoints are stored in bf16
    from safetensors import safe_open

    try:
        cfg = from_hf(json.loads((path / "config.json").read_text()))
    except (ConfigError, KeyError) as e:
        raise ConfigError(f"{path / 'config.json'}: {e}") from None
    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() \
        else sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"{path}: no *.safetensors files (omforge reads safetensors, not .bin)")
    shapes: dict[str, tuple[int, ...]] = {}
    shard: dict[str, tuple[Path, str, tuple | None]] = {}  # our name → (file, its name there, slice of it or None)
    for name in files:
        if not (path / name).is_file():
            raise WeightsError(f"{path}: shard '{name}' named in the index is missing")
        try:
            with safe_open(path / name, framework="numpy") as f:
                keys = [(key, tuple(f.get_slice(key).get_shape())) for key in f.keys()]
        except Exception as e:  # safetensors raises its own SafetensorError / OSError on a bad file
            raise WeightsError(f"{path / name}: not a readable safetensors file ({e})") from None
        for key, shape in keys:
            if "rotary_emb" in key or (cfg.tie_word_embeddings and key == "lm_head.weight"):
                continue
            # a base model saved alone (Qwen3-Embedding: embed_tokens.weight, layers.N…) has no "model."
            ours = key if key.startswith(("model.", "lm_head.")) else f"model.{key}"
            for part, part_shape, index in _hf_parts(ours, shape, path / name):
                shapes[part] = part_shape
                shard[part] = (path / name, key, index)
    if not cfg.tie_word_embeddings and "lm_head.weight" not in shapes and \
            not any(key.startswith("model.") for _, key in shard.values()):
        # a base model has no LM head (Qwen3-Embedding-4B/8B, untied): pooling reads the hidden states, and the
        # tied head stands in for the graph's logits output
        cfg = replace(cfg, tie_word_embeddings=True)

    def read(name: str) -> np.ndarray:
        file, key, index = shard[name]
        with safe_open(file, framework="numpy") as f:
            arr = f.get_tensor(key) if index is None else f.get_slice(key)[index]
            return arr.astype(np.float32, copy=False)

    return Checkpoint(cfg, TensorMap(shapes, read), path)


_MIXTRAL_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_MIXTRAL = re.compile(r"(model\.layers\.\d+\.)block_sparse_moe\.(gate|experts\.\d+\.(w[123]))\.weight")
_FUSED = re.compile(r"(model\.layers\.\d+\.mlp\.experts\.)(gate_up_proj|down_proj)(?:\.weight)?")


def _hf_parts(name: str, shape: tuple[int, ...], file: Path) -> list[tuple[str, tuple[int, ...], tuple | None]]:
    """A safetensors tensor as our parameter(s): ``(name, shape, index into the stored tensor or None)``. Mixtral's
    ``block_sparse_moe.gate`` / ``experts.<e>.w1|w3|w2`` are renamed; transformers 5's fused ``mlp.experts.gate_up_proj
    [E, 2F, H]`` (each expert's gate rows, then its up rows) and ``down_proj [E, H, F]`` become one slice per expert,
    read on access; anything else is itself."""
    if m := _MIXTRAL.fullmatch(name):
        return [(f"{m[1]}mlp.{'gate' if m[2] == 'gate' else m[2][:-2] + _MIXTRAL_PROJ[m[3]]}.weight", shape, None)]
    if not (m := _FUSED.fullmatch(name)):
        return [(name, shape, None)]
    if len(shape) != 3 or (m[2] == "gate_up_proj" and shape[1] % 2):
        raise WeightsError(f"{file}: tensor '{name}' has shape {list(shape)}; expected [experts, "
                           + ("2 × width, hidden]" if m[2] == "gate_up_proj" else "hidden, width]"))
    experts, rows, cols = shape
    if m[2] == "down_proj":
        return [(f"{m[1]}{e}.down_proj.weight", (rows, cols), (e,)) for e in range(experts)]
    f = rows // 2
    return [(f"{m[1]}{e}.{proj}.weight", (f, cols), (e, slice(lo, lo + f)))
            for e in range(experts) for proj, lo in (("gate_proj", 0), ("up_proj", f))]


_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # a mixture of experts' router [E, H]
}
_GGUF_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
"""A mixture of experts' 3-D tensors, one per layer (llama.cpp's convert_hf_to_gguf.py stacks the experts in torch
order: gate / up ``[E, F, H]``, down ``[E, H, F]``), read as ``mlp.experts.<e>.<proj>.weight``, one slice each."""


GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe")
"""llama.cpp architectures read; only ``llama``'s Q/K rows are permuted (convert_hf_to_gguf.py's LlamaModel.permute;
its Qwen2Model, Qwen3Model and Qwen3MoeModel write the projections as they are). ``llama`` with
``llama.expert_count`` is Mixtral (family ``mixtral``), ``qwen3moe`` is Qwen3-MoE (``qwen3_moe``)."""


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (it interleaves rotary halves for its own rope kernel)."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_ROPE_FREQS = "rope_freqs.weight"
"""Per-frequency rope divisors ``[head_dim / 2]`` F32. llama.cpp's converter writes them for a config.json with
``rope_scaling.rope_type: llama3`` (conversion/llama.py, ``LlamaModel.generate_extra_tensors``, in the llama.cpp of
llama-cpp-python 0.3.36) and no ``rope.scaling.*`` metadata, so the llama3 parameters are not in the file; ggml's rope
divides each theta by its factor (ggml-cpu/ops.cpp, ``ggml_rope_cache_init``: ``theta / freq_factors[i0/2]``);
llama.cpp loads the tensor as ``{n_rot/2}`` (src/models/llama.cpp) and ggml asserts it is F32."""


def _rope_freq_factors(t, head_dim: int) -> list[float]:  # noqa: ANN001 - gguf.ReaderTensor
    """``rope_freqs.weight`` as a list of ``head_dim // 2`` floats; :class:`ConfigError` naming the tensor otherwise."""
    shape = [int(x) for x in t.shape.tolist()]
    if t.tensor_type.name != "F32":
        raise ConfigError(f"{GGUF_ROPE_FREQS}: type {t.tensor_type.name}, expected F32 (as ggml's rope requires)")
    if shape != [head_dim // 2]:
        raise ConfigError(f"{GGUF_ROPE_FREQS}: shape {shape}, expected [{head_dim // 2}] (head_dim {head_dim} / 2)")
    factors = np.asarray(t.data, dtype=np.float32).reshape(-1)
    if bad := [i for i, f in enumerate(factors) if not (np.isfinite(f) and f > 0)]:
        raise ConfigError(f"{GGUF_ROPE_FREQS}: factor {bad[0]} is {factors[bad[0]]}; factors must be positive "
                          "and finite")
    return [float(f) for f in factors]


def gguf_config(reader) -> ModelConfig:  # noqa: ANN001 - gguf.GGUFReader
    """The model config from a GGUF's metadata. ``head_dim``: ``<arch>.attention.key_length`` where written (llama.cpp's
    convert_hf_to_gguf.py writes it from config.json's ``head_dim``: Qwen3's is not hidden / heads), else
    ``<arch>.rope.dimension_count``, else hidden / heads. A :data:`GGUF_ROPE_FREQS` tensor becomes
    ``rope_scaling = {"rope_type": "freq_factors", "factors": [...]}`` (not with ``rope.scaling.type`` linear)."""
    def field(key: str, default=None):  # noqa: ANN001, ANN202
        f = reader.get_field(key)
        return f.contents() if f is not None else default

    arch = field("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ConfigError(f"general.architecture: '{arch}' is not supported ({', '.join(GGUF_ARCHITECTURES)})")
    heads = int(field(f"{arch}.attention.head_count"))
    hidden = int(field(f"{arch}.embedding_length"))
    vocab = field(f"{arch}.vocab_size") or len(reader.get_field("tokenizer.ggml.tokens").data)
    names = {t.name for t in reader.tensors}
    eos = field("tokenizer.ggml.eos_token_id")
    scaling = field(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise ConfigError(f"{arch}.rope.scaling.type: '{scaling}' is not supported (none, linear)")
    head_dim = int(field(f"{arch}.attention.key_length", field(f"{arch}.rope.dimension_count", hidden // heads)))
    rope_scaling = {"rope_type": "linear", "factor": float(field(f"{arch}.rope.scaling.factor"))} \
        if scaling == "linear" else None
    if (freqs := next((t for t in reader.tensors if t.name == GGUF_ROPE_FREQS), None)) is not None:
        if rope_scaling is not None:
            raise ConfigError(f"{GGUF_ROPE_FREQS}: rope frequency factors together with {arch}.rope.scaling.type "
                              f"'{scaling}' are not supported")
        rope_scaling = {"rope_type": "freq_factors", "factors": _rope_freq_factors(freqs, head_dim)}
    experts = _gguf_experts(field, arch)
    return ModelConfig(
        family={"qwen3moe": "qwen3_moe", "llama": "mixtral" if experts else "llama"}.get(arch, arch),
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(field(f"{arch}.feed_forward_length", experts.get("moe_intermediate_size", 0))),
        num_hidden_layers=int(field(f"{arch}.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(field(f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(np.float32(field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5))),
        rope_theta=float(field(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(field(f"{arch}.context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        bos_token_id=field("tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else (),
        **experts,
    )


def _gguf_experts(field: Callable, arch: str) -> dict[str, object]:
    """The MoE fields from ``<arch>.expert_count`` (> 0), ``expert_used_count`` and ``expert_feed_forward_length``
    (Qwen3-MoE; Mixtral's experts are ``feed_forward_length`` wide; where absent, llama.cpp's ``n_ff / n_expert_used``
    for qwen3moe); empty for a dense model. ``norm_topk_prob`` is true: llama.cpp's llama and qwen3moe graphs always
    renormalize the top-k (``build_moe_ffn(..., norm_w = true, ...)``, softmax gating), whatever the HF config said.
    Refused in one line: a shared expert, a routing weight scale other than 1."""
    experts = int(field(f"{arch}.expert_count", 0))
    if not experts:
        if arch == "qwen3moe":
            raise ConfigError("qwen3moe.expert_count: missing or 0 (a qwen3moe file is a mixture of experts)")
        return {}
    if shared := field(f"{arch}.expert_shared_count", 0) or field(f"{arch}.expert_shared_feed_forward_length", 0):
        raise ConfigError(f"{arch}.expert_shared_count: a shared expert ({shared}) is not supported")
    if (scale := float(field(f"{arch}.expert_weights_scale", 1.0))) not in (0.0, 1.0):
        raise ConfigError(f"{arch}.expert_weights_scale: {scale} is not supported (the routing weights unscaled: 1)")
    used = int(field(f"{arch}.expert_used_count", 0))
    ffn = field(f"{arch}.expert_feed_forward_length") or (
        int(field(f"{arch}.feed_forward_length", 0)) // max(used, 1) if arch == "qwen3moe"
        else field(f"{arch}.feed_forward_length"))
    return {"num_experts": experts, "num_experts_per_tok": used, "moe_intermediate_size": int(ffn or 0),
            "norm_topk_prob": True}


def load_gguf(path: Path) -> Checkpoint:
    """A GGUF file; quantized tensors (Q4_0/Q4_1/Q8_0/K-quants …) are dequantized to fp32 with ``gguf``, a mixture
    of experts' 3-D expert tensors one expert at a time (their Q4_0/Q4_1/Q8_0 blocks kept per expert too)."""
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # gguf raises bare ValueError/struct errors on a bad file
        raise WeightsError(f"{path}: not a readable GGUF file ({e})") from None
    try:
        cfg = gguf_config(reader)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    permute = cfg.family in ("llama", "mixtral")
    shapes: dict[str, tuple[int, ...]] = {}
    # name → (reader tensor, heads to un-permute or None, expert index into a 3-D tensor or None)
    where: dict[str, tuple[object, int | None, int | None]] = {}
    blocks: dict[str, tuple[str, np.ndarray, int]] = {}
    for t in reader.tensors:
        if t.name == GGUF_ROPE_FREQS:  # read into cfg.rope_scaling by gguf_config: not a parameter
            continue
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", t.name)
        if m and m[2] in _GGUF_EXPERTS and m[3] == "weight":
            shape = tuple(int(x) for x in reversed(t.shape.tolist()))
            if len(shape) != 3:
                raise WeightsError(f"{path}: tensor '{t.name}' has shape {list(shape)}; expected 3-D [experts, rows, "
                                   "columns]")
            raw = np.asarray(t.data) if t.tensor_type.name in GGUF_KEPT_BLOCKS else None
            for e in range(shape[0]):
                name = f"model.layers.{m[1]}.mlp.experts.{e}.{_GGUF_EXPERTS[m[2]]}.weight"
                shapes[name], where[name] = shape[1:], (t, None, e)
                if raw is not None:  # expert e's rows of the file's blocks (a view of the memory map)
                    blocks[name] = (t.tensor_type.name, raw[e].reshape(shape[1], -1), shape[2])
            continue
        if m:
            if m[2] not in _GGUF_LAYER:
                raise WeightsError(f"{path}: tensor '{t.name}' has no place in a {cfg.family} model")
            name = f"model.layers.{m[1]}.{_GGUF_LAYER[m[2]]}.{m[3]}"
        elif t.name in _GGUF_NAMES:
            name = _GGUF_NAMES[t.name]
        else:
            raise WeightsError(f"{path}: tensor '{t.name}' has no place in a {cfg.family} model")
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        heads = None
        if permute and m and m[2] in ("attn_q", "attn_k"):
            heads = cfg.num_attention_heads if m[2] == "attn_q" else cfg.num_key_value_heads
        shapes[name], where[name] = shape, (t, heads, None)
        if t.tensor_type.name in GGUF_KEPT_BLOCKS and len(shape) == 2:  # the file's blocks (memory-mapped)
            raw = np.asarray(t.data)
            raw = _unpermute(raw, heads) if heads else raw  # rows move whole: blocks run along K
            blocks[name] = (t.tensor_type.name, np.ascontiguousarray(raw.reshape(shape[0], -1)), shape[1])

    def dequantize(name: str) -> np.ndarray:
        t, heads, expert = where[name]
        data = t.data if expert is None else t.data[expert]
        arr = gguf.quants.dequantize(data, t.tensor_type).reshape(shapes[name]).astype(np.float32, copy=False)
        return _unpermute(arr, heads) if heads else arr

    return Checkpoint(cfg, TensorMap(shapes, dequantize), path, blocks)
