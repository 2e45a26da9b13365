"""The block pool: the free list, reference counts and the prefix-cache map of the paged KV cache.

No policy here (which request gets blocks is the scheduler's call, how a request's table grows is the KV cache
manager's); this module only keeps the books of ``num_blocks`` fixed-size blocks.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class BlockStored:
    """A block got its prefix hash: its KV is in place and findable (vLLM's ``BlockStored`` KV event)."""

    block: int
    block_hash: Hashable


@dataclass(frozen=True)
class BlockEvicted:
    """A cached, unreferenced block was handed out again and lost its hash; its KV is intact until the plan that
    allocated it runs (vLLM's ``BlockRemoved``)."""

    block: int
    block_hash: Hashable


PoolEvent = BlockStored | BlockEvicted


@dataclass
class PrefixCacheStats:
    """Counters of :meth:`BlockPool.lookup`: blocks looked up and blocks found."""

    queries: int = 0
    hits: int = 0


class BlockPool:
    """Fixed-size blocks ``0 .. num_blocks - 1``, each in exactly one of four states:

    - **free**: refcount 0, no hash; handed out first (no cached KV is lost by taking one), the most recently
      freed first: a block that held KV before is resident and warm, so a pool that is never prefaulted (offline)
      keeps its resident part at what the load needs instead of walking every block once;
    - **cached-unreferenced**: refcount 0, holds a hash; in LRU order (least recently freed first), handed out
      only when no free block is left, and then its hash is dropped (eviction);
    - **referenced**: refcount > 0, with or without a hash; in no list;
    - **retired**: refcount 0, no hash, never handed out: a transfer that could not be cancelled may still write
      it (:meth:`retire`) until :meth:`reinstate` makes it free again.

    Accounting: ``num_free() == free + cached-unreferenced`` (both are allocatable now), and
    ``free + cached-unreferenced + referenced + retired == num_blocks``; ``num_usable()`` excludes the retired.
    With ``record_events`` every registration and eviction is recorded as a typed event (:data:`PoolEvent`) for
    :meth:`take_events` (the tiers below the pool write through or back on them). The hash map is a bijection
    between the hashes and the blocks holding one (referenced or cached-unreferenced): one block per hash, one
    hash per block. A block is never both free and referenced; only a block with a hash can be revived from
    refcount 0 by :meth:`incref` (a prefix-cache hit). :meth:`check_invariants` asserts all of this.
    """

    def __init__(self, num_blocks: int, record_events: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got num_blocks={num_blocks}")
        self.num_blocks = num_blocks
        self.stats = PrefixCacheStats()
        self._refs = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._hash_of: dict[int, Hashable] = {}
        self._block_of: dict[Hashable, int] = {}
        self.record_events = record_events
        self._events: list[PoolEvent] = []
        self._retired: set[int] = set()

    def num_free(self) -> int:
        """Blocks :meth:`allocate` can hand out now: free plus cached-unreferenced (evictable)."""
        return len(self._free) + len(self._evictable)

    def num_usable(self) -> int:
        """Blocks that can ever be handed out: all but the retired ones."""
        return self.num_blocks - len(self._retired)

    def take_events(self) -> list[PoolEvent]:
        """The events since the last call, in order (none unless ``record_events``)."""
        events, self._events = self._events, []
        return events

    def retire(self, block: int) -> None:
        """Take a referenced, unhashed block with one reference out of circulation (a transfer may still write it)."""
        if self._refs[block] != 1 or block in self._hash_of:
            raise ValueError(f"block {block} must hold one reference and no hash to be retired")
        self._refs[block] = 0
        self._retired.add(block)

    def reinstate(self, blocks: Iterable[int]) -> None:
        """Retired blocks nothing writes any more: free again."""
        for block in blocks:
            self._retired.remove(block)
            self._free.appendleft(block)

    def reset_prefix_cache(self) -> None:
        """Forget every hash (caller: no block is referenced); cached blocks become free, retired ones stay."""
        if any(self._refs):
            raise ValueError("the prefix cache can only be reset while no block is referenced")
        self._free.extendleft(self._evictable)  # before the never-used blocks, the most recently freed first
        self._evictable.clear()
        self._hash_of.clear()
        self._block_of.clear()

    def num_cached(self) -> int:
        """Blocks holding a prefix-cache hash, referenced or not."""
        return len(self._block_of)

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    def block_hash(self, block: int) -> Hashable | None:
        return self._hash_of.get(block)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks at refcount 1: free ones first (most recently freed first), then evict the least recently
        freed cached ones."""
        if not 0 <= n <= self.num_free():
            raise ValueError(f"cannot allocate {n} blocks: {self.num_free()} of {self.num_blocks} are free")
        blocks = []
        for _ in range(n):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._evictable.popitem(last=False)
                block_hash = self._hash_of.pop(block)
                del self._block_of[block_hash]
                if self.record_events:  # its KV is still there until the step after it (a write-back)
                    self._events.append(BlockEvicted(block, block_hash))
            self._refs[block] = 1
            blocks.append(block)
        return blocks

    def incref(self, blocks: Iterable[int]) -> None:
        """Take a reference on each block; a cached-unreferenced one leaves the LRU list (a prefix-cache hit)."""
        for block in blocks:
            if self._refs[block] == 0:
                if block not in self._evictable:
                    raise ValueError(f"block {block} is free: only a referenced or cached block can be shared")
                del self._evictable[block]
            self._refs[block] += 1

    def decref(self, blocks: Iterable[int]) -> None:
        """Drop a reference on each block; at 0 it is free, or cached-unreferenced (most recent) if it has a hash."""
        for block in blocks:
            if self._refs[block] == 0:
                raise ValueError(f"block {block} is not referenced")
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._hash_of:
                    self._evictable[block] = None
                else:
                    self._free.appendleft(block)

    def lookup(self, block_hash: Hashable) -> int | None:
        """The block holding ``block_hash``, or None; counted in :attr:`stats`."""
        self.stats.queries += 1
        block = self._block_of.get(block_hash)
        self.stats.hits += block is not None
        return block

    def register(self, block: int, block_hash: Hashable) -> bool:
        """Give a referenced, full, unhashed block its hash. False (nothing changed) if another block holds it."""
        if self._refs[block] == 0 or block in self._hash_of:
            raise ValueError(f"block {block} must be referenced and unhashed to be registered")
        if block_hash in self._block_of:
            return False
        self._hash_of[block] = block_hash
        self._block_of[block_hash] = block
        if self.record_events:
            self._events.append(BlockStored(block, block_hash))
        return True

    def check_invariants(self) -> None:
        free, evictable, retired = set(self._free), set(self._evictable), self._retired
        referenced = {b for b, r in enumerate(self._refs) if r > 0}
        assert len(free) == len(self._free), "a block is twice in the free list"
        assert all(r >= 0 for r in self._refs), "negative refcount"
        assert not free & evictable and not free & referenced and not evictable & referenced, \
            "a block is in two states"
        assert not retired & (free | evictable | referenced | self._hash_of.keys()), "a retired block in use"
        assert len(free) + len(evictable) + len(referenced) + len(retired) == self.num_blocks, \
            "free + cached + referenced + retired != total"
        assert not free & self._hash_of.keys(), "a free block holds a hash"
        assert evictable <= self._hash_of.keys(), "a cached-unreferenced block has no hash"
        assert len(self._hash_of) == len(self._block_of) and all(
            self._block_of[h] == b for b, h in self._hash_of.items()), "the hash map is not a bijection"
        assert 0 <= self.stats.hits <= self.stats.queries, "more prefix-cache hits than queries"
