"""PEFT LoRA adapter directories (``save_pretrained``): ``adapter_config.json`` + ``adapter_model.safetensors``.

Read: ``peft_type`` (LORA), ``r``, ``lora_alpha``, ``use_rslora``, ``rank_pattern`` / ``alpha_pattern`` (per-module
``r`` / alpha, matched as PEFT's ``get_pattern_key`` does: the first pattern ``p`` with ``(.*\\.)?(p)$`` matching the
module key ``model.layers.N.self_attn.q_proj``), ``target_modules`` (a list of names, ``all-linear``, or a regex
string), ``layers_to_transform``. Scale per module, as PEFT's ``LoraLayer.update_layer``: ``alpha / sqrt(r)`` with
``use_rslora``, else ``alpha / r``. ``fan_in_fan_out`` changes nothing here: PEFT's ``lora_A`` / ``lora_B`` are
``[r, in]`` / ``[out, r]`` Linear weights whatever it is (it only transposes the merged delta of Conv1D base layers,
and PEFT turns it off for the ``nn.Linear`` layers of Llama-family models).

Refused, one line each: DoRA, LoRA biases, ``modules_to_save``, a target outside
:data:`~omforge.contract.lora.TARGET_MODULES` (embed_tokens, lm_head …), a pickle-only adapter, a missing file.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np

from omforge.contract.lora import ATTENTION_MODULES, TARGET_MODULES
from omforge.runtime.lora.base import LoraAdapter, LoraError, make_adapter
from omforge.runtime.lora.safetensors_file import SafetensorsError, read_safetensors

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight")
"""``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`` (``.default`` before ``.weight`` in files saved
from a state dict by hand)."""


def _pattern_key(patterns: list[str], module: str) -> str | None:
    """PEFT's ``peft.utils.other.get_pattern_key``: the first pattern that matches the module key's tail."""
    for p in patterns:
        if re.match(rf"(.*\.)?({p})$", module):
            return p
    return None


def _read_config(name: str, path: Path) -> dict[str, Any]:
    file = path / CONFIG_FILE
    if not file.is_file():
        raise LoraError(f"adapter '{name}': {file} is missing (a PEFT adapter directory has {CONFIG_FILE} and "
                        f"{WEIGHTS_FILE})")
    try:
        cfg = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoraError(f"adapter '{name}': {file} is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise LoraError(f"adapter '{name}': {file} is not a JSON object")
    return cfg


def _check_config(name: str, cfg: dict[str, Any]) -> None:
    """Refuse what omforge's LoRA term cannot compute (each a field of adapter_config.json)."""
    where = f"adapter '{name}': {CONFIG_FILE}"
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"{where} peft_type is {cfg.get('peft_type')!r}; only LORA adapters are served")
    if cfg.get("use_dora"):
        raise LoraError(f"{where} use_dora is true; DoRA adapters are not supported (merge it into the base model)")
    if cfg.get("bias", "none") != "none" or cfg.get("lora_bias"):
        key = "lora_bias" if cfg.get("lora_bias") else "bias"
        raise LoraError(f"{where} {key} is {cfg.get(key)!r}; adapters with trained biases are not supported "
                        "(bias must be \"none\")")
    if cfg.get("modules_to_save"):
        raise LoraError(f"{where} modules_to_save is {cfg['modules_to_save']}; fully trained modules are not "
                        "supported, only LoRA pairs")
    for key in ("layer_replication", "target_parameters", "trainable_token_indices"):
        if cfg.get(key):
            raise LoraError(f"{where} {key} is set; not supported")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        bad = [t for t in targets if str(t).rsplit(".", 1)[-1] not in TARGET_MODULES]
        if bad:
            raise LoraError(f"{where} target_modules has {', '.join(map(str, bad))}; LoRA is served on "
                            f"{', '.join(TARGET_MODULES)} only (contract/lora.py)")
    for key in ("r", "lora_alpha"):
        value = cfg.get(key)
        if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
            raise LoraError(f"{where} {key} must be a positive number (got {value!r})")


def _read_weights(name: str, path: Path) -> dict[str, np.ndarray]:
    file = path / WEIGHTS_FILE
    if not file.is_file():
        if (path / "adapter_model.bin").is_file():
            raise LoraError(f"adapter '{name}': {path} has adapter_model.bin only; only safetensors adapters are "
                            "loaded (save_pretrained(safe_serialization=True), or convert the .bin)")
        raise LoraError(f"adapter '{name}': {file} is missing")
    try:
        return read_safetensors(file)
    except (OSError, SafetensorsError) as e:
        raise LoraError(f"adapter '{name}': {e}") from None


def load_peft(name: str, path: Path) -> LoraAdapter:
    """The PEFT adapter in directory ``path``, its scale folded into every ``B``."""
    cfg = _read_config(name, path)
    _check_config(name, cfg)
    tensors = _read_weights(name, path)
    rank_pattern: dict[str, int] = cfg.get("rank_pattern") or {}
    alpha_pattern: dict[str, float] = cfg.get("alpha_pattern") or {}
    layers = cfg.get("layers_to_transform")
    layers = {layers} if isinstance(layers, int) else set(layers) if layers else None
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        m = _KEY.fullmatch(key)
        if m is None or m[3] not in TARGET_MODULES or (m[2] == "self_attn") != (m[3] in ATTENTION_MODULES):
            raise LoraError(f"adapter '{name}': {WEIGHTS_FILE} has '{key}'; LoRA is served on "
                            f"{', '.join(TARGET_MODULES)} of the decoder layers only (contract/lora.py)")
        layer = int(m[1])
        if layers is not None and layer not in layers:
            raise LoraError(f"adapter '{name}': {WEIGHTS_FILE} has '{key}', outside {CONFIG_FILE} "
                            f"layers_to_transform {sorted(layers)}")
        pairs.setdefault((layer, m[3]), {})[m[4]] = value
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = {}
    for (layer, target), pair in sorted(pairs.items(), key=lambda kv: (kv[0][0], TARGET_MODULES.index(kv[0][1]))):
        module = f"model.layers.{layer}.{'self_attn' if target in ATTENTION_MODULES else 'mlp'}.{target}"
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise LoraError(f"adapter '{name}': {WEIGHTS_FILE} has no {missing} for {module}")
        a, b = pair["A"], pair["B"]
        r_key = _pattern_key(list(rank_pattern), module)
        r = int(rank_pattern[r_key]) if r_key is not None else int(cfg["r"])
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != r or b.shape[1] != r:
            raise LoraError(f"adapter '{name}': {module} lora_A is {list(a.shape)} and lora_B {list(b.shape)}; "
                            f"{CONFIG_FILE} says r = {r} ([r, in] and [out, r])")
        alpha_key = _pattern_key(list(alpha_pattern), module)
        alpha = float(alpha_pattern[alpha_key]) if alpha_key is not None else float(cfg["lora_alpha"])
        scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        weights[(layer, target)] = (a, b * np.float32(scale))
    return make_adapter(name, path, weights)
