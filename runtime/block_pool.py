"""The block pool: the free list, reference counts and the prefix-cache map of the paged KV cache.

No policy here (which request gets blocks is the scheduler's call, how a request's table grows is the KV cache
manager's); this module only keeps the books of ``num_blocks`` fixed-size blocks.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass


@dataclass
class PrefixCacheStats:
    """Counters of :meth:`BlockPool.lookup`: blocks looked up and blocks found."""

    queries: int = 0
    hits: int = 0


class BlockPool:
    """Fixed-size blocks ``0 .. num_blocks - 1``, each in exactly one of three states:

    - **free**: refcount 0, no hash; in a FIFO, handed out first (no cached KV is lost by taking one);
    - **cached-unreferenced**: refcount 0, holds a hash; in LRU order (least recently freed first), handed out
      only when no free block is left, and then its hash is dropped (eviction);
    - **referenced**: refcount > 0, with or without a hash; in no list.

    Accounting: ``num_free() == free + cached-unreferenced`` (both are allocatable now), and
    ``free + cached-unreferenced + referenced == num_blocks``. The hash map is a bijection between the hashes
    and the blocks holding one (referenced or cached-unreferenced): one block per hash, one hash per block.
    A block is never both free and referenced; only a block with a hash can be revived from refcount 0 by
    :meth:`incref` (a prefix-cache hit). :meth:`check_invariants` asserts all of this.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got num_blocks={num_blocks}")
        self.num_blocks = num_blocks
        self.stats = PrefixCacheStats()
        self._refs = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._hash_of: dict[int, Hashable] = {}
        self._block_of: dict[Hashable, int] = {}
        self.evicted: list[tuple[int, Hashable]] | None = None  # when a list: every eviction is recorded there

    def num_free(self) -> int:
        """Blocks :meth:`allocate` can hand out now: free plus cached-unreferenced (evictable)."""
        return len(self._free) + len(self._evictable)

    def num_cached(self) -> int:
        """Blocks holding a prefix-cache hash, referenced or not."""
        return len(self._block_of)

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    def block_hash(self, block: int) -> Hashable | None:
        return self._hash_of.get(block)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks at refcount 1: free ones first (FIFO), then evict the least recently freed cached ones."""
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
                if self.evicted is not None:  # its KV is still there until the step after it (a write-back)
                    self.evicted.append((block, block_hash))
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
                    self._free.append(block)

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
        return True

    def check_invariants(self) -> None:
        free, evictable = set(self._free), set(self._evictable)
        referenced = {b for b, r in enumerate(self._refs) if r > 0}
        assert len(free) == len(self._free), "a block is twice in the free list"
        assert all(r >= 0 for r in self._refs), "negative refcount"
        assert not free & evictable and not free & referenced and not evictable & referenced, \
            "a block is in two states"
        assert len(free) + len(evictable) + len(referenced) == self.num_blocks, "free + cached + referenced != total"
        assert not free & self._hash_of.keys(), "a free block holds a hash"
        assert evictable <= self._hash_of.keys(), "a cached-unreferenced block has no hash"
        assert len(self._hash_of) == len(self._block_of) and all(
            self._block_of[h] == b for b, h in self._hash_of.items()), "the hash map is not a bijection"
        assert 0 <= self.stats.hits <= self.stats.queries, "more prefix-cache hits than queries"
