"""The LoRA part of the step ABI (docs/lora.md): the target modules, how fused projections split into them, the
pool input names and shapes. Dependency-free (stdlib only): the passes write it, the runtime reads it.

Invariants: slot 0 of every pool is the base model (zeros, never written); adapters live in slots
``1 … max_loras``. Part ``p`` of a projection occupies rank rows ``p·R … (p+1)·R − 1`` of ``lora_a`` and the same
columns of ``lora_b`` (block diagonal), and output columns ``start … stop − 1``.
"""

from __future__ import annotations

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections an adapter may target (PEFT's module names for the Llama family)."""

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")

PROJECTIONS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "gate_up": ("gate_proj", "up_proj"),
    "q": ("q_proj",), "k": ("k_proj",), "v": ("v_proj",), "o": ("o_proj",),
    "gate": ("gate_proj",), "up": ("up_proj",), "down": ("down_proj",),
}
"""A projection of the exported (possibly fused) graph by its short name → the target modules whose output columns
it holds, in column order."""

SLOTS_INPUT = "lora_slots"
"""``[1, num_tokens]`` int64: each packed token's slot (0: the base model)."""

BASE_SLOT = 0


def pool_a(layer: int, projection: str) -> str:
    """The name of the A pool input of ``projection`` in ``layer``: ``[S, P·R, in_features]`` float32."""
    return f"lora_a.{layer}.{projection}"


def pool_b(layer: int, projection: str) -> str:
    """The name of the B pool input of ``projection`` in ``layer``: ``[S, out_features, P·R]`` float32."""
    return f"lora_b.{layer}.{projection}"
