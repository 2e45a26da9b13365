"""A LoRA adapter in host memory (docs/lora.md, "The runtime"): what the readers (:mod:`.peft`, :mod:`.gguf_lora`)
build and :mod:`.adapter` checks; its own module so that the readers and :func:`.adapter.load_adapter`, which picks
one, do not import each other.

:class:`LoraAdapter` holds, per ``(layer, target module)``, the pair ``A [r, in]`` and ``B [out, r]`` as float32 C
arrays with the adapter's scale already folded into ``B`` (so the delta of the module's weight is ``B @ A``), and a
digest of those weights (the prefix cache's identity for the adapter).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from omforge.contract.lora import ATTENTION_MODULES, TARGET_MODULES
from omforge.errors import OmforgeError


class LoraError(OmforgeError):
    """An adapter that cannot be read or does not fit the bundle; the message names the adapter and the field."""


class LoraNameTaken(LoraError):
    """An adapter name already registered (unload it first to replace it)."""


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
