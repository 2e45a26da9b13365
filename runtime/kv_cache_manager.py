"""The KV cache manager: per-request block tables over a :class:`BlockPool`, prefix caching, copy-on-write, a
host swap tier, and what the KV connectors below the scheduler need of the pool (runtime/kv_connector.py: the
pool's typed events, pins for write-through, retired blocks). Allocation only: which request runs, waits or is
preempted is the scheduler's policy.
"""

from __future__ import annotations

import hashlib
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from omforge.contract import cdiv
from omforge.runtime.block_pool import BlockPool, PoolEvent

BlockHash = bytes
NO_BLOCK = -1
"""A table entry whose block was released because it fell out of the sliding window (never read again)."""


def hash_block_tokens(parent: BlockHash | None, tokens: Sequence[int]) -> BlockHash:
    """The chain hash of one full block: sha256 of the parent block's hash and the block's token ids (int64).

    A digest rather than Python's 64-bit ``hash``: a collision would silently serve another prompt's KV, and
    crafted prompts can collide a non-cryptographic hash.
    """
    digest = hashlib.sha256(parent or b"")
    digest.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return digest.digest()


@dataclass(frozen=True)
class KVCacheStats:
    """A snapshot of the KV cache. ``num_used`` blocks are referenced by some request; ``num_free`` includes cached
    blocks nobody references (evictable); ``num_cached`` counts blocks holding a prefix hash, referenced or not.
    ``prefix_queries`` are full blocks looked up by :meth:`KVCacheManager.get_computed_blocks` (a lookup stops at
    the first miss), ``prefix_hits`` those found. ``num_swapped_blocks`` host blocks hold swapped-out requests."""

    num_blocks: int
    num_free: int
    num_used: int
    num_cached: int
    usage: float
    prefix_queries: int
    prefix_hits: int
    hit_rate: float
    num_swapped_blocks: int
    num_host_free: int
    num_retired: int = 0


class KVCacheManager:
    """Block tables of running requests (device block ids) and of swapped-out ones (host block ids).

    Prefix caching works on FULL blocks keyed by a hash chain, ``hash(parent_hash, block tokens)``: a key names
    the whole prefix up to the end of its block, so a lookup is one dict probe per block and the pool stays a flat
    ``hash -> block`` map in which any unreferenced block can be evicted alone in O(1). A radix tree would match at
    token granularity, but KV below a block cannot be shared without a copy anyway, and it would need tree upkeep
    (splits, leaf-first eviction). Requests free their blocks tail first, so within a chain the tail is evicted
    before its prefix; a block whose parent was evicted is unreachable until it is evicted too.

    Invariants (:meth:`check_invariants`): a block's refcount equals the number of tables holding it (each at
    most once); ``_hashes[r][i]`` is the chain hash of block ``i`` of request ``r`` and the pool hash of that
    block is None or that hash (a block past them may already carry the hash a forked sibling committed; hashes
    are only computed when caching is on); the chain of a request with a root (a LoRA adapter's digest,
    :meth:`get_computed_blocks`) starts from it, its forks' too; host blocks are either free or in exactly one
    swapped table.
    Copies returned by :meth:`allocate_slots`, :meth:`swap_out` and :meth:`swap_in` are correct when performed in
    the order the calls returned them, before the step that follows.

    KV connectors (runtime/kv_connector.py): blocks a load fills are ordinary blocks of the request's table past
    its computed tokens, so no other request can find them before :meth:`commit` registers them once their KV is
    in place; with ``record_events`` registrations and evictions are typed pool events (:meth:`take_events`);
    :meth:`pin` holds a reference that is no table's while a block is written out, so a block's refcount is the
    tables holding it plus its pins; ``free(retire=...)`` takes blocks a transfer may still write out of
    circulation.

    Sliding windows (:meth:`release_out_of_window`): a leading block no future query of its request can see is
    released (a hashed one stays cached for other requests) and its table entry becomes :data:`NO_BLOCK`; dead
    entries hold no reference, are never copied, swapped or written, and keep their hash in the chain.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_host_blocks: int = 0, record_events: bool = False) -> None:
        if block_size < 1 or num_host_blocks < 0:
            raise ValueError(f"block_size must be >= 1 and num_host_blocks >= 0, got {block_size}, {num_host_blocks}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_host_blocks = num_host_blocks
        self.pool = BlockPool(num_blocks, record_events)
        self._tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[BlockHash]] = {}  # chain hashes of the first blocks, those already committed
        self._host_tables: dict[str, list[int]] = {}
        self._host_free: deque[int] = deque(range(num_host_blocks))
        self._pins: Counter[int] = Counter()
        self._roots: dict[str, BlockHash] = {}  # the hash-chain root of a request that has one (a LoRA adapter's)

    def _table(self, req_id: str) -> list[int]:
        if req_id in self._host_tables:
            raise ValueError(f"request {req_id!r} is swapped out: swap it in first")
        if req_id not in self._tables:
            raise ValueError(f"request {req_id!r} holds no blocks")
        return self._tables[req_id]

    def get_computed_blocks(self, req_id: str, token_ids: Sequence[int], use_cache: bool = True,
                            root: BlockHash | None = None) -> int:
        """For a NEW request: take references on the longest chain of cached full blocks matching the prefix of
        ``token_ids`` and start its block table with them. Returns the tokens already computed: a multiple of
        ``block_size``, always < ``len(token_ids)`` (one token is left so the step yields logits); 0 when off
        or not ``use_cache`` (the request computes its whole prompt, and still commits its blocks).
        ``root``: the parent of the request's first block in its hash chain — a LoRA adapter's digest (docs/lora.md),
        so requests of different adapters, or of an adapter and the base model (None), never share a block."""
        if req_id in self._tables or req_id in self._host_tables:
            raise ValueError(f"request {req_id!r} already holds blocks")
        if len(token_ids) == 0:
            raise ValueError(f"request {req_id!r} has no tokens")
        bs, blocks, hashes = self.block_size, [], []
        if self.enable_prefix_caching and use_cache:
            for i in range((len(token_ids) - 1) // bs):
                block_hash = hash_block_tokens(hashes[-1] if hashes else root, token_ids[i * bs:(i + 1) * bs])
                block = self.pool.lookup(block_hash)
                if block is None:
                    break
                blocks.append(block)
                hashes.append(block_hash)
            self.pool.incref(blocks)
        self._tables[req_id], self._hashes[req_id] = blocks, hashes
        if root is not None:
            self._roots[req_id] = root
        return len(blocks) * bs

    def allocate_slots(self, req_id: str, num_computed_tokens: int,
                       num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Make the table cover ``num_computed_tokens + num_new_tokens`` slots (an unknown request starts empty).
        Returns the copies ``(src, dst)`` to perform BEFORE the step: a shared block (refcount > 1) the step
        writes into is replaced by a fresh one, copied if it is partly filled. None, with NO state changed, when
        there are not enough free blocks."""
        if req_id in self._host_tables:
            raise ValueError(f"request {req_id!r} is swapped out: swap it in first")
        table, bs = self._tables.get(req_id, []), self.block_size
        committed = len(self._hashes.get(req_id, ())) * bs
        if num_new_tokens < 0 or not committed <= num_computed_tokens <= len(table) * bs:
            raise ValueError(f"request {req_id!r}: cannot compute {num_new_tokens} tokens after {num_computed_tokens} "
                             f"(its table holds {len(table) * bs} slots, {committed} committed)")
        first, end = num_computed_tokens // bs, cdiv(num_computed_tokens + num_new_tokens, bs)
        shared = [i for i in range(first, min(end, len(table))) if self.pool.ref_count(table[i]) > 1]
        grow = max(0, end - len(table))
        if len(shared) + grow > self.pool.num_free():
            return None
        fresh = self.pool.allocate(len(shared) + grow)
        copies = [(table[i], new) for i, new in zip(shared, fresh) if i == first and num_computed_tokens % bs]
        self.pool.decref(table[i] for i in shared)  # still referenced by the other holders
        for i, new in zip(shared, fresh):
            table[i] = new
        table.extend(fresh[len(shared):])
        self._tables[req_id] = table
        self._hashes.setdefault(req_id, [])
        return copies

    def block_table(self, req_id: str) -> list[int]:
        """A copy of the request's device block table."""
        return list(self._table(req_id))

    def device_table(self, req_id: str) -> list[int]:
        """A copy of the request's device block table; empty when it holds none on device."""
        return list(self._tables.get(req_id, ()))

    def commit(self, req_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """After a step: hash every block now full (within ``num_computed_tokens`` of ``token_ids``) and register
        it, unless caching is off or another block already holds that hash (then ours stays uncached)."""
        table, hashes = self._table(req_id), self._hashes[req_id]
        if not num_computed_tokens <= min(len(token_ids), len(table) * self.block_size):
            raise ValueError(f"request {req_id!r}: {num_computed_tokens} computed tokens exceed its "
                             f"{len(token_ids)} tokens or its {len(table) * self.block_size} slots")
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for i in range(len(hashes), num_computed_tokens // bs):
            hashes.append(hash_block_tokens(hashes[-1] if hashes else self._roots.get(req_id),
                                            token_ids[i * bs:(i + 1) * bs]))
            # a forked sibling may have registered it already; a released block is not registered again
            if table[i] != NO_BLOCK and self.pool.block_hash(table[i]) is None:
                self.pool.register(table[i], hashes[-1])

    # --- the connectors below the scheduler (runtime/kv_connector.py) ---------------------------------------

    def take_events(self) -> list[PoolEvent]:
        """The pool's typed events since the last call (:class:`~omforge.runtime.block_pool.BlockStored`,
        :class:`~omforge.runtime.block_pool.BlockEvicted`), in order; none unless ``record_events``."""
        return self.pool.take_events()

    def pin(self, blocks: Sequence[int]) -> None:
        """Hold a reference on each block that no table holds (a connector is writing it out)."""
        self.pool.incref(blocks)
        self._pins.update(blocks)

    def unpin(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            if self._pins[block] < 1:
                raise ValueError(f"block {block} is not pinned")
            self._pins[block] -= 1
            if not self._pins[block]:
                del self._pins[block]
        self.pool.decref(blocks)

    def next_block_hashes(self, req_id: str, token_ids: Sequence[int]) -> list[BlockHash]:
        """The chain hashes of the request's full blocks past those it holds, up to the last full block before
        its final token (a hit must leave one token to compute, :meth:`get_computed_blocks`)."""
        hashes, bs = list(self._hashes[req_id]), self.block_size
        start = len(hashes)
        for i in range(start, (len(token_ids) - 1) // bs):
            hashes.append(hash_block_tokens(hashes[-1] if hashes else self._roots.get(req_id),
                                            token_ids[i * bs:(i + 1) * bs]))
        return hashes[start:]

    def holds(self, req_id: str) -> bool:
        """Whether ``req_id`` holds blocks (on device or swapped out)."""
        return req_id in self._tables or req_id in self._host_tables

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (only while no request holds blocks); retired blocks stay retired."""
        if self._tables or self._host_tables or self._pins:
            raise ValueError("the prefix cache can only be reset while no request holds blocks")
        self.pool.reset_prefix_cache()

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares every block of the parent (refcount + 1 each); writes diverge by copy-on-write."""
        table = self._table(parent_id)
        if child_id in self._tables or child_id in self._host_tables:
            raise ValueError(f"request {child_id!r} already holds blocks")
        self.pool.incref(b for b in table if b != NO_BLOCK)
        self._tables[child_id], self._hashes[child_id] = list(table), list(self._hashes[parent_id])
        if parent_id in self._roots:
            self._roots[child_id] = self._roots[parent_id]

    def free(self, req_id: str, retire: Sequence[int] = ()) -> None:
        """Release the request's blocks, tail first (hashed ones stay cached until evicted); unknown ids are a no-op.
        ``retire``: blocks of its table (its own, unhashed) that a transfer may still write — they leave
        circulation (:meth:`BlockPool.retire`) instead of going back to the pool."""
        if req_id in self._tables:
            table = self._tables.pop(req_id)
            gone = set(retire)
            if not gone <= set(table):
                raise ValueError(f"request {req_id!r}: blocks to retire {sorted(gone - set(table))} are not its own")
            for block in gone:
                self.pool.retire(block)
            self.pool.decref(b for b in reversed(table) if b != NO_BLOCK and b not in gone)
        self._host_free.extend(h for h in self._host_tables.pop(req_id, ()) if h != NO_BLOCK)
        self._hashes.pop(req_id, None)
        self._roots.pop(req_id, None)

    def swap_out(self, req_id: str) -> list[tuple[int, int]] | None:
        """Move the request to the host tier: returns the ``(device block, host block)`` copies and frees its device
        blocks (shared ones are copied too: the host copy is private). None, with no change, if the host lacks room."""
        table = self._table(req_id)
        live = [b for b in table if b != NO_BLOCK]
        if len(live) > len(self._host_free):
            return None
        host = [NO_BLOCK if b == NO_BLOCK else self._host_free.popleft() for b in table]
        self.pool.decref(reversed(live))
        del self._tables[req_id]
        self._host_tables[req_id] = host
        return [(d, h) for d, h in zip(table, host) if d != NO_BLOCK]

    def swap_in(self, req_id: str) -> list[tuple[int, int]] | None:
        """Bring a swapped-out request back: returns the ``(host block, device block)`` copies; None, with no change,
        when there are not enough free device blocks. Its committed blocks rejoin the prefix cache if no other
        block holds their hash."""
        if req_id not in self._host_tables:
            raise ValueError(f"request {req_id!r} is not swapped out")
        host = self._host_tables[req_id]
        live = [h for h in host if h != NO_BLOCK]
        if len(live) > self.pool.num_free():
            return None
        fresh = iter(self.pool.allocate(len(live)))
        table = [NO_BLOCK if h == NO_BLOCK else next(fresh) for h in host]
        for block, block_hash in zip(table, self._hashes[req_id]):
            if block != NO_BLOCK:
                self.pool.register(block, block_hash)
        self._host_free.extend(live)
        del self._host_tables[req_id]
        self._tables[req_id] = table
        return [(h, d) for h, d in zip(host, table) if h != NO_BLOCK]

    def release_out_of_window(self, req_id: str, next_position: int, window: int) -> int:
        """Release the leading blocks that no query at ``next_position`` or later can see through a sliding window
        of ``window`` keys (a key j is visible to a query p iff p - window < j <= p). Returns how many were
        released now; their table entries become :data:`NO_BLOCK`."""
        table, bs = self._table(req_id), self.block_size
        dead = min(max(0, next_position - window + 1) // bs, len(table))
        released = [i for i in range(dead) if table[i] != NO_BLOCK]
        self.pool.decref(table[i] for i in reversed(released))
        for i in released:
            table[i] = NO_BLOCK
        return len(released)

    def num_blocks_needed(self, req_id: str | None, num_tokens: int) -> int:
        """Free device blocks the request (None or unknown: a new one, ignoring prefix hits) needs to hold
        ``num_tokens`` tokens on device, counting a swapped-out request's swap-in; copy-on-write may need more
        (:meth:`allocate_slots` has the last word)."""
        host = sum(h != NO_BLOCK for h in self._host_tables.get(req_id, ()))
        held = len(self._host_tables.get(req_id, ())) or len(self._tables.get(req_id, ()))
        return host + max(0, cdiv(num_tokens, self.block_size) - held)

    def stats(self) -> KVCacheStats:
        pool, free = self.pool, self.pool.num_free()
        used, queries, hits = pool.num_blocks - free, pool.stats.queries, pool.stats.hits
        return KVCacheStats(num_blocks=pool.num_blocks, num_free=free, num_used=used, num_cached=pool.num_cached(),
                            usage=used / pool.num_blocks, prefix_queries=queries, prefix_hits=hits,
                            hit_rate=hits / queries if queries else 0.0,
                            num_swapped_blocks=self.num_host_blocks - len(self._host_free),
                            num_host_free=len(self._host_free),
                            num_retired=pool.num_blocks - pool.num_usable())

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        held = Counter(b for table in self._tables.values() for b in table if b != NO_BLOCK) + self._pins
        assert all(self.pool.ref_count(b) == held[b] for b in range(self.pool.num_blocks)), \
            "a refcount differs from the number of tables and pins holding the block (leak or double free)"
        live = [[b for b in t if b != NO_BLOCK] for t in self._tables.values()]
        assert all(len(set(t)) == len(t) for t in live), "a block is twice in one table"
        assert all(t[:len(t) - len(kept)] == [NO_BLOCK] * (len(t) - len(kept))
                   for t, kept in zip(self._tables.values(), live)), "a released block that is not a leading one"
        assert not self._tables.keys() & self._host_tables.keys(), "a request is both on device and swapped out"
        assert self._hashes.keys() == self._tables.keys() | self._host_tables.keys(), "hash chains out of step"
        assert self._roots.keys() <= self._hashes.keys(), "a hash-chain root of a request that holds no blocks"
        for req_id, table in self._tables.items():
            hashes = self._hashes[req_id]
            assert len(hashes) <= len(table), f"request {req_id!r} has more hashes than blocks"
            assert all(self.pool.block_hash(b) in (None, h) for b, h in zip(table, hashes) if b != NO_BLOCK), \
                f"request {req_id!r} holds a block with a foreign hash"
        assert all(len(self._hashes[r]) <= len(t) for r, t in self._host_tables.items()), "host hashes out of step"
        host = [h for t in self._host_tables.values() for h in t if h != NO_BLOCK] + list(self._host_free)
        assert sorted(host) == list(range(self.num_host_blocks)), "host blocks lost or held twice"
        assert self.enable_prefix_caching or self.pool.num_cached() == 0, "blocks cached with caching off"
