"""llama.cpp GGUF LoRA adapters (what llama.cpp's convert_lora_to_gguf.py writes and src/llama-adapter.cpp reads).

Format facts, from llama.cpp (ggml-org/llama.cpp):

- convert_lora_to_gguf.py, ``LoraModel``: ``general.type = "adapter"``, ``adapter.type = "lora"``,
  ``adapter.lora.alpha`` (float32: the PEFT config's ``lora_alpha``; rank_pattern, alpha_pattern and use_rslora are
  not carried), ``general.architecture`` (GGUFWriter writes it); per targeted weight ``<gguf name>.lora_a`` (torch
  ``[r, in]``, ggml ne ``[in, r]``) and ``<gguf name>.lora_b`` (torch ``[out, r]``, ne ``[r, out]``), e.g.
  ``blk.3.attn_q.weight.lora_a``; f32 by default (``--outtype`` f16, bf16, q8_0 too). The base model's
  ``modify_tensors`` runs on the pair through ``LoraTorchTensor``: convert_hf_to_gguf.py's ``LlamaModel.permute``
  of q_proj / k_proj (``reshape(n_head, 2, rows // n_head // 2, …).swapaxes(1, 2)``, ``n_head_kv`` heads for k) is
  a row permutation, so it lands on ``lora_b`` only. Qwen2 and Qwen3 write their projections unpermuted.
- src/llama-adapter.cpp, ``llama_adapter_lora_init_impl``: checks ``general.type``, the architecture against the
  base model's, ``adapter.type``; reads ``adapter.lora.alpha`` (0 when absent); skips ``*_norm.weight`` tensors
  (mergekit's); checks ``model.ne[0] == a.ne[0]``, ``model.ne[1] == b.ne[1]``, ``a.ne[1] == b.ne[0]``.
- src/llama-adapter.h, ``llama_adapter_lora_weight::get_scale``: ``rank = b->ne[0]``,
  ``scale = alpha ? adapter_scale * alpha / rank : adapter_scale``; the user scale (``--lora-scaled``) is 1 here.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from omforge.contract.lora import TARGET_MODULES
from omforge.contract.manifest import ModelConfig
from omforge.errors import one_line
from omforge.runtime.lora.base import LoraAdapter, LoraError, make_adapter

GGUF_TARGETS = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj",
                "ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}
"""llama.cpp's tensor names (gguf-py's TENSOR_NAMES) of the target modules."""

ARCH_FAMILIES = {"llama": ("llama", "mistral"), "qwen2": ("qwen2",), "qwen3": ("qwen3",)}
"""A GGUF architecture → the omforge families whose base models it fits (Mistral converts as ``llama``)."""

_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.weight\.lora_([ab])")


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head q/k row permutation (the same as export/weights.py's ``_unpermute`` of the base
    GGUF import, which serving does not import)."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader: Any, key: str) -> Any:
    f = reader.get_field(key)
    return f.contents() if f is not None else None


def load_gguf_lora(name: str, path: Path, config: ModelConfig | None) -> LoraAdapter:
    """The GGUF LoRA ``path``, scale ``alpha / r`` folded into every ``B`` and llama's q/k ``B`` rows un-permuted
    (``config`` gives the head counts; see :func:`~omforge.runtime.lora.adapter.load_adapter`)."""
    try:
        import gguf
    except ImportError:
        raise LoraError(f"adapter '{name}': reading a GGUF LoRA needs the gguf package (pip install gguf)") from None
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # gguf raises bare ValueError / struct errors on a bad file
        raise LoraError(f"adapter '{name}': {path} is not a readable GGUF file ({one_line(e)})") from None
    where = f"adapter '{name}': {path}"
    if _field(reader, "general.type") != "adapter":
        raise LoraError(f"{where}: general.type is {_field(reader, 'general.type')!r}, not 'adapter' (a base model "
                        "GGUF, not a LoRA?)")
    if _field(reader, "adapter.type") != "lora":
        raise LoraError(f"{where}: adapter.type is {_field(reader, 'adapter.type')!r}; only 'lora' is supported")
    arch = _field(reader, "general.architecture")
    if arch not in ARCH_FAMILIES:
        raise LoraError(f"{where}: general.architecture '{arch}' is not supported ({', '.join(ARCH_FAMILIES)})")
    if config is not None and config.family not in ARCH_FAMILIES[arch]:
        raise LoraError(f"{where}: general.architecture '{arch}' does not match the base model's family "
                        f"'{config.family}' (wrong base model?)")
    alpha = float(_field(reader, "adapter.lora.alpha") or 0.0)
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for t in reader.tensors:
        if t.name.endswith("_norm.weight"):  # llama.cpp skips these too (llama-adapter.cpp)
            continue
        m = _NAME.fullmatch(t.name)
        if m is None or m[2] not in GGUF_TARGETS:
            raise LoraError(f"{where}: tensor '{t.name}'; LoRA is served on {', '.join(TARGET_MODULES)} of the "
                            "decoder layers only (contract/lora.py)")
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # ggml ne → numpy order
        try:
            arr = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
        except Exception as e:
            raise LoraError(f"{where}: tensor '{t.name}' ({t.tensor_type.name}) cannot be read ({one_line(e)})") \
                from None
        pairs.setdefault((int(m[1]), GGUF_TARGETS[m[2]]), {})[m[3]] = arr.astype(np.float32, copy=False)
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = {}
    for (layer, target), pair in pairs.items():
        gguf_name = f"blk.{layer}.{next(k for k, v in GGUF_TARGETS.items() if v == target)}.weight"
        if set(pair) != {"a", "b"}:
            raise LoraError(f"{where}: LoRA tensor pair for '{gguf_name}' is missing one component")
        a, b = pair["a"], pair["b"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise LoraError(f"{where}: '{gguf_name}' lora_a is {list(a.shape)} and lora_b {list(b.shape)} (numpy "
                            "order); expected [r, in] and [out, r]")
        if arch == "llama" and target in ("q_proj", "k_proj"):
            if config is None:
                raise LoraError(f"{where}: a llama GGUF LoRA's {target} lora_b rows are permuted per head by "
                                "llama.cpp; reading it needs the base model's config (head counts)")
            heads = config.num_attention_heads if target == "q_proj" else config.num_key_value_heads
            if b.shape[0] % (2 * heads):
                raise LoraError(f"{where}: '{gguf_name}.lora_b' has {b.shape[0]} rows, not a whole number of "
                                f"{heads} heads (wrong base model?)")
            b = _unpermute(b, heads)
        scale = alpha / a.shape[0] if alpha else 1.0
        weights[(layer, target)] = (a, b * np.float32(scale))
    return make_adapter(name, path, weights)
