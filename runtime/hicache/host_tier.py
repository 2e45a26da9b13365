"""The host tier (L2) for a pool in device memory: slots of the executor's host block memory, keyed by block hash.

Bookkeeping only, on the engine thread; the copies are the step plan's (``SchedulerOutput.swap_out`` device →
host, ``swap_in`` host → device, carried out by the executor before the step's work: ``executor.run_plan``).
Slots are numbered in the executor's host block space after the swap tier's (``base .. base + num_slots - 1``).

- **Write-back** (:meth:`HostTier.store`): a block the pool evicts gets a slot — a free one, else the least
  recently used slot that no copy of the current plan reads — and the plan copies it there before anything
  rewrites the block. When every slot is being read this plan, the block is dropped.
- **Load** (:meth:`HostTier.take`): a hit's slots are read by this plan's ``swap_in``; they are held (never
  handed to a write-back) until :meth:`HostTier.release` at the next plan.
Invariants (:meth:`HostTier.check_invariants`): the map is a bijection between hashes and used slots; used and
free slots partition the range; held slots are used.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class HostTierStats:
    lookups: int = 0
    hits: int = 0
    stored: int = 0
    dropped: int = 0
    evicted: int = 0


class HostTier:
    name = "host"

    def __init__(self, base: int, num_slots: int, block_bytes: int):
        if num_slots < 1:
            raise ValueError(f"a host tier needs at least one slot, got {num_slots}")
        self.base, self.num_slots, self.block_bytes = base, num_slots, block_bytes
        self._slot_of: OrderedDict[bytes, int] = OrderedDict()  # least recently used first
        self._free = list(range(base + num_slots - 1, base - 1, -1))
        self._held: set[int] = set()
        self.stats = HostTierStats()

    def __len__(self) -> int:
        return len(self._slot_of)

    def match(self, hashes: Sequence[bytes]) -> int:
        """How many leading ``hashes`` the tier holds."""
        n = 0
        while n < len(hashes) and hashes[n] in self._slot_of:
            n += 1
        return n

    def record(self, lookups: int, hits: int, decision: str | None) -> None:
        """Count one admitted request's lookup (blocks looked up and found; hits are always taken)."""
        self.stats.lookups += lookups
        self.stats.hits += hits

    def take(self, hashes: Sequence[bytes]) -> list[int]:
        """The slots of ``hashes`` (all held: :meth:`match` said so), most recently used now, held for this plan."""
        slots = []
        for block_hash in hashes:
            self._slot_of.move_to_end(block_hash)
            slots.append(self._slot_of[block_hash])
        self._held.update(slots)
        return slots

    def store(self, block_hash: bytes) -> int | None:
        """A slot for an evicted block's KV, or None (already held: only its recency moves; or no slot free)."""
        if block_hash in self._slot_of:
            self._slot_of.move_to_end(block_hash)
            return None
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((h for h, s in self._slot_of.items() if s not in self._held), None)
            if victim is None:
                self.stats.dropped += 1
                return None
            slot = self._slot_of.pop(victim)
            self.stats.evicted += 1
        self._slot_of[block_hash] = slot
        self._held.add(slot)  # this plan writes it: no second write-back may take it before the plan ran
        self.stats.stored += 1
        return slot

    def release(self) -> None:
        """The previous plan ran: its slots may be reused."""
        self._held.clear()

    def check_invariants(self) -> None:
        used = set(self._slot_of.values())
        assert len(used) == len(self._slot_of), "two hashes in one host slot"
        assert not used & set(self._free) and len(used) + len(self._free) == self.num_slots, "host slots lost"
        assert all(self.base <= s < self.base + self.num_slots for s in used | set(self._free)), "slot out of range"
        assert self._held <= used, "a held host slot holds nothing"
