"""Which adapter is in which slot of the executor's LoRA pools, and writing one there (docs/lora.md, "The runtime").

Pool layout (contract/lora.py; ``R = max_rank``): for every LoRA'd projection, ``lora_a.{layer}.{name}`` is
``[S, P·R, in]`` and ``lora_b.{layer}.{name}`` ``[S, out, P·R]``; part ``p`` of slot ``s`` holds the adapter's
``A [r, in]`` in rows ``p·R … p·R + r − 1`` of ``lora_a[s]`` and its scaled ``B [out_p, r]`` in rows
``start … stop − 1``, columns ``p·R … p·R + r − 1`` of ``lora_b[s]``; everything else of the slot is zero.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import numpy as np

from omforge.contract.lora import BASE_SLOT, pool_a, pool_b
from omforge.contract.manifest import LoraSection, ModelConfig
from omforge.runtime.lora.adapter import LoraAdapter, LoraError, LoraNameTaken, validate


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


class LoraSlots:
    """The registered adapters (host memory, parsed once) and the ``max_loras`` slots of the pools they are loaded
    into on demand; a pin count per adapter (the running requests that use it); least-recently-used replacement.

    Invariants: a pinned adapter is never overwritten or unregistered; slot 0 (the base model) is never written;
    each adapter is in at most one slot and each slot holds at most one adapter; only slots ``1 … max_loras`` are
    used. Thread-safe (one lock): the engine acquires and releases, the server registers and unregisters.
    """

    def __init__(self, spec: LoraSection, config: ModelConfig, pools: Mapping[str, np.ndarray],
                 max_loras: int | None = None):
        max_loras = spec.max_loras if max_loras is None else max_loras
        if not 1 <= max_loras <= spec.max_loras:
            raise LoraError(f"--max-loras {max_loras}: the bundle has {spec.max_loras} adapter slots "
                            "(compile.lora.max_loras); use 1 … that")
        self.spec, self.config, self.pools, self.max_loras = spec, config, pools, max_loras
        self._adapters: dict[str, LoraAdapter] = {}
        self._holder: dict[int, str | None] = dict.fromkeys(range(1, max_loras + 1))
        self._slot: dict[str, int] = {}
        self._pins: dict[str, int] = {}
        self._used: dict[int, int] = dict.fromkeys(range(1, max_loras + 1), 0)  # slot → last acquire tick
        self._tick = 0
        self._lock = threading.RLock()
        self.loads = 0
        """Adapters written into a slot so far."""
        self.evictions = 0
        """Loads that replaced a resident (unpinned) adapter."""

    def register(self, adapter: LoraAdapter) -> None:
        """Add ``adapter`` (validated against the bundle; not loaded into a slot until acquired); a name already
        registered is a :class:`LoraNameTaken`."""
        validate(adapter, self.spec, self.config)
        with self._lock:
            if adapter.name in self._adapters:
                raise LoraNameTaken(f"adapter '{adapter.name}' is already loaded; unload it first to replace it")
            self._adapters[adapter.name] = adapter
            self._pins[adapter.name] = 0

    def unregister(self, name: str) -> None:
        """Remove adapter ``name`` and clear its slot; refused while running requests use it."""
        with self._lock:
            self._known(name)
            if self._pins[name]:
                raise LoraError(f"adapter '{name}' is in use by {self._pins[name]} running requests")
            slot = self._slot.pop(name, None)
            if slot is not None:
                write_slot(self.pools, self.spec, slot, None)
                self._holder[slot] = None
            del self._adapters[name], self._pins[name]

    def names(self) -> tuple[str, ...]:
        """The registered adapters, in registration order."""
        with self._lock:
            return tuple(self._adapters)

    def get(self, name: str) -> LoraAdapter:
        with self._lock:
            return self._known(name)

    def acquire(self, name: str) -> int | None:
        """The slot holding adapter ``name``, pinned once more: where it already is, else written into a free slot
        or over the least recently acquired unpinned adapter; None (nothing changed) when every slot is pinned by
        other adapters. Each acquire needs a :meth:`release`."""
        with self._lock:
            adapter = self._known(name)
            slot = self._slot.get(name)
            if slot is None:
                free = [s for s, held in self._holder.items() if held is None]
                if free:
                    slot = free[0]
                else:
                    idle = [s for s, held in self._holder.items() if not self._pins[held]]
                    if not idle:
                        return None
                    slot = min(idle, key=self._used.__getitem__)
                    del self._slot[self._holder[slot]]
                    self.evictions += 1
                write_slot(self.pools, self.spec, slot, adapter)
                self.loads += 1
                self._holder[slot], self._slot[name] = name, slot
            self._tick += 1
            self._used[slot] = self._tick
            self._pins[name] += 1
            return slot

    def release(self, name: str) -> None:
        """Unpin adapter ``name`` once (a request that used it ended); it stays resident until replaced."""
        with self._lock:
            self._known(name)
            if not self._pins[name]:
                raise LoraError(f"adapter '{name}' is not pinned (release without acquire)")
            self._pins[name] -= 1

    def slot_of(self, name: str) -> int | None:
        """The slot adapter ``name`` is in, None when not resident."""
        with self._lock:
            return self._slot.get(name)

    def pinned(self, name: str) -> int:
        """How many running requests hold adapter ``name``."""
        with self._lock:
            self._known(name)
            return self._pins[name]

    def _known(self, name: str) -> LoraAdapter:
        if name not in self._adapters:
            known = ", ".join(self._adapters) or "none"
            raise LoraError(f"adapter '{name}' is not loaded (loaded: {known})")
        return self._adapters[name]
