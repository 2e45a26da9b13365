"""The block pool and the KV cache manager: unit tests of each mechanism, then a hypothesis state machine that runs
random request lifecycles against a model of the device and host KV memory (each slot holds the token id whose
KV it would hold), so a wrong prefix hit, a missed copy-on-write or a lost swap shows up as a wrong token."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from omforge.contract import cdiv
from omforge.runtime.block_pool import BlockPool
from omforge.runtime.kv_cache_manager import NO_BLOCK, KVCacheManager, hash_block_tokens


def snapshot(kv: KVCacheManager) -> tuple:
    """Every piece of state of the manager and its pool (order of the free and LRU lists included)."""
    return copy.deepcopy({k: v for k, v in vars(kv).items() if k != "pool"}), copy.deepcopy(vars(kv.pool))


def run_prefill(kv: KVCacheManager, req_id: str, tokens: list[int]) -> int:
    """Admit a request and compute its whole prompt in one step; returns the tokens served by the cache."""
    cached = kv.get_computed_blocks(req_id, tokens)
    assert kv.allocate_slots(req_id, cached, len(tokens) - cached) == []
    kv.commit(req_id, tokens, len(tokens))
    return cached


# --- the block pool ---------------------------------------------------------------------------------------------

def test_pool_allocate_free_round_trip() -> None:
    pool = BlockPool(8)
    blocks = pool.allocate(5)
    assert len(set(blocks)) == 5 and pool.num_free() == 3
    assert all(pool.ref_count(b) == 1 for b in blocks)
    pool.check_invariants()
    pool.decref(blocks)
    assert pool.num_free() == 8
    pool.check_invariants()
    with pytest.raises(ValueError):
        pool.allocate(9)
    with pytest.raises(ValueError):
        pool.decref([0])
    with pytest.raises(ValueError):
        pool.incref([0])  # a free block without a hash cannot be revived


def test_pool_prefers_free_blocks_then_evicts_least_recently_freed() -> None:
    pool = BlockPool(4)
    a, b, c, d = pool.allocate(4)
    for block, key in ((a, "a"), (b, "b"), (c, "c")):
        assert pool.register(block, key)
    assert not pool.register(d, "a")  # the hash is taken: d stays uncached
    pool.decref([b, a, d, c])  # freed order: b, a, c (cached) and d (plain free)
    assert pool.num_free() == 4 and pool.num_cached() == 3
    pool.check_invariants()
    assert pool.allocate(1) == [d]  # a never-cached block first: no cached KV lost
    assert pool.allocate(1) == [b]  # then the least recently freed cached one, its hash dropped
    assert pool.lookup("b") is None and pool.lookup("a") == a
    assert pool.stats.queries == 2 and pool.stats.hits == 1
    pool.check_invariants()


def test_pool_reuses_freed_blocks_before_never_used_ones() -> None:
    """A block that held KV is resident: handing it out again before a never-used one keeps an unprefaulted pool's
    resident part at what the load needs (offline runs one request after another would otherwise walk every block)."""
    pool = BlockPool(8)
    first = pool.allocate(2)
    pool.decref(first)  # plain free, no hash
    assert sorted(pool.allocate(2)) == sorted(first)
    pool.decref(first)
    cached = pool.allocate(3)
    for block, key in zip(cached, "xyz"):
        pool.register(block, key)
    pool.decref(cached)  # cached-unreferenced: kept while never-used blocks remain
    assert set(pool.allocate(3)).isdisjoint(cached)
    pool.check_invariants()
    pool2 = BlockPool(8)
    used = pool2.allocate(3)
    for block, key in zip(used, "xyz"):
        pool2.register(block, key)
    pool2.decref(used)
    pool2.reset_prefix_cache()  # the hashes go: the blocks that held them come before the never-used ones
    assert sorted(pool2.allocate(3)) == sorted(used)
    pool2.check_invariants()


# --- the KV cache manager: unit tests ---------------------------------------------------------------------------

def test_allocate_free_round_trip() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4)
    assert kv.get_computed_blocks("r", list(range(10))) == 0
    assert kv.allocate_slots("r", 0, 10) == []
    assert len(kv.block_table("r")) == 3
    assert kv.allocate_slots("r", 10, 2) == []  # fits in the last block
    assert len(kv.block_table("r")) == 3
    assert kv.allocate_slots("r", 12, 1) == []
    assert len(kv.block_table("r")) == 4
    s = kv.stats()
    assert (s.num_used, s.num_free, s.usage) == (4, 6, 0.4)
    kv.check_invariants()
    kv.free("r")
    kv.free("r")  # idempotent
    assert kv.stats().num_free == 10
    kv.check_invariants()
    with pytest.raises(ValueError):
        kv.block_table("r")


def test_shared_prefix_hits_across_16_requests() -> None:
    bs, rng = 16, np.random.default_rng(0)
    kv = KVCacheManager(num_blocks=128, block_size=bs)
    prefix = rng.integers(0, 32000, 512).tolist()
    shared_blocks = 512 // bs
    for r in range(16):
        before = kv.stats().prefix_hits
        cached = run_prefill(kv, f"r{r}", prefix + rng.integers(0, 32000, 20).tolist())
        hits = kv.stats().prefix_hits - before
        if r == 0:
            assert cached == 0
        else:
            assert hits >= 0.9 * shared_blocks and cached >= 0.9 * 512
        kv.check_invariants()
    assert kv.block_table("r15")[:shared_blocks] == kv.block_table("r0")[:shared_blocks]
    assert kv.pool.ref_count(kv.block_table("r0")[0]) == 16
    s = kv.stats()
    assert s.prefix_hits == 15 * shared_blocks and s.hit_rate == s.prefix_hits / s.prefix_queries > 0.9
    for r in range(16):
        kv.free(f"r{r}")
    assert run_prefill(kv, "again", prefix + [1]) == 512  # freed blocks stay cached
    kv.check_invariants()


def test_fully_cached_prompt_still_computes_a_token() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=16)
    prompt = list(range(64))
    run_prefill(kv, "a", prompt)
    kv.free("a")
    cached = kv.get_computed_blocks("b", prompt)
    assert cached == 48 and cached < len(prompt)
    assert kv.allocate_slots("b", cached, 16) == []
    kv.commit("b", prompt, 64)  # the last block's hash is held by a's block: b's block stays uncached
    assert kv.pool.block_hash(kv.block_table("b")[3]) is None
    kv.check_invariants()


def test_prefix_caching_off() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    run_prefill(kv, "a", list(range(12)))
    assert kv.get_computed_blocks("b", list(range(12))) == 0
    s = kv.stats()
    assert (s.num_cached, s.prefix_queries, s.hit_rate) == (0, 0, 0.0)
    kv.check_invariants()


def test_fork_copy_on_write_of_partly_filled_block() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    tokens = [5, 6, 7, 8, 9, 10]
    run_prefill(kv, "parent", tokens)
    kv.fork("parent", "child")
    full, partial = kv.block_table("parent")
    assert kv.block_table("child") == [full, partial]
    kv.check_invariants()
    copies = kv.allocate_slots("child", 6, 1)
    assert copies is not None and len(copies) == 1
    src, dst = copies[0]
    assert src == partial and dst not in (full, partial)
    assert kv.block_table("parent") == [full, partial]
    assert kv.block_table("child") == [full, dst]
    assert kv.pool.ref_count(full) == 2 and kv.pool.ref_count(partial) == 1  # full blocks stay shared
    assert kv.allocate_slots("parent", 6, 1) == []  # no longer shared: written in place
    kv.check_invariants()


def test_lru_evicts_least_recently_freed_cached_block() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2)
    for name, tokens in (("a", [1, 1]), ("b", [2, 2]), ("c", [3, 3])):
        kv.get_computed_blocks(name, tokens + [0])
        kv.allocate_slots(name, 0, 2)
        kv.commit(name, tokens + [0], 2)
    hashes = {name: hash_block_tokens(None, [t, t]) for name, t in (("a", 1), ("b", 2), ("c", 3))}
    for name in ("b", "a", "c"):
        kv.free(name)
    assert kv.stats().num_cached == 3 and kv.stats().num_free == 4
    kv.get_computed_blocks("d", [9] * 5)
    kv.allocate_slots("d", 0, 4)  # one never-cached block, then evicts b's (freed first)
    assert kv.pool.lookup(hashes["b"]) is None
    assert kv.pool.lookup(hashes["a"]) is not None and kv.pool.lookup(hashes["c"]) is not None
    kv.allocate_slots("d", 4, 2)  # next: a's
    assert kv.pool.lookup(hashes["a"]) is None and kv.pool.lookup(hashes["c"]) is not None
    kv.check_invariants()


def test_out_of_blocks_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=4)
    run_prefill(kv, "a", list(range(10)))
    kv.fork("a", "b")  # b's next token needs a copy-on-write block
    run_prefill(kv, "c", list(range(100, 110)))
    stats, state, table = kv.stats(), snapshot(kv), kv.block_table("b")
    assert kv.allocate_slots("b", 10, 7) is None  # COW + 1 block > 0 free
    assert kv.allocate_slots("new", 0, 1) is None
    assert kv.stats() == stats and snapshot(kv) == state and kv.block_table("b") == table
    kv.check_invariants()


def test_swap_out_and_in_round_trip() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, num_host_blocks=4)
    run_prefill(kv, "r", list(range(10)))
    kv.fork("r", "sibling")  # r's blocks are shared: their host copies are private
    table = kv.block_table("r")
    out = kv.swap_out("r")
    assert out is not None and [d for d, _ in out] == table and len({h for _, h in out}) == 3
    assert kv.stats().num_swapped_blocks == 3 and kv.stats().num_host_free == 1
    assert kv.num_blocks_needed("r", 10) == 3 and kv.num_blocks_needed("r", 13) == 4
    with pytest.raises(ValueError):
        kv.block_table("r")
    kv.check_invariants()
    back = kv.swap_in("r")
    assert back is not None and [h for h, _ in back] == [h for _, h in out]
    assert kv.block_table("r") == [d for _, d in back] and len(back) == len(table)
    assert kv.stats().num_host_free == 4
    kv.check_invariants()
    assert kv.allocate_slots("r", 10, 1) == []  # private again: no copy-on-write


def test_swap_out_none_when_host_full() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, num_host_blocks=2)
    run_prefill(kv, "r", list(range(10)))
    state = snapshot(kv)
    assert kv.swap_out("r") is None
    assert snapshot(kv) == state
    kv.check_invariants()


def test_swap_in_none_without_device_room() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4, num_host_blocks=3)
    run_prefill(kv, "r", list(range(10)))
    kv.swap_out("r")
    run_prefill(kv, "s", list(range(50, 55)))
    state = snapshot(kv)
    assert kv.swap_in("r") is None and snapshot(kv) == state
    kv.free("r")
    assert kv.stats().num_host_free == 3
    kv.check_invariants()


def test_sliding_window_releases_leading_blocks() -> None:
    """Blocks no later query can see are released (the hashed ones stay cached), swapped and freed without them."""
    kv = KVCacheManager(num_blocks=16, block_size=4, num_host_blocks=8)
    tokens = list(range(30))
    run_prefill(kv, "a", tokens)  # 8 blocks: positions 0..29
    assert kv.release_out_of_window("a", next_position=30, window=10) == 5  # keys < 21 are dead: blocks 0-4
    table = kv.block_table("a")
    assert table[:5] == [NO_BLOCK] * 5 and NO_BLOCK not in table[5:]
    assert kv.stats().num_used == 3 and kv.release_out_of_window("a", 30, 10) == 0  # idempotent
    kv.check_invariants()
    assert run_prefill(kv, "b", tokens[:21]) == 20  # the released blocks still serve the prefix cache
    kv.free("b")
    pairs = kv.swap_out("a")
    assert len(pairs) == 3 and kv.stats().num_swapped_blocks == 3 and kv.num_blocks_needed("a", 30) == 3
    kv.check_invariants()
    assert len(kv.swap_in("a")) == 3 and kv.block_table("a")[:5] == [NO_BLOCK] * 5
    kv.check_invariants()
    assert kv.allocate_slots("a", 30, 3) == [] and len(kv.block_table("a")) == 9
    kv.free("a")
    kv.check_invariants()
    assert kv.stats().num_used == 0


def test_freeing_a_swapped_windowed_request_returns_only_its_host_blocks() -> None:
    """Issue 24 defect 1: a swapped-out request with blocks out of the window is aborted; its dead entries must not
    reach the host free list, or a later swap-out pairs a live block with host block -1 (numpy: the last one,
    another swapped request's)."""
    kv = KVCacheManager(num_blocks=16, block_size=4, num_host_blocks=6)
    run_prefill(kv, "windowed", list(range(20)))  # 5 blocks
    assert kv.release_out_of_window("windowed", next_position=20, window=6) == 3
    kv.swap_out("windowed")  # 2 host blocks
    run_prefill(kv, "other", list(range(50, 62)))
    other = kv.swap_out("other")  # 3 host blocks
    kv.free("windowed")  # aborted while swapped
    assert kv.stats().num_host_free == 3
    kv.check_invariants()
    run_prefill(kv, "late", list(range(80, 92)))
    pairs = kv.swap_out("late")
    assert pairs is not None and len(pairs) == 3
    hosts = [h for _, h in pairs]
    assert NO_BLOCK not in hosts and not set(hosts) & {h for _, h in other}
    kv.check_invariants()


def test_num_blocks_needed() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    assert kv.num_blocks_needed(None, 9) == 3
    run_prefill(kv, "r", list(range(6)))
    assert kv.num_blocks_needed("r", 8) == 0 and kv.num_blocks_needed("r", 9) == 1


# --- the KV cache manager: random lifecycles --------------------------------------------------------------------

@dataclass
class Req:
    tokens: list[int]
    computed: int


class KVCacheMachine(RuleBasedStateMachine):
    """Requests move through admit → allocate/write → commit → fork / swap / preempt / free. ``dev`` and ``host``
    model the KV memory: a slot holds the token id written there, copies move whole blocks."""

    @initialize(num_blocks=st.integers(2, 10), block_size=st.sampled_from([1, 2, 4]), caching=st.booleans(),
                num_host_blocks=st.integers(0, 10))
    def setup(self, num_blocks: int, block_size: int, caching: bool, num_host_blocks: int) -> None:
        self.kv = KVCacheManager(num_blocks, block_size, caching, num_host_blocks)
        self.bs = block_size
        self.dev = np.full((num_blocks, block_size), -1)
        self.host = np.full((num_host_blocks, block_size), -1)
        self.running: dict[str, Req] = {}
        self.swapped: dict[str, tuple[Req, list[int]]] = {}
        self.preempted: list[list[int]] = []
        self.ids = 0

    def _admit(self, tokens: list[int]) -> None:
        req_id, self.ids = f"r{self.ids}", self.ids + 1
        computed = self.kv.get_computed_blocks(req_id, tokens)
        assert computed % self.bs == 0 and 0 <= computed < len(tokens)
        assert self.kv.enable_prefix_caching or computed == 0
        self.running[req_id] = Req(list(tokens), computed)

    @precondition(lambda self: len(self.running) + len(self.swapped) < 6)
    @rule(data=st.data(), suffix=st.lists(st.integers(0, 1), min_size=1, max_size=16))
    def new_request(self, data: st.DataObject, suffix: list[int]) -> None:
        """A new prompt: a random suffix after a prefix of some running request's tokens (or none): prefixes collide."""
        base = data.draw(st.sampled_from([[]] + [r.tokens for _, r in sorted(self.running.items())]))
        self._admit(base[:data.draw(st.integers(0, len(base)))] + suffix)

    @precondition(lambda self: self.preempted)
    @rule(data=st.data())
    def readmit_preempted(self, data: st.DataObject) -> None:
        self._admit(self.preempted.pop(data.draw(st.integers(0, len(self.preempted) - 1))))

    @precondition(lambda self: self.running)
    @rule(data=st.data(), decode_token=st.integers(0, 1), commit=st.booleans())
    def allocate_and_write(self, data: st.DataObject, decode_token: int, commit: bool) -> None:
        self._step(data.draw(st.sampled_from(sorted(self.running))), data, decode_token, commit)

    def _step(self, req_id: str, data: st.DataObject, decode_token: int, commit: bool) -> None:
        """One step for one request: a prompt chunk or a decode token, the copies, the writes, then (as the engine
        does) the commit; the separate commit rule lets a fork or a swap fall between the write and the commit."""
        req, bs = self.running[req_id], self.bs
        decode = req.computed == len(req.tokens)
        if decode:
            req.tokens.append(decode_token)
        n = data.draw(st.integers(1, len(req.tokens) - req.computed))
        table_before, free_before = self.kv.block_table(req_id), self.kv.stats().num_free
        state = snapshot(self.kv)
        copies = self.kv.allocate_slots(req_id, req.computed, n)
        if copies is None:
            cow = req.computed % bs != 0 and self.kv.pool.ref_count(table_before[req.computed // bs]) > 1
            assert self.kv.num_blocks_needed(req_id, req.computed + n) + cow > free_before
            assert snapshot(self.kv) == state
            if decode:
                req.tokens.pop()
            return
        for src, dst in copies:
            self.dev[dst] = self.dev[src]
        table = np.asarray(self.kv.block_table(req_id))
        pos = np.arange(req.computed, req.computed + n)
        self.dev[table[pos // bs], pos % bs] = req.tokens[req.computed:req.computed + n]
        req.computed += n
        if commit:
            self.kv.commit(req_id, req.tokens, req.computed)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        req_id = data.draw(st.sampled_from(sorted(self.running)))
        self.kv.commit(req_id, self.running[req_id].tokens, self.running[req_id].computed)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), decode_token=st.integers(0, 1), step_child=st.booleans())
    def fork(self, data: st.DataObject, decode_token: int, step_child: bool) -> None:
        """Parallel sampling: the child shares the parent's blocks and often decodes at once (copy-on-write)."""
        parent = data.draw(st.sampled_from(sorted(self.running)))
        child, self.ids = f"r{self.ids}", self.ids + 1
        self.kv.fork(parent, child)
        self.running[child] = Req(list(self.running[parent].tokens), self.running[parent].computed)
        if step_child:
            self._step(child, data, decode_token, commit=True)

    @precondition(lambda self: self.running or self.swapped)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        req_id = data.draw(st.sampled_from(sorted(self.running) + sorted(self.swapped)))
        self.kv.free(req_id)
        self.running.pop(req_id, None)
        self.swapped.pop(req_id, None)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt_recompute(self, data: st.DataObject) -> None:
        req_id = data.draw(st.sampled_from(sorted(self.running)))
        self.kv.free(req_id)
        self.preempted.append(self.running.pop(req_id).tokens)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        req_id = data.draw(st.sampled_from(sorted(self.running)))
        table, host_free, state = self.kv.block_table(req_id), self.kv.stats().num_host_free, snapshot(self.kv)
        pairs = self.kv.swap_out(req_id)
        if pairs is None:
            assert len(table) > host_free and snapshot(self.kv) == state
            return
        assert [d for d, _ in pairs] == table
        for d, h in pairs:
            self.host[h] = self.dev[d]
        self.swapped[req_id] = (self.running.pop(req_id), [h for _, h in pairs])

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        req_id = data.draw(st.sampled_from(sorted(self.swapped)))
        free, state = self.kv.stats().num_free, snapshot(self.kv)
        pairs = self.kv.swap_in(req_id)
        req, host_table = self.swapped[req_id]
        if pairs is None:
            assert len(host_table) > free and snapshot(self.kv) == state
            return
        assert [h for h, _ in pairs] == host_table and [d for _, d in pairs] == self.kv.block_table(req_id)
        for h, d in pairs:
            self.dev[d] = self.host[h]
        self.running[req_id] = self.swapped.pop(req_id)[0]

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "kv"):
            return
        self.kv.check_invariants()
        bs = self.bs
        for req_id, req in self.running.items():
            table = np.asarray(self.kv.block_table(req_id), dtype=np.int64)
            assert len(table) == cdiv(req.computed, bs)
            pos = np.arange(req.computed)
            assert (self.dev[table[pos // bs], pos % bs] == req.tokens[:req.computed]).all(), f"{req_id}: wrong KV"
        for req_id, (req, host_table) in self.swapped.items():
            pos = np.arange(req.computed)
            assert (self.host[np.asarray(host_table, dtype=np.int64)[pos // bs], pos % bs]
                    == req.tokens[:req.computed]).all(), f"{req_id}: wrong KV on host"
        s = self.kv.stats()
        assert s.num_free + s.num_used == s.num_blocks and s.num_host_free + s.num_swapped_blocks == self.host.shape[0]

    def teardown(self) -> None:
        if not hasattr(self, "kv"):
            return
        for req_id in [*self.running, *self.swapped]:
            self.kv.free(req_id)
        self.kv.check_invariants()
        s = self.kv.stats()
        assert s.num_free == s.num_blocks and s.num_used == 0
        assert s.num_host_free == self.host.shape[0] and s.num_swapped_blocks == 0


KVCacheMachine.TestCase.settings = settings(max_examples=400, stateful_step_count=40, deadline=None, database=None)
test_kv_cache_state_machine = KVCacheMachine.TestCase
