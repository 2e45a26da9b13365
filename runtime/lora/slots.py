"""Writing an adapter into a slot of the executor's LoRA pools (docs/lora.md, "The runtime"): :func:`write_slot`, and
:class:`LoraLoad`, the plan's move that does it (which adapter is in which slot: :mod:`.registry`).

Pool layout (contract/lora.py; ``R = max_rank``): for every LoRA'd projection, ``lora_a.{layer}.{name}`` is
``[S, P·R, in]`` and ``lora_b.{layer}.{name}`` ``[S, out, P·R]``; part ``p`` of slot ``s`` holds the adapter's
``A [r, in]`` in rows ``p·R … p·R + r − 1`` of ``lora_a[s]`` and its scaled ``B [out_p, r]`` in rows
``start … stop − 1``, columns ``p·R … p·R + r − 1`` of ``lora_b[s]``; everything else of the slot is zero.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from omforge.contract.lora import BASE_SLOT, pool_a, pool_b
from omforge.contract.manifest import LoraSection
from omforge.runtime.lora.adapter import LoraAdapter, LoraError


def _pool(pools: Mapping[str, np.ndarray], name: str) -> np.ndarray:
    if name not in pools:
        raise LoraError(f"LoRA pool '{name}' is missing from the executor's pools (the manifest's lora section and "
                        "the pools disagree)")
    return pools[name]


def write_slot(pools: Mapping[str, np.ndarray], spec: LoraSection, slot: int, adapter: LoraAdapter | None) -> None:
    """Write ``adapter`` into slot ``slot`` of every pool of ``spec`` (in place), after zeroing the slot; ``None``
    only clears it. Slot 0 (the base model) and a slot past ``max_loras`` are refused; so is an adapter whose rank
    exceeds ``max_rank`` (:func:`~omforge.runtime.lora.adapter.validate` first)."""
    if not 1 <= slot <= spec.max_loras:
        raise LoraError(f"LoRA slot {slot}: adapters live in slots 1 … {spec.max_loras} (slot {BASE_SLOT} is the "
                        "base model and stays zero)")
    if adapter is not None and adapter.rank > spec.max_rank:
        raise LoraError(f"adapter '{adapter.name}': r = {adapter.rank} exceeds the bundle's max_rank "
                        f"{spec.max_rank} (compile.lora.max_rank)")
    big_r = spec.max_rank
    for proj in spec.projections:
        a_pool, b_pool = _pool(pools, pool_a(proj.layer, proj.name)), _pool(pools, pool_b(proj.layer, proj.name))
        a_pool[slot] = 0
        b_pool[slot] = 0
        if adapter is None:
            continue
        for p, part in enumerate(proj.parts):
            pair = adapter.weights.get((proj.layer, part.target))
            if pair is None:
                continue
            a, b = pair
            r = a.shape[0]
            a_pool[slot, p * big_r:p * big_r + r, :] = a
            b_pool[slot, part.start:part.stop, p * big_r:p * big_r + r] = b


@dataclass(frozen=True, eq=False)
class LoraLoad:
    """A move of the scheduler's plan (``SchedulerOutput.lora_loads``): write ``adapter`` into ``slot`` of the
    executor's LoRA pools (laid out by ``spec``) before the step's work runs (``executor.run_plan``)."""

    slot: int
    adapter: LoraAdapter
    spec: LoraSection

    def apply(self, pools: Mapping[str, np.ndarray]) -> None:
        write_slot(pools, self.spec, self.slot, self.adapter)
