"""Multi-LoRA adapters on the serving side (docs/lora.md): reading PEFT and llama.cpp GGUF adapters into host
memory (:mod:`.adapter`), checking them against a bundle, the registry of the adapters served and their slots
(:mod:`.registry`), and writing them into the executor's slot pools (:mod:`.slots`). numpy only: no torch, nothing
of export/passes/compile."""

from omforge.runtime.lora.adapter import LoraAdapter, LoraError, load_adapter, validate
from omforge.runtime.lora.registry import LoraInUse, LoraRegistry, UnknownLora
from omforge.runtime.lora.slots import LoraLoad, write_slot

__all__ = ["LoraAdapter", "LoraError", "LoraInUse", "LoraLoad", "LoraRegistry", "UnknownLora", "load_adapter",
           "validate", "write_slot"]
