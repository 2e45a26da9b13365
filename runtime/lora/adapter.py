"""Reading a LoRA adapter (a PEFT directory or a llama.cpp GGUF LoRA file) and checking it against a bundle
(docs/lora.md, "The runtime"). :class:`LoraAdapter`, :class:`LoraError` and :func:`make_adapter` live in
:mod:`.base` and are re-exported here."""

from __future__ import annotations

from pathlib import Path

from omforge.contract.manifest import LoraSection, ModelConfig
from omforge.runtime.lora.base import LoraAdapter, LoraError, LoraNameTaken, make_adapter, module_path

__all__ = ["LoraAdapter", "LoraError", "LoraNameTaken", "load_adapter", "make_adapter", "module_path", "validate"]


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
