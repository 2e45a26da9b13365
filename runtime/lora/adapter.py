"""A LoRA adapter in host memory and its check against a bundle (docs/lora.md, "The runtime").

:class:`LoraAdapter` holds, per ``(layer, target module)``, the pair ``A [r, in]`` and ``B [out, r]`` as float32 C
arrays with the adapter's scale already folded into ``B`` (so the delta of the module's weight is ``B @ A``), and a
digest of those weights (the prefix cache's identity for the adapter). Readers: PEFT directories (:mod:`.peft`) and
llama.cpp GGUF LoRA files (:mod:`.gguf_lora`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from omforge.contract.lora import ATTENTION_MODULES, TARGET_MODULES
from omforge.contract.manifest import LoraSection, ModelConfig
from omforge.errors import OmforgeError


class LoraError(OmforgeError):
    """An adapter that cannot be read or does not fit the bundle; the message names the adapter and the field."""


@dataclass(frozen=True, eq=False)
class LoraAdapter:
    """One adapter, parsed once. ``weights[(layer, target)] = (A [r, in], B [out, r])``, float32, ``B`` scaled;
    ``rank``: the largest ``r`` of its modules; ``target_modules``: the modules it has weights for, in
    :data:`~omforge.contract.lora.TARGET_MODULES` order; ``digest``: sha256 over every ``(layer, target, A, B)``
    in sorted order (equal weights ⇔ equal digest, whatever the name or the file format)."""

    name: str
    path: Path
    rank: int
    target_modules: tuple[str, ...]
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]
    digest: bytes


def module_path(layer: int, target: str) -> str:
    """``layers.{layer}.self_attn.q_proj`` / ``layers.{layer}.mlp.down_proj``: how errors name a module."""
    return f"layers.{layer}.{'self_attn' if target in ATTENTION_MODULES else 'mlp'}.{target}"


def make_adapter(name: str, path: Path,
                 weights: Mapping[tuple[int, str], tuple[np.ndarray, np.ndarray]]) -> LoraAdapter:
    """The adapter from its (already scaled) pairs: float32 C copies, the rank, the targets and the digest.
    A pair whose ranks disagree (``A [r, in]``, ``B [out, r']``) is a :class:`LoraError`."""
    if not weights:
        raise LoraError(f"adapter '{name}': {path} has no LoRA weights")
    pairs: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = {}
    digest = hashlib.sha256()
    for key in sorted(weights):
        a, b = (np.ascontiguousarray(w, dtype=np.float32) for w in weights[key])
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise LoraError(f"adapter '{name}': {module_path(*key)} lora_A is {list(a.shape)} and lora_B "
                            f"{list(b.shape)}; expected [r, in] and [out, r]")
        a.flags.writeable = b.flags.writeable = False
        pairs[key] = (a, b)
        digest.update(f"{key[0]}.{key[1]}:{a.shape}:{b.shape};".encode())
        digest.update(a.tobytes())
        digest.update(b.tobytes())
    targets = {t for _, t in pairs}
    return LoraAdapter(name=name, path=path, rank=max(a.shape[0] for a, _ in pairs.values()),
                       target_modules=tuple(t for t in TARGET_MODULES if t in targets), weights=pairs,
                       digest=digest.digest())


def load_adapter(name: str, path: str | Path, config: ModelConfig | None = None) -> LoraAdapter:
    """Read adapter ``name`` from ``path``: a directory is a PEFT adapter (adapter_config.json +
    adapter_model.safetensors), a ``.gguf`` file a llama.cpp GGUF LoRA; anything else is a :class:`LoraError`.

    ``config`` (the base model's): needed for a GGUF LoRA of a ``llama`` model that targets q_proj or k_proj
    (llama.cpp permutes their ``lora_b`` rows per head; un-permuting needs the head counts, which the file does not
    record), and checks a GGUF's architecture against the base model's family. PEFT adapters do not need it."""
    path = Path(path)
    if path.is_dir():
        from omforge.runtime.lora.peft import load_peft

        return load_peft(name, path)
    if path.is_file() and path.suffix.lower() == ".gguf":
        from omforge.runtime.lora.gguf_lora import load_gguf_lora

        return load_gguf_lora(name, path, config)
    if not path.exists():
        raise LoraError(f"adapter '{name}': {path} does not exist (a PEFT adapter directory or a .gguf LoRA file)")
    raise LoraError(f"adapter '{name}': {path} is neither a PEFT adapter directory nor a .gguf LoRA file")


def validate(adapter: LoraAdapter, spec: LoraSection, config: ModelConfig) -> None:
    """Check that ``adapter`` fits the bundle's LoRA section and base model: every module's ``r`` ≤ ``max_rank``,
    every target among the bundle's ``target_modules``, every layer below ``num_hidden_layers``, and every ``A``/``B``
    as wide as the bundle's projection (``in_features``; the part's output columns). :class:`LoraError` naming the
    adapter and the field otherwise."""
    name = adapter.name
    if adapter.rank > spec.max_rank:
        raise LoraError(f"adapter '{name}': r = {adapter.rank} exceeds the bundle's max_rank {spec.max_rank} "
                        "(compile.lora.max_rank)")
    extra = [t for t in adapter.target_modules if t not in spec.target_modules]
    if extra:
        raise LoraError(f"adapter '{name}': targets {', '.join(extra)}, which the bundle was not compiled for "
                        f"(compile.lora.target_modules: {', '.join(spec.target_modules)})")
    parts = {(proj.layer, part.target): (proj, part) for proj in spec.projections for part in proj.parts}
    for (layer, target), (a, b) in sorted(adapter.weights.items()):
        where = module_path(layer, target)
        if layer >= config.num_hidden_layers:
            raise LoraError(f"adapter '{name}': {where}: the base model has {config.num_hidden_layers} layers "
                            "(num_hidden_layers; wrong base model?)")
        if (layer, target) not in parts:
            raise LoraError(f"adapter '{name}': {where}: the bundle has no LoRA term for this module "
                            "(lora.projections)")
        proj, part = parts[(layer, target)]
        if a.shape[1] != proj.in_features:
            raise LoraError(f"adapter '{name}': {where} lora_A is {list(a.shape)}, the base model's {target} has "
                            f"{proj.in_features} inputs (wrong base model?)")
        if b.shape[0] != part.stop - part.start:
            raise LoraError(f"adapter '{name}': {where} lora_B is {list(b.shape)}, the base model's {target} has "
                            f"{part.stop - part.start} outputs (wrong base model?)")
