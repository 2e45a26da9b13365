"""The scheduler and the KV cache manager with a tier below the pool: loads on admission, write-through pins,
aborts during a load, and hypothesis fuzzes of whole lifecycles with the KV invariants checked after every step —
against a stand-in tier, and against the real controller (files, writer and loader threads) over the fake pool.

:class:`SlowTier` is a stand-in for runtime/hicache's controller (the real one, with files and threads, is tested
in test_hicache.py and test_hicache_storage.py): it keeps block contents in LRU order within a capacity, finishes
writes and loads a random number of steps later, and may lose a block (evicted or corrupt) mid-load. It copies
the token ids of :class:`test_scheduler.FakeStep`'s pool, so a load that put the wrong KV anywhere — or a pinned
block rewritten before its write finished — shows up when the step reads every scheduled context back.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_scheduler import EOS, FakeStep, make, request, step

from omforge.contract import cdiv
from omforge.runtime.hicache.connectors import HostTierConnector, StorageConnector
from omforge.runtime.hicache.controller import HiCache
from omforge.runtime.hicache.host_tier import HostTier
from omforge.runtime.hicache.identity import BlockLayout, BundleIdentity
from omforge.runtime.hicache.storage import FileTier
from omforge.runtime.kv_cache_manager import KVCacheManager
from omforge.runtime.request import Request, Status
from omforge.runtime.sampling_params import SamplingParams
from omforge.runtime.scheduler import Scheduler


@dataclass
class Job:
    key: str
    hashes: list[bytes]
    blocks: list[int]
    due: int
    loaded: int = 0


class SlowTier:
    """The scheduler's TierLoader plus write-through, over a dict of block contents (module docstring)."""

    def __init__(self, fake: FakeStep, rng: random.Random, capacity: int, loss: float = 0.0, queue: int = 8):
        self.fake, self.rng, self.capacity, self.loss, self.queue = fake, rng, capacity, loss, queue
        self.store: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self.loads: list[Job] = []
        self.writes: list[tuple[int, int, bytes]] = []  # (due, block, hash)
        self.now = 0
        self.taken = self.skipped = self.dropped = 0

    def busy(self) -> bool:
        return bool(self.loads or self.writes)

    def match(self, hashes: list[bytes]) -> int:
        n = 0
        while n < len(hashes) and hashes[n] in self.store:
            n += 1
        return n

    def worth_loading(self, num_blocks: int) -> bool:
        return self.rng.random() < 0.8

    def record(self, lookups: int, hits: int, decision: str | None) -> None:
        self.taken += decision == "taken"
        self.skipped += decision == "skipped"

    def start_load(self, key: str, hashes: list[bytes], blocks: list[int]) -> Job:
        job = Job(key, list(hashes), list(blocks), self.now + self.rng.randint(0, 3))
        self.loads.append(job)
        return job

    def finished_loads(self) -> list[Job]:
        done = [j for j in self.loads if j.due <= self.now]
        self.loads = [j for j in self.loads if j.due > self.now]
        for job in done:
            for block_hash, block in zip(job.hashes, job.blocks):
                if block_hash not in self.store or self.rng.random() < self.loss:
                    break  # evicted since the match, or a bad file: a miss from here on
                self.fake.pool[block] = self.store[block_hash]
                self.store.move_to_end(block_hash)
                job.loaded += 1
        return done

    def finished_writes(self) -> list[int]:
        """A step passed: finish the due writes (copying the pinned block as it is NOW); their blocks to unpin."""
        self.now += 1
        due = [w for w in self.writes if w[0] <= self.now]
        self.writes = [w for w in self.writes if w[0] > self.now]
        for _, block, block_hash in due:
            self.store[block_hash] = self.fake.pool[block].copy()
            self.store.move_to_end(block_hash)
            while len(self.store) > self.capacity:
                self.store.popitem(last=False)
        return [block for _, block, _ in due]

    def offer_writes(self, pairs: list[tuple[int, bytes]]) -> list[int]:
        """Queue the blocks the tier lacks, within the queue's bound; the caller pins those returned."""
        queued = []
        for block, block_hash in pairs:
            if block_hash in self.store:
                continue
            if len(self.writes) >= self.queue:
                self.dropped += 1
                continue
            self.writes.append((self.now + self.rng.randint(0, 4), block, block_hash))
            queued.append(block)
        return queued

    def wait(self, timeout: float) -> None:
        pass

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        pass

    def after_step(self, kv: KVCacheManager) -> None:
        self.connector.after_step(0, 0.0, idle=False)


def tiered(blocks: int, block_size: int, rng: random.Random, capacity: int = 64, loss: float = 0.0,
           **config: object) -> tuple[Scheduler, FakeStep, SlowTier]:
    s, fake = make(blocks, block_size, caching=True, events=True, **config)
    tier = SlowTier(fake, rng, capacity, loss)
    tier.connector = StorageConnector(tier, s.kv)
    s.connectors = [tier.connector]
    return s, fake, tier


def run(s: Scheduler, fake: FakeStep, tier: SlowTier, steps: int = 400) -> None:
    for _ in range(steps):
        if not s.has_unfinished() and not tier.busy():
            return
        step(s, fake)
        tier.after_step(s.kv)
        s.kv.check_invariants()
    raise AssertionError("not finished within the step bound")


def test_a_prefix_evicted_from_the_pool_is_loaded_not_recomputed() -> None:
    """Request a computes 12 prompt tokens (3 blocks of 4) and finishes; b and c evict its blocks from the
    8-block pool; a's prompt again loads 2 blocks (the third holds its last token, which is always computed)
    instead of prefilling them, and its context reads back through the loaded blocks."""
    s, fake, tier = tiered(8, 4, random.Random(0))
    a = request("a", 12, max_tokens=2, seed=1)
    s.add(a)
    run(s, fake, tier)
    for rid, seed in (("b", 2), ("c", 3)):
        s.add(request(rid, 12, max_tokens=2, seed=seed))
        run(s, fake, tier)
    assert not s.kv.get_computed_blocks("probe", a.prompt_token_ids)  # evicted from the pool
    s.kv.free("probe")
    again = Request("a2", a.prompt_token_ids, a.params)
    s.add(again)
    plan = s.schedule()
    assert not plan.scheduled and again.status is Status.WAITING_FOR_REMOTE_KV and s.loading  # loading, not computing
    tier.now += 5
    plan = step(s, fake)  # the load ended: it joins RUNNING with 8 tokens computed and prefills the last 4
    assert [(x.request.request_id, x.start, x.num_new_tokens) for x in plan.scheduled] == [("a2", 8, 4)]
    assert again.num_cached_tokens == 8 and tier.taken == 1
    run(s, fake, tier)
    assert again.output_token_ids == [7, 7] and s.kv.stats().num_free == 8


def test_a_block_lost_mid_load_is_computed_and_an_aborted_load_frees_its_blocks_when_it_ends() -> None:
    s, fake, tier = tiered(8, 4, random.Random(0), loss=1.0)  # every block fails its checks
    a = request("a", 13, max_tokens=1, seed=1)
    s.add(a)
    run(s, fake, tier)
    for rid, seed in (("b", 2), ("c", 3)):  # a's blocks leave the pool
        s.add(request(rid, 13, max_tokens=1, seed=seed))
        run(s, fake, tier)
    lost = Request("a2", a.prompt_token_ids, a.params)
    s.add(lost)
    s.schedule()
    assert lost.status is Status.WAITING_FOR_REMOTE_KV
    tier.now += 5
    plan = step(s, fake)
    assert [(x.start, x.num_new_tokens) for x in plan.scheduled] == [(0, 13)]  # nothing loaded: all computed
    run(s, fake, tier)
    for rid, seed in (("b2", 2), ("c2", 3)):
        s.add(request(rid, 13, max_tokens=1, seed=seed))
        run(s, fake, tier)
    tier.loss = 0.0
    gone = Request("a3", a.prompt_token_ids, a.params)
    s.add(gone)
    s.schedule()
    assert gone.status is Status.WAITING_FOR_REMOTE_KV
    held = s.kv.stats().num_used
    s.finish(gone, "abort")  # the loader still writes its blocks: they stay held until the load ends
    assert s.kv.stats().num_used == held and s.has_unfinished() and gone.status is Status.FINISHED
    tier.now += 5
    step(s, fake)
    assert not s.has_unfinished() and s.kv.stats().num_used == len(tier.writes)  # only pins left
    run(s, fake, tier)
    assert s.kv.stats().num_free == 8


@st.composite
def cases(draw: st.DrawFn) -> dict:
    block_size = draw(st.sampled_from([2, 4]))
    reqs = draw(st.lists(st.tuples(st.integers(4, 24), st.integers(1, 6), st.integers(0, 60), st.integers(0, 4)),
                         min_size=1, max_size=16))
    longest = max(cdiv(p + m, block_size) for p, m, *_ in reqs)
    return dict(block_size=block_size, reqs=reqs, seed=draw(st.integers(0, 2**16)),
                blocks=draw(st.integers(longest + 1, longest + 6)), budget=draw(st.integers(4, 32)),
                max_num_seqs=draw(st.integers(2, 6)), capacity=draw(st.integers(4, 64)),
                loss=draw(st.sampled_from([0.0, 0.1, 0.5])), mode=draw(st.sampled_from(["recompute", "swap"])),
                aborts=draw(st.lists(st.integers(0, 60), max_size=6)))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_fuzz_lifecycles_with_a_tier_keep_the_invariants(case: dict) -> None:
    """Requests drawn from five shared prompt families (so prefixes are evicted and come back), arriving over
    time, some aborted (also while loading), on a small pool with preemption, the tier slow, bounded and lossy.
    After every step: each scheduled context reads back its own tokens (loaded blocks included), the KV
    invariants hold with pins and loads, seats are within max_num_seqs and each request is in one queue; at the
    end every request finished, nothing is pinned or loading, and every block is free."""
    rng = random.Random(case["seed"])
    s, fake, tier = tiered(case["blocks"], case["block_size"], rng, case["capacity"], case["loss"],
                           max_num_seqs=case["max_num_seqs"], max_num_batched_tokens=case["budget"],
                           preemption_mode=case["mode"], host=8)
    lifecycle(s, fake, tier.after_step, tier.busy, case, rng)


def lifecycle(s: Scheduler, fake: FakeStep, after: object, busy: object, case: dict, rng: random.Random) -> None:
    """Run one fuzz case; ``after(kv)`` follows each step (the tier's write-through), ``busy()``: tier I/O left."""
    families = [[rng.randrange(3, 40) for _ in range(24)] for _ in range(5)]
    live: list[Request] = []
    for t in range(800):
        for i, (n_prompt, max_tokens, arrive, family) in enumerate(case["reqs"]):
            if arrive == t:
                req = Request(str(i), families[family][:n_prompt], SamplingParams(max_tokens=max_tokens))
                s.add(req)
                live.append(req)
        if t in case["aborts"] and live:
            victim = rng.choice(live)
            if not victim.finished:
                s.finish(victim, "abort")
        if t > 60 and not s.has_unfinished() and not busy():
            break
        step(s, fake, tokens=lambda r: EOS if rng.random() < 0.1 else rng.randrange(3, 40))
        after(s.kv)
        s.kv.check_invariants()
        assert sum(1 + len(r.followers) for r in (*s.running, *s.loading.values()) if not r.finished) \
            <= s.max_num_seqs
        queues = [*s.waiting, *s.running, *s.swapped, *(r for r in s.loading.values() if not r.finished)]
        assert len({id(r) for r in queues}) == len(queues) and not any(r.finished for r in queues)
    assert not s.has_unfinished() and not busy()
    assert all(r.finished for r in live)
    assert s.kv.stats().num_free == case["blocks"]


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(case=cases())
def test_fuzz_lifecycles_with_the_real_controller_keep_the_invariants(
        case: dict, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The same lifecycles with runtime/hicache's own controller: block files in a directory within a budget of
    ``capacity`` blocks, the writer reading pinned pool blocks and the loader writing reserved ones from their
    threads while steps run. Reading every context back checks the pins held (a block rewritten before its write
    finished would load wrong tokens later) and that nothing is read before its load is installed."""
    rng = random.Random(case["seed"])
    bs = case["block_size"]
    s, fake = make(case["blocks"], bs, caching=True, events=True, max_num_seqs=case["max_num_seqs"],
                   max_num_batched_tokens=case["budget"], preemption_mode=case["mode"], host=8)
    layout = BlockLayout(block_size=bs, num_layers=1, kv_heads=1, row_elems=1, kv_dtype="float32", itemsize=4)
    ident = BundleIdentity(b"\x07" * 32, "fake", layout)  # the fake pool's int64 slot = two 4-byte "pools"

    def views(block: int) -> list[memoryview]:
        raw = memoryview(fake.pool[block]).cast("B")
        return [raw[:4 * bs], raw[4 * bs:]]

    storage = FileTier(tmp_path_factory.mktemp("tier"), ident, case["capacity"] * (layout.block_bytes + 4096) + 1)
    hicache = HiCache(storage, views, bs, write_queue_blocks=8)
    connector = StorageConnector(hicache, s.kv)
    s.connectors = [connector]
    try:
        lifecycle(s, fake, lambda kv: connector.after_step(0, 0.0, idle=False) or hicache.wait(0.001),
                  lambda: hicache.busy() or bool(s.loading), case, rng)
        for _ in range(200):  # the last writes: the server loop's idle steps do the same
            if not hicache.busy():
                break
            connector.after_step(0, 0.0, idle=True)
        assert not hicache.busy() and s.kv.stats().num_free == case["blocks"]
        assert storage.num_bytes <= storage.capacity
    finally:
        hicache.close()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_fuzz_lifecycles_with_a_host_tier_keep_the_invariants(case: dict) -> None:
    """The same lifecycles over a pool in "device memory" with runtime/hicache's host tier below it (a swap tier
    of 8 blocks first, then ``capacity`` slots): evictions are written back and hits copied in by the step plans.
    Reading every context back checks that no write-back ran after its block was rewritten, no hit read a slot a
    write-back of the same plan overwrote, and no block was read before its copy."""
    rng = random.Random(case["seed"])
    s, _ = make(case["blocks"], case["block_size"], caching=True, events=True, max_num_seqs=case["max_num_seqs"],
                max_num_batched_tokens=case["budget"], preemption_mode=case["mode"], host=8)
    fake = FakeStep(case["blocks"], case["block_size"], num_host_blocks=8 + case["capacity"])
    host = HostTier(base=8, num_slots=case["capacity"], block_bytes=1)
    s.connectors = [HostTierConnector(host, case["block_size"])]

    def after(kv: KVCacheManager) -> None:
        host.check_invariants()

    lifecycle(s, fake, after, lambda: False, case, rng)


def test_a_host_tier_writes_evictions_back_and_copies_a_hit_in_with_the_admitting_plan() -> None:
    """a (12 tokens, 3 blocks of 4) finishes; b and c evict a's second and third blocks, which the plans write
    back to host slots. a's prompt again: its first block is a pool hit, its second comes from the host tier in
    the plan that admits it (the third holds the last prompt token, always computed)."""
    s, _ = make(8, 4, caching=True, events=True)
    fake = FakeStep(8, 4, num_host_blocks=4)
    host = HostTier(base=0, num_slots=4, block_bytes=1)
    s.connectors = [HostTierConnector(host, 4)]
    a = request("a", 12, max_tokens=2, seed=1)
    for req in (a, request("b", 12, max_tokens=2, seed=2), request("c", 12, max_tokens=2, seed=3)):
        s.add(req)
        for _ in range(10):
            if not s.has_unfinished():
                break
            step(s, fake)
    assert host.stats.stored == 2 and s.kv.get_computed_blocks("probe", a.prompt_token_ids) == 4
    s.kv.free("probe")
    again = Request("a2", a.prompt_token_ids, a.params)
    s.add(again)
    plan = step(s, fake)  # reads a2's context back: the pool hit, the copied block and the prefilled last one
    assert len(plan.swap_in) == 1 and [(x.start, x.num_new_tokens) for x in plan.scheduled] == [(8, 4)]
    assert again.num_cached_tokens == 8 and host.stats.hits == 1
