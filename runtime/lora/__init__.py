"""Multi-LoRA adapters on the serving side (docs/lora.md): reading PEFT and llama.cpp GGUF adapters into host
memory (:mod:`.adapter`), checking them against a bundle, and writing them into the executor's slot pools
(:mod:`.slots`). numpy only: no torch, nothing of export/passes/compile."""

from omforge.runtime.lora.adapter import LoraAdapter, LoraError, load_adapter, validate
from omforge.runtime.lora.slots import LoraSlots, write_slot

__all__ = ["LoraAdapter", "LoraError", "LoraSlots", "load_adapter", "validate", "write_slot"]
