"""PD legs under the scheduler: a prefill replica's scheduler and a decode replica's in one process, their PD
connectors over the FAKE NIXL fabric (tests/fake_nixl.py), their pools the fake step's token-id pools — so a
read that copied the wrong blocks shows up when the step reads every scheduled context back. Each test is one of
issue 45's defects (it failed at f2437b2)."""

from __future__ import annotations

from fake_nixl import Fabric, FakeAgent
from test_scheduler import FakeStep, make, step

from omforge.contract import PagedLayout
from omforge.runtime.hicache.connectors import StorageConnector
from omforge.runtime.kv_cache_manager import hash_block_tokens
from omforge.runtime.kv_transfer.config import parse_kv_transfer_config
from omforge.runtime.kv_transfer.connector import PDConnector
from omforge.runtime.kv_transfer.params import KVTransferParams, parse_kv_transfer_params
from omforge.runtime.request import Request
from omforge.runtime.sampling_params import SamplingParams
from omforge.runtime.scheduler import Scheduler, SchedulerOutput

BS = 4
LEASE_S = 30.0


def connector(fabric: Fabric, role: str, engine_id: str, fake: FakeStep, policy: str = "fail") -> PDConnector:
    config = parse_kv_transfer_config({"kv_connector": "NixlConnector", "kv_role": role, "engine_id": engine_id,
                                       "kv_load_failure_policy": policy,
                                       "kv_connector_extra_config": {"kv_lease_duration": LEASE_S}})
    layout = PagedLayout(num_layers=1, kv_heads=1, head_dim=1, block_size=BS)
    return PDConnector(config, FakeAgent(fabric, engine_id, layout, [fake.pool]), BS, "127.0.0.1", 1,
                       clock=fabric.clock)


def replica(fabric: Fabric, role: str, engine_id: str, blocks: int = 32, policy: str = "fail",
            **config: object) -> tuple[Scheduler, FakeStep, PDConnector]:
    s, fake = make(blocks, BS, caching=True, events=True, **config)
    pd = connector(fabric, role, engine_id, fake, policy)
    s.connectors = [pd]
    return s, fake, pd


def prompt(n: int, seed: int = 0) -> list[int]:
    return [3 + (seed * 7 + i * 5) % 40 for i in range(n)]


def prefill(s: Scheduler, fake: FakeStep, tokens: list[int], rid: str = "r") -> dict:
    """A prefill leg (max_tokens 1, as vLLM's and SMG's proxies send it) run to its end: its answer."""
    leg = Request(rid, tokens, SamplingParams(max_tokens=1, ignore_eos=True),
                  kv_transfer=KVTransferParams(do_remote_decode=True))
    s.add(leg)
    for _ in range(20):
        if leg.finished:
            break
        step(s, fake)
    assert leg.finish_reason == "length" and leg.kv_transfer_out is not None
    return leg.kv_transfer_out


def decode_leg(rid: str, tokens: list[int], answer: dict, fabric: Fabric, max_tokens: int = 8,
               n: int = 1) -> Request:
    params = parse_kv_transfer_params(answer)
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    leader = Request(rid, tokens, sp, kv_transfer=params, arrival_time=fabric.now)
    for i in range(1, n):
        follower = Request(f"{rid}-{i}", tokens, sp, kv_transfer=params, arrival_time=fabric.now, parent=leader,
                           index=i)
        leader.followers.append(follower)
    return leader


def drain(s: Scheduler, fake: FakeStep, steps: int = 100) -> None:
    for _ in range(steps):
        if not s.has_unfinished():
            return
        step(s, fake)
        s.kv.check_invariants()
    raise AssertionError("not finished within the step bound")


def test_a_stop_string_after_a_prefill_legs_length_finish_ends_it_once() -> None:
    """Defect 1: the engine's detokenizer finds a stop string in the one token of a prefill leg that already
    finished with "length" and finishes it again with "stop": the leg keeps its one hold (at f2437b2 the second
    hold raised "already holds blocks" and killed the engine thread) and the decode side still reads it."""
    fabric = Fabric()
    p, pf, _ = replica(fabric, "kv_producer", "prefill-0")
    d, df, _ = replica(fabric, "kv_consumer", "decode-0")
    tokens = prompt(13)
    leg = Request("r", tokens, SamplingParams(max_tokens=1, ignore_eos=True),
                  kv_transfer=KVTransferParams(do_remote_decode=True))
    p.add(leg)
    step(p, pf)
    assert leg.finish_reason == "length"
    held = p.kv.stats().num_used
    p.finish(leg, "stop", "the stop string")
    assert leg.finish_reason == "stop" and p.kv.stats().num_used == held == 4
    d.add(decode_leg("r", tokens, leg.kv_transfer_out, fabric))
    drain(d, df)
    drain(p, pf)
    assert p.kv.stats().num_used == 0 and d.kv.stats().num_used == 0


def test_a_decode_leg_preempted_for_recompute_computes_here_and_never_reads_again() -> None:
    """Defect 2: after its read the decode leg is preempted for recompute; it comes back computing from its
    local prefix cache, and never reads the prefill side's blocks again (they were released by the first read's
    notification; at f2437b2 it read them again — another request's KV by then — or, with its outputs filling a
    block past the prompt, crashed on ``cannot allocate -1 blocks``)."""
    fabric = Fabric()
    p, pf, _ = replica(fabric, "kv_producer", "prefill-0")
    d, df, _ = replica(fabric, "kv_consumer", "decode-0")
    tokens = prompt(12)
    leg = decode_leg("r", tokens, prefill(p, pf, tokens), fabric, max_tokens=12)
    d.add(leg)
    while len(leg.output_token_ids) < 6:
        step(d, df)
    d._preempt(leg, SchedulerOutput())
    drain(d, df)
    assert len(fabric.reads) == 1 and len(leg.output_token_ids) == 12


def test_a_follower_of_a_decode_leg_preempted_for_recompute_never_reads() -> None:
    """Defect 2 for n > 1 (found by the lifecycle fuzz): a follower forks its leader's read blocks; preempted for
    recompute later, it computes here — it carries the leg's kv_transfer_params too, and must not read them."""
    fabric = Fabric()
    p, pf, _ = replica(fabric, "kv_producer", "prefill-0")
    d, df, _ = replica(fabric, "kv_consumer", "decode-0")
    tokens = prompt(13)
    leg = decode_leg("r", tokens, prefill(p, pf, tokens), fabric, max_tokens=8, n=2)
    follower = leg.followers[0]
    d.add(leg)
    while len(follower.output_token_ids) < 3:
        step(d, df)
    d._preempt(follower, SchedulerOutput())
    drain(d, df)
    assert len(fabric.reads) == 1 and follower.output_token_ids == leg.output_token_ids


def test_blocks_read_then_preempted_in_the_same_plan_are_never_written_through_with_another_requests_kv() -> None:
    """Defect 3: a decode leg's read ends in the plan that preempts it for an older request, which evicts one of
    its just-committed blocks and writes its own tokens there. Every block the storage tier is then asked to write
    under a hash holds that hash's tokens (at f2437b2 the write-through list still named the evicted block)."""
    fabric = Fabric()
    p, pf, _ = replica(fabric, "kv_producer", "prefill-0")
    d, df, pd = replica(fabric, "kv_consumer", "decode-0", blocks=8, max_num_batched_tokens=8)
    recorder = RecordingController()
    d.connectors = [pd, StorageConnector(recorder, d.kv)]
    tokens, older = prompt(13, 1), Request("x", prompt(24, 2), SamplingParams(max_tokens=2, ignore_eos=True))
    answer = prefill(p, pf, tokens)
    fabric.delay = 5.0
    leg = decode_leg("r", tokens, answer, fabric, max_tokens=2)
    d.add(leg)
    d.add(older)
    step(d, df)  # the leg reserves 4 blocks and starts its read; x prefills 8 tokens
    step(d, df)  # x: 8 more; the pool is full
    fabric.now += 5.0
    names = {}
    for req in (leg, older):
        parent = None
        for i in range(len(req.all_token_ids) // BS):
            chunk = req.all_token_ids[i * BS:(i + 1) * BS]
            parent = hash_block_tokens(parent, chunk)
            names[parent] = chunk
    for _ in range(40):
        if not d.has_unfinished():
            break
        step(d, df)
        d.connectors[1].after_step(0, 0.0, idle=False)
        offered, recorder.offered = recorder.offered, []
        for block, block_hash in offered:
            assert list(df.pool[block]) == names[block_hash], (block, df.pool[block], names[block_hash])
    assert leg.finished and older.finished and leg.num_preemptions == 1


class RecordingController:
    """The storage controller's surface the storage connector uses: holds nothing, records the writes offered."""

    def __init__(self) -> None:
        self.offered: list[tuple[int, bytes]] = []

    def match(self, hashes: list[bytes]) -> int:
        return 0

    def record(self, lookups: int, hits: int, decision: str | None) -> None:
        pass

    def finished_loads(self) -> list:
        return []

    def finished_writes(self) -> list[int]:
        return []

    def offer_writes(self, pairs: list[tuple[int, bytes]]) -> list[int]:
        self.offered += pairs
        return []  # nothing queued, nothing to pin

    def busy(self) -> bool:
        return False

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        pass


def test_a_read_that_ends_after_the_prefill_sides_lease_is_refused() -> None:
    """Defect 4: the prefill side frees held blocks when their lease runs out, read or not; a read started at
    27.5 s of the 30 s lease that ends at 31.0 s copied freed blocks, and at f2437b2 it was accepted."""
    fabric = Fabric()
    p, pf, _ = replica(fabric, "kv_producer", "prefill-0")
    d, df, _ = replica(fabric, "kv_consumer", "decode-0")
    tokens = prompt(13)
    leg = decode_leg("r", tokens, prefill(p, pf, tokens), fabric)
    fabric.now, fabric.delay = 27.5, 3.5
    d.add(leg)
    step(d, df)  # waited 27.5 s: within the lease less its margin, the read starts
    assert len(fabric.reads) == 1
    fabric.now = 31.0
    step(d, df)
    assert leg.finished and leg.error and "lease" in leg.error
    assert d.kv.stats().num_used == 0


def test_one_bad_read_does_not_fail_the_other_reads_from_that_prefill_engine() -> None:
    """Defect 5: a decode leg whose read fails locally (block ids the prefill pool does not have) must not drop the
    peer: another read from the same prefill engine in flight still succeeds (at f2437b2 the peer was removed on
    any failure and every other in-flight READ from it failed NIXL_ERR_NOT_FOUND)."""
    fabric = Fabric(delay=1.0)
    p, pf, _ = replica(fabric, "kv_producer", "prefill-0")
    d, df, _ = replica(fabric, "kv_consumer", "decode-0")
    good_tokens, bad_tokens = prompt(13, 1), prompt(13, 2)
    good = decode_leg("good", good_tokens, prefill(p, pf, good_tokens, "good"), fabric)
    answer = dict(prefill(p, pf, bad_tokens, "bad"), remote_block_ids=[900, 901, 902, 903])
    bad = decode_leg("bad", bad_tokens, answer, fabric)
    d.add(good)
    step(d, df)
    d.add(bad)
    step(d, df)
    fabric.now += 1.0
    drain(d, df)
    assert bad.error and not good.error and len(good.output_token_ids) == 8


def test_a_failed_read_of_an_n_greater_than_1_decode_leg_ends_its_followers_too() -> None:
    """Defect 6: the read of an n = 2 decode leg fails: its follower ends with it, with the same error (at f2437b2
    only the leader failed and the follower stayed in the engine's requests forever)."""
    fabric = Fabric()
    p, pf, _ = replica(fabric, "kv_producer", "prefill-0")
    d, df, _ = replica(fabric, "kv_consumer", "decode-0")
    tokens = prompt(13)
    answer = prefill(p, pf, tokens)
    del fabric.agents["prefill-0"]  # the prefill replica is gone
    leg = decode_leg("r", tokens, answer, fabric, n=2)
    d.add(leg)
    drain(d, df)
    follower = [r for r in d.failed if r.request_id == "r-1"]
    assert leg.finished and leg.error and follower and follower[0].finished and follower[0].error == leg.error
    assert d.kv.stats().num_used == 0


def test_a_read_nixl_cannot_cancel_keeps_only_its_own_blocks_until_nixl_lets_go() -> None:
    """Defect 7: a read past its deadline that NIXL cannot cancel: only the blocks it may still write are kept
    (not the leg's prefix-cache hits), admission sizes requests to the blocks left, and once NIXL releases the
    read the blocks come back — a request that needs the whole pool then runs (at f2437b2 the whole table was
    quarantined for the process's life and that request waited at the queue head forever)."""
    fabric = Fabric()
    p, pf, _ = replica(fabric, "kv_producer", "prefill-0")
    d, df, _ = replica(fabric, "kv_consumer", "decode-0", blocks=8)
    tokens = prompt(13)
    d.add(Request("warm", tokens[:8] + [1], SamplingParams(max_tokens=1, ignore_eos=True)))
    drain(d, df)  # the decode side's prefix cache holds the prompt's first two blocks
    fabric.delay = 1000.0
    leg = decode_leg("r", tokens, prefill(p, pf, tokens), fabric)
    d.add(leg)
    step(d, df)
    read = fabric.reads[-1]
    assert len(read.local) == 2  # only the blocks past the prefix hit are read
    read.stuck = True
    fabric.now += LEASE_S + 1
    step(d, df)
    assert leg.finished and leg.error and d.kv.pool.num_usable() == 6
    d.kv.reset_prefix_cache()  # nothing in flight: the cached blocks go, the stuck read's stay retired
    assert d.kv.stats().num_used == 2 and d.kv.stats().num_cached == 0
    big = Request("big", prompt(31, 3), SamplingParams(max_tokens=1, ignore_eos=True))  # all 8 blocks
    d.add(big)
    for _ in range(5):
        step(d, df)
    assert not big.finished and d.kv.stats().num_used == 2  # the stuck read's two blocks only
    read.stuck = False
    drain(d, df)
    assert big.finished and not big.error and d.kv.stats().num_used == 0
