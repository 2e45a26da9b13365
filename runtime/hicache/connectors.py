"""The tiers below the pool as KV connectors (runtime/kv_connector.py): the storage tier (its controller's loader
and writer threads, controller.py) and the host tier (slots copied by the step plans, host_tier.py).

- **Storage** (:class:`StorageConnector`): a request's next blocks the tier holds are an asynchronous hit when
  the controller's cost rule says loading beats computing; the loader fills the blocks the scheduler allocated
  and the finished load reports how many leading ones passed their checks. Write-through: every block the pool
  registers (a :class:`~omforge.runtime.block_pool.BlockStored` event) is offered after the step — only if it
  still holds that hash then: a block registered, freed and handed to another request in the same plan holds the
  other request's KV by the time the writer would read it (issue 45) — and pinned while its write is queued.
- **Host** (:class:`HostTierConnector`): a hit is synchronous, copied in by the admitting plan's ``swap_in``;
  every eviction (:class:`~omforge.runtime.block_pool.BlockEvicted`) is written back by the plan's ``swap_out``
  before anything rewrites the block; the previous plan's slots are released when the next plan starts.

Each answers a lookup once per admitted request (blocks looked up, hits, the cost rule's decision) into its
tier's counters.
"""

from __future__ import annotations

from collections.abc import Sequence

from omforge.runtime.block_pool import BlockEvicted, BlockStored, PoolEvent
from omforge.runtime.hicache.controller import IDLE_WAIT_S, HiCache, HiCacheStats, TierStats
from omforge.runtime.hicache.host_tier import HostTier
from omforge.runtime.hicache.storage import FileTier
from omforge.runtime.kv_cache_manager import KVCacheManager
from omforge.runtime.kv_connector import ExternalHit, Finished, FinishedLoad, KVConnector
from omforge.runtime.request import Request


class _Lookup:
    """The latest lookup (one request at a time is being admitted): counted once it is admitted."""

    def __init__(self, request_id: str, looked: int, hits: int, decision: str | None, hashes: Sequence[bytes]):
        self.request_id, self.looked, self.hits, self.decision, self.hashes = \
            request_id, looked, hits, decision, list(hashes)


class StorageConnector(KVConnector):
    uses_block_hashes = True

    def __init__(self, controller: HiCache, kv: KVCacheManager):
        self.controller, self.kv = controller, kv
        self._lookup: _Lookup | None = None
        self._stored: list[tuple[int, bytes]] = []

    @property
    def storage(self) -> FileTier:
        return self.controller.storage

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int,
                                   next_hashes: Sequence[bytes]) -> ExternalHit | None:
        self._lookup = None
        if not next_hashes:
            return None
        n = self.controller.match(next_hashes)
        worth = n > 0 and self.controller.worth_loading(n)
        self._lookup = _Lookup(request.request_id, min(n + 1, len(next_hashes)), n,
                               None if not n else "taken" if worth else "skipped", next_hashes[:n])
        return ExternalHit(n * self.kv.block_size, load_async=True) if worth else None

    def update_state_after_alloc(self, request: Request, blocks: Sequence[int],
                                 num_external_tokens: int) -> list[tuple[int, int]]:
        lookup, self._lookup = self._lookup, None
        if lookup is not None and lookup.request_id == request.request_id:
            self.controller.record(lookup.looked, lookup.hits, lookup.decision)
            if num_external_tokens:
                self.controller.start_load(request.request_id, lookup.hashes[:len(blocks)], blocks)
        return []

    def get_finished(self) -> Finished:
        return Finished(loads=[FinishedLoad(job.key, job.loaded) for job in self.controller.finished_loads()])

    def take_events(self, events: Sequence[PoolEvent]) -> list[tuple[int, int]]:
        self._stored += [(e.block, e.block_hash) for e in events if isinstance(e, BlockStored)]
        return []

    def after_step(self, prefill_tokens: int, seconds: float, idle: bool) -> None:
        """Unpin written blocks, queue (pinned) the blocks registered since the last step that still hold their
        hash, feed the prefill speed to the cost rule; an idle step waits a little for the workers."""
        if idle and self.controller.busy():
            self.controller.wait(IDLE_WAIT_S)
        self.kv.unpin(self.controller.finished_writes())
        stored, self._stored = self._stored, []
        intact = [(block, h) for block, h in stored if self.kv.pool.block_hash(block) == h]
        self.kv.pin(self.controller.offer_writes(intact))
        if not idle:
            self.controller.observe_prefill(prefill_tokens, seconds)

    def busy(self) -> bool:
        return self.controller.busy()

    def stats(self) -> HiCacheStats:
        return self.controller.stats()

    def close(self) -> None:
        self.controller.close()


class HostTierConnector(KVConnector):
    uses_block_hashes = True

    def __init__(self, host: HostTier, block_size: int):
        self.host, self.block_size = host, block_size
        self._lookup: _Lookup | None = None

    def get_finished(self) -> Finished:
        self.host.release()  # the previous plan ran: its host slots are free to reuse
        return Finished()

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int,
                                   next_hashes: Sequence[bytes]) -> ExternalHit | None:
        self._lookup = None
        if not next_hashes:
            return None
        n = self.host.match(next_hashes)
        self._lookup = _Lookup(request.request_id, min(n + 1, len(next_hashes)), n, None, next_hashes[:n])
        return ExternalHit(n * self.block_size, load_async=False) if n else None

    def update_state_after_alloc(self, request: Request, blocks: Sequence[int],
                                 num_external_tokens: int) -> list[tuple[int, int]]:
        lookup, self._lookup = self._lookup, None
        if lookup is None or lookup.request_id != request.request_id:
            return []
        self.host.record(lookup.looked, lookup.hits, lookup.decision)
        return list(zip(self.host.take(lookup.hashes[:len(blocks)]), blocks)) if num_external_tokens else []

    def take_events(self, events: Sequence[PoolEvent]) -> list[tuple[int, int]]:
        return [(e.block, slot) for e in events
                if isinstance(e, BlockEvicted) and (slot := self.host.store(e.block_hash)) is not None]

    def stats(self) -> HiCacheStats:
        h, size = self.host.stats, self.host.block_bytes
        tier = TierStats(lookups=h.lookups, hits=h.hits, loaded_blocks=h.hits, loaded_bytes=h.hits * size,
                         written_blocks=h.stored, written_bytes=h.stored * size, queue_drops=h.dropped,
                         blocks=len(self.host), bytes=len(self.host) * size, capacity_bytes=self.host.num_slots * size)
        return HiCacheStats({"host": tier}, 0, 0, 0, 0)
