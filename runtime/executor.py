"""The executor contract: what the engine asks of whatever runs the step graph (ORT here, AscendCL on an NPU).

An executor owns the device side of the KV cache (the pools, the host swap tier) and runs steps; it decides
nothing. The scheduler's plan is handed over whole by :func:`run_plan`, which fixes the order: the plan's block
moves (swap out, swap in, copy-on-write copies) and adapter loads (LoRA slots) always happen — the KV cache
manager and the LoRA registry have already recorded them, also in a step that schedules no work — and only then
the step's work runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

from omforge.runtime.step import SeqWork

if TYPE_CHECKING:
    from omforge.runtime.scheduler import SchedulerOutput


@dataclass(frozen=True)
class HostKVPools:
    """An executor's KV pools when they are host memory (numpy arrays the tiers and NIXL may read and write in
    place): ``pools`` in vLLM's order K0, V0, K1, V1, …, each ``[num_blocks, block_size, kv_heads, row_elems]``."""

    pools: tuple[np.ndarray, ...]

    def block_views(self, block: int) -> list[memoryview]:
        """Block ``block``'s bytes in every pool, in pool order (the storage tier's file layout)."""
        return [memoryview(pool[block]).cast("B") for pool in self.pools]


@dataclass(frozen=True)
class ExecutorCapabilities:
    """What an executor can run, read once by the engine and handed to the scheduler.

    ``supports_mixed_batches``: one step may carry single-token decodes beside longer prefill chunks without
    padding the decodes to the chunk (a graph with a decode group, ``contract.DECODE_GROUP_INPUTS``); without it
    the scheduler alternates decode steps and prefill steps. ``max_prompt_len``: a prompt bound below the
    context (the fixed gears of an OM model), None when only the context bounds it. ``num_blocks``: the device
    pool size when the executor fixes it (compiled into OM models), None when the engine chooses it.
    ``supports_prompt_logits``: a work item with ``all_logits`` gets a logits row per token (prompt logprobs).
    ``host_kv``: the KV pools, when they are host memory (the storage tier reads and writes blocks in place, NIXL
    registers them for PD); None when they are device memory (the host tier copies through the plan instead).
    ``lora_pools``: a graph with LoRA inputs (docs/lora.md): every adapter pool by input name, host memory the
    plan's :class:`~omforge.runtime.lora.slots.LoraLoad` moves write in place; None when the executor binds none.
    """

    supports_mixed_batches: bool
    max_prompt_len: int | None = None
    num_blocks: int | None = None
    supports_prompt_logits: bool = False
    host_kv: HostKVPools | None = None
    lora_pools: Mapping[str, np.ndarray] | None = None


@runtime_checkable
class Executor(Protocol):
    capabilities: ExecutorCapabilities

    def execute(self, work: Sequence[SeqWork]) -> np.ndarray:
        """Run one step (``work`` not empty); returns logits ``[items with needs_logits, vocab]`` in work order."""

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole device blocks ``(src, dst)`` in every layer's K and V pool (copy-on-write)."""

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks, ``(device, host)`` pairs."""

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy host blocks back to device blocks, ``(host, device)`` pairs."""

    def close(self) -> None:
        """Release what the executor holds (device, streams, buffers); idempotent."""


def run_plan(executor: Executor, plan: SchedulerOutput) -> np.ndarray | None:
    """Carry out one scheduler plan: its block moves in order, its adapter loads, then its work. Returns the logits
    rows of the work items that sample (:attr:`SchedulerOutput.work` order), or None when the plan schedules no
    work."""
    executor.swap_out(plan.swap_out)
    executor.swap_in(plan.swap_in)
    executor.copy_blocks(plan.block_copies)
    if plan.lora_loads:
        pools = executor.capabilities.lora_pools
        if pools is None:
            raise RuntimeError(f"the plan loads LoRA adapters but the executor ({type(executor).__name__}) binds "
                               "no adapter pools")
        for load in plan.lora_loads:
            load.apply(pools)
    return executor.execute(plan.work) if plan.work else None
