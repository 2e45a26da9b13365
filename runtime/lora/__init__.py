"""Multi-LoRA adapters on the serving side (docs/lora.md): reading PEFT and llama.cpp GGUF adapters into host
memory (:mod:`.adapter`), checking them against a bundle, the registry of the adapters served and their slots
(:mod:`.registry`), writing them into the executor's slot pools (:mod:`.slots`), and what a runtime load may name
and read (:mod:`.access`). numpy only: no torch, nothing of export/passes/compile."""

from omforge.runtime.lora.access import LoraNameInvalid, LoraPathRefused, check_name, confine
from omforge.runtime.lora.adapter import LoraAdapter, LoraError, load_adapter, validate
from omforge.runtime.lora.registry import LoraInUse, LoraLimit, LoraRegistry, LoraUnreadable, UnknownLora
from omforge.runtime.lora.slots import LoraLoad, write_slot

__all__ = ["LoraAdapter", "LoraError", "LoraInUse", "LoraLimit", "LoraLoad", "LoraNameInvalid", "LoraPathRefused",
           "LoraRegistry", "LoraUnreadable", "UnknownLora", "check_name", "confine", "load_adapter", "validate",
           "write_slot"]
