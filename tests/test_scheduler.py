"""The scheduler on its own, with a fake step (no bundle, no model, no torch): budgets, max_num_seqs, chunked
prefill, the prefill cap beside decodes, preemption order, swap round trips, n > 1 forks, token-level stops, and
a hypothesis fuzz of whole lifecycles with the invariants checked after every step.

:class:`FakeStep` is an :class:`~omforge.runtime.executor.Executor` whose "KV pools" hold the token id written at
each slot, so that block moves (copy-on-write, swap out / in, prefix-cache hits, forks) are checked by reading
every scheduled request's context back through its block table after the step ran.
"""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omforge.contract import cdiv
from omforge.runtime.executor import Executor, ExecutorCapabilities, run_plan
from omforge.runtime.kv_cache_manager import NO_BLOCK, KVCacheManager
from omforge.runtime.request import Request, Status
from omforge.runtime.sampling_params import SamplingParams
from omforge.runtime.scheduler import (
    MIN_PREFILL_WITH_DECODES,
    MIN_TIMED_PREFILL,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)

EOS = 2


class FakeStep:
    """Pools of token ids (-1: never written); ``execute`` writes each item's tokens at its slots."""

    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int = 0, mixed: bool = True):
        self.block_size = block_size
        self.pool = np.full((num_blocks, block_size), -1, np.int64)
        self.host = np.full((max(num_host_blocks, 1), block_size), -1, np.int64)
        self.capabilities = ExecutorCapabilities(supports_mixed_batches=mixed)
        self.closed = False

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        for src, dst in pairs:
            self.pool[dst] = self.pool[src]

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        for dev, host in pairs:
            self.host[host] = self.pool[dev]

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        for host, dev in pairs:
            self.pool[dev] = self.host[host]

    def execute(self, work) -> np.ndarray:  # noqa: ANN001 - Sequence[SeqWork]
        bs = self.block_size
        for w in work:
            for i, token in enumerate(w.token_ids):
                pos = w.start + i
                self.pool[w.block_table[pos // bs], pos % bs] = token
        return np.zeros((sum(w.needs_logits for w in work), 8), np.float32)

    def close(self) -> None:
        self.closed = True

    def context(self, table: list[int], n: int) -> list[int | None]:
        """The tokens stored at positions 0..n-1 through ``table`` (None: a block released out of the window)."""
        bs = self.block_size
        return [None if table[p // bs] == NO_BLOCK else int(self.pool[table[p // bs], p % bs]) for p in range(n)]


def make(blocks: int = 64, block_size: int = 4, *, caching: bool = False, host: int = 0, events: bool = False,
         **config: object) -> tuple[Scheduler, FakeStep]:
    config.setdefault("max_num_seqs", 16)
    config.setdefault("max_num_batched_tokens", 64)
    config.setdefault("mixed_batches", True)
    config.setdefault("eos_token_ids", (EOS,))
    kv = KVCacheManager(blocks, block_size, enable_prefix_caching=caching, num_host_blocks=host,
                        record_events=events)
    fake = FakeStep(blocks, block_size, host, mixed=bool(config["mixed_batches"]))
    return Scheduler(kv, SchedulerConfig(**config)), fake  # type: ignore[arg-type]


def request(rid: str, n_prompt: int, max_tokens: int = 100, seed: int = 0, **params: object) -> Request:
    rng = random.Random(seed)
    return Request(rid, [rng.randrange(3, 50) for _ in range(n_prompt)],
                   SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params))  # type: ignore[arg-type]


def step(s: Scheduler, fake: FakeStep, tokens: object = 7, verify: object = None) -> SchedulerOutput:
    """One whole step: plan, fake execution, the context of every scheduled request read back, update.
    ``verify(request)``: for a speculating request, the tokens it keeps (accepted drafts + one)."""
    plan = s.schedule()
    logits = run_plan(fake, plan)
    assert (logits is None) == (not plan.scheduled)
    for sch in plan.scheduled:
        req = sch.request
        n = sch.start + sch.num_new_tokens
        got = fake.context(s.kv.block_table(req.request_id), n)
        want = req.all_token_ids[:n]
        assert all(g is None or g == w for g, w in zip(got, want)), (req.request_id, got, want)
    picks = [tokens(r) if callable(tokens) else tokens for r, _ in plan.sample_rows]
    verified = {r.request_id: verify(r) for r, _, _ in plan.spec_rows} if verify is not None else None
    s.update_from_output(plan, picks, verified)
    return plan


def shape(plan: SchedulerOutput) -> list[tuple[str, int]]:
    return [(x.request.request_id, x.num_new_tokens) for x in plan.scheduled]


def test_fake_step_is_an_executor() -> None:
    assert isinstance(make()[1], Executor)


def test_chunked_prefill_within_the_budget_then_decodes() -> None:
    s, fake = make(max_num_batched_tokens=32)
    s.add(request("a", 100))
    assert [shape(step(s, fake)) for _ in range(5)] == [[("a", 32)], [("a", 32)], [("a", 32)], [("a", 4)], [("a", 1)]]
    a = s.running[0]
    assert a.num_computed_tokens == 101 and a.output_token_ids == [7, 7]


def test_prefill_beside_decodes_is_capped() -> None:
    s, fake = make(blocks=256, block_size=16, max_num_batched_tokens=512, max_prefill_tokens_with_decodes=128)
    s.add(request("a", 20))
    s.add(request("b", 20))
    assert shape(step(s, fake)) == [("a", 20), ("b", 20)]  # no decodes yet: the whole budget
    s.add(request("long", 600))
    s.add(request("short", 50))
    assert shape(step(s, fake)) == [("a", 1), ("b", 1), ("long", 128)]  # decodes + at most 128 prefill tokens
    assert shape(step(s, fake)) == [("a", 1), ("b", 1), ("long", 128)]  # the chunk continues; "short" waits
    for _ in range(2):
        step(s, fake)
    # the last of "long" (600 = 4 x 128 + 88); "short" takes the rest of the cap
    assert shape(step(s, fake)) == [("a", 1), ("b", 1), ("long", 88), ("short", 40)]


def test_a_step_with_decodes_keeps_to_the_token_budget() -> None:
    """The default rule ("auto"): decodes first, prefill the rest of 128 tokens — never fewer than
    MIN_PREFILL_WITH_DECODES; a step without decodes takes the whole budget."""
    s, fake = make(blocks=1024, block_size=16, max_num_seqs=200, max_num_batched_tokens=512,
                   decode_step_token_budget=128)
    for i in range(20):
        s.add(request(f"d{i}", 20, max_tokens=1000))
    assert sum(n for _, n in shape(step(s, fake))) == 400  # no decodes yet: the whole budget
    s.add(request("long", 600))
    plan = shape(step(s, fake))
    assert plan[-1] == ("long", 108) and sum(n for _, n in plan) == 128  # 20 decodes + 108
    while s.running[-1].num_tokens - s.running[-1].num_computed_tokens > 1:
        step(s, fake)  # "long" to its end
    for i in range(120):
        s.add(request(f"e{i}", 1, max_tokens=1000))
    while len(s.running) < 141:
        step(s, fake)
    s.add(request("late", 100))
    plan = shape(step(s, fake))
    assert plan[-1] == ("late", MIN_PREFILL_WITH_DECODES)  # 141 decodes: the floor, so prefill still moves
    assert sum(n for _, n in plan) == 141 + MIN_PREFILL_WITH_DECODES


def test_without_cap_or_decodes_the_budget_rules() -> None:
    s, fake = make(blocks=256, block_size=16, max_num_batched_tokens=512)
    s.add(request("a", 20))
    step(s, fake)
    s.add(request("long", 600))
    assert shape(step(s, fake)) == [("a", 1), ("long", 511)]
    s, fake = make(blocks=256, block_size=16, max_num_batched_tokens=512, max_prefill_tokens_with_decodes=64)
    s.add(request("long", 600))
    assert shape(step(s, fake)) == [("long", 512)]  # no decodes in the step: the cap does not apply


def test_without_mixed_batches_decodes_and_prefill_alternate() -> None:
    s, fake = make(mixed_batches=False, max_num_batched_tokens=16)
    s.add(request("a", 4))
    step(s, fake)
    s.add(request("b", 40))
    kinds = [{n for _, n in shape(step(s, fake))} for _ in range(4)]
    assert kinds == [{1}, {16}, {1}, {16}]  # never a decode and a chunk in one step


def test_max_num_seqs_bounds_the_running_set() -> None:
    s, fake = make(max_num_seqs=2)
    for i in range(4):
        s.add(request(str(i), 5, max_tokens=3))
    assert shape(step(s, fake)) == [("0", 5), ("1", 5)]
    step(s, fake)
    assert [r.request_id for r in s.running] == ["0", "1"] and len(s.waiting) == 2
    plan = step(s, fake)  # both reach max_tokens = 3 and free their seats
    assert {r.request_id for r, _ in plan.sample_rows} == {"0", "1"} and not s.running
    assert shape(step(s, fake)) == [("2", 5), ("3", 5)]


def test_recompute_preemption_takes_the_newest_and_keeps_its_output() -> None:
    s, fake = make(blocks=6, block_size=4, max_num_batched_tokens=64)
    for rid in ("old", "mid", "new"):
        s.add(request(rid, 7, max_tokens=12, seed=len(rid)))  # 19 tokens: 5 blocks, each fits alone
    step(s, fake)  # 3 x 2 blocks: the pool is full
    step(s, fake)  # the decodes at position 7 still fit
    new = s.running[-1]
    before = list(new.output_token_ids)
    plan = step(s, fake)  # position 8 needs a third block each: the newest goes, the older two get its blocks
    assert plan.preempted == [new] and shape(plan) == [("old", 1), ("mid", 1)]
    assert new.status is Status.WAITING and s.waiting[0] is new
    assert new.num_computed_tokens == 0 and new.output_token_ids == before and new.num_preemptions == 1
    assert "new" not in {r for r, _ in shape(plan)}  # not re-admitted in the step that preempted it
    for _ in range(200):
        if not s.has_unfinished():
            break
        step(s, fake)
    assert not s.has_unfinished() and len(new.output_token_ids) == 12 and s.kv.stats().num_free == 6


def test_swap_round_trip_restores_the_context() -> None:
    s, fake = make(blocks=6, block_size=4, host=8, preemption_mode="swap")
    for rid in ("a", "b", "c"):
        s.add(request(rid, 7, max_tokens=12, seed=ord(rid)))
    outs, ins = 0, 0
    for _ in range(200):
        if not s.has_unfinished():
            break
        plan = step(s, fake)  # reads every scheduled context back: a lost or misplaced swap fails here
        outs += len(plan.swap_out)
        ins += len(plan.swap_in)
        s.kv.check_invariants()
    assert outs > 0 and ins == outs and not s.has_unfinished()
    assert s.kv.stats().num_host_free == 8 and s.kv.stats().num_free == 6


def test_n_followers_fork_from_the_leader_after_its_prefill() -> None:
    s, fake = make(max_num_seqs=4)
    leader = request("r-0", 10, max_tokens=4)
    followers = [Request(f"r-{i}", leader.prompt_token_ids, leader.params, parent=leader) for i in (1, 2)]
    leader.followers = list(followers)
    s.add(leader)
    plan = step(s, fake, tokens=lambda r: 10 + int(r.request_id[-1]))
    assert shape(plan) == [("r-0", 10)]  # the prompt once
    assert [(r.request_id, row) for r, row in plan.sample_rows] == [("r-0", 0), ("r-1", 0), ("r-2", 0)]
    assert [r.output_token_ids for r in (leader, *followers)] == [[10], [11], [12]]
    tables = [s.kv.block_table(r.request_id) for r in (leader, *followers)]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]  # the two full prompt blocks are shared
    assert shape(step(s, fake)) == [("r-0", 1), ("r-1", 1), ("r-2", 1)]  # copy-on-write of the partial block
    assert len({t[2] for t in (s.kv.block_table(r.request_id) for r in (leader, *followers))}) == 3


def test_n_needs_all_its_seats() -> None:
    s, fake = make(max_num_seqs=3)
    s.add(request("x", 5))
    step(s, fake)
    leader = request("r-0", 5)
    leader.followers = [Request("r-1", leader.prompt_token_ids, leader.params, parent=leader),
                        Request("r-2", leader.prompt_token_ids, leader.params, parent=leader)]
    s.add(leader)
    assert shape(step(s, fake)) == [("x", 1)]  # 1 running + 3 seats > 3: the request waits whole


def test_swap_in_counts_the_followers_seats() -> None:
    """Issue 24 defect 3: an n = 3 leader swapped out before its prefill completed comes back only when its
    followers' seats are free too (swap-in counted the leader alone: 6 running at max_num_seqs = 4)."""
    s, fake = make(blocks=9, host=16, max_num_seqs=4, max_num_batched_tokens=16, preemption_mode="swap")

    def sequences(rid: str, n_prompt: int, max_tokens: int) -> Request:
        leader = request(f"{rid}-0", n_prompt, max_tokens=max_tokens, n=3)
        leader.followers = [Request(f"{rid}-{i}", leader.prompt_token_ids, leader.params, parent=leader)
                            for i in (1, 2)]
        return leader

    s.add(request("a", 20, max_tokens=7))
    b = sequences("b", 16, max_tokens=4)
    s.add(b)  # admitted beside "a" (4 seats), then swapped out mid-prefill as "a" grows
    was_swapped = False
    for t in range(40):
        if t == 1:
            s.add(sequences("c", 2, max_tokens=3))  # runs while "b" is swapped out
        step(s, fake)
        was_swapped |= b in s.swapped
        assert sum(1 + len(r.followers) for r in s.running) <= 4 and len(s.running) <= 4, t
        if not s.has_unfinished():
            break
    assert was_swapped and not s.has_unfinished() and b.finished and len(b.output_token_ids) == 4


@pytest.mark.parametrize("case", ["eos", "min_tokens", "stop_token", "max_tokens", "context"])
def test_token_level_stops(case: str) -> None:
    s, fake = make(max_model_len=12)
    params = {"eos": dict(ignore_eos=False), "min_tokens": dict(ignore_eos=False, min_tokens=3),
              "stop_token": dict(stop_token_ids=[9]), "max_tokens": dict(max_tokens=2),
              "context": dict(max_tokens=None)}[case]
    req = Request("r", [5] * 8, replace(SamplingParams(max_tokens=50, ignore_eos=True), **params))
    s.add(req)
    token = {"eos": EOS, "min_tokens": EOS, "stop_token": 9}.get(case, 7)
    for _ in range(10):
        if req.finished:
            break
        step(s, fake, tokens=token)
    want = {"eos": ("stop", None, 1), "min_tokens": ("stop", None, 3), "stop_token": ("stop", 9, 1),
            "max_tokens": ("length", None, 2), "context": ("length", None, 4)}[case]
    assert (req.finish_reason, req.stop_reason, len(req.output_token_ids)) == want
    assert not s.has_unfinished() and s.kv.stats().num_free == 64


def test_update_needs_one_token_per_sampling_request() -> None:
    s, _ = make()
    s.add(request("a", 3))
    plan = s.schedule()
    with pytest.raises(ValueError, match="1 sampling"):
        s.update_from_output(plan, [])


def test_config_refuses_what_cannot_hold() -> None:
    with pytest.raises(ValueError, match="preemption_mode"):
        SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=8, preemption_mode="evict")
    with pytest.raises(ValueError, match="at least 1"):
        SchedulerConfig(max_num_seqs=0, max_num_batched_tokens=8)


def test_drafts_are_verified_and_only_accepted_tokens_count() -> None:
    """A decoding request with a draft is scheduled as 1 + k tokens; of the verified tokens the accepted drafts
    become computed and the rejected slot is rewritten by the next step (step() reads every context back)."""
    s, fake = make(block_size=4, max_num_batched_tokens=32)
    s.add(request("a", 6))
    step(s, fake)  # the prompt, and the first token (7)
    a = s.running[0]
    a.draft = [11, 12, 13]
    plan = step(s, fake, verify=lambda r: [11, 12, 20])  # two drafts accepted, then the correction 20
    assert [(x.num_new_tokens, x.num_draft) for x in plan.scheduled] == [(4, 3)]
    assert a.output_token_ids == [7, 11, 12, 20] and a.num_computed_tokens == 6 + 3 and not a.draft
    step(s, fake)  # the slot that held the rejected draft 13 now holds 20: read back by the next step
    assert a.output_token_ids[-1] == 7 and a.num_computed_tokens == 10


def test_no_draft_on_a_last_prompt_token_or_before_followers_fork() -> None:
    """A request whose last prefill chunk is one token samples (and forks its n > 1 followers) from its own row:
    a draft set on it is ignored (found by the fuzz: the follower forked from a context holding the leader's
    verified token)."""
    s, fake = make(block_size=2, max_num_batched_tokens=4, mixed_batches=False)
    leader = request("0", 9, max_tokens=4, n=2)
    follower = Request("0-1", leader.prompt_token_ids, leader.params, parent=leader)
    leader.followers = [follower]
    s.add(leader)
    step(s, fake)
    step(s, fake)  # 8 of 9 prompt tokens computed
    leader.draft = [21]
    plan = step(s, fake, tokens=lambda r: 30 if r is leader else 31, verify=lambda r: [99])
    assert [x.num_draft for x in plan.scheduled] == [0] and not plan.spec_rows
    assert leader.output_token_ids == [30] and follower.output_token_ids == [31]
    step(s, fake)  # both decode; their contexts read back (the follower's own token at position 9)


@st.composite
def lifecycles(draw: st.DrawFn) -> dict:
    block_size = draw(st.sampled_from([2, 4, 8]))
    reqs = draw(st.lists(st.tuples(st.integers(1, 30), st.integers(1, 12), st.integers(1, 3),
                                   st.integers(0, 40), st.booleans()), min_size=1, max_size=10))
    longest = max(cdiv(p + m, block_size) for p, m, *_ in reqs)
    return dict(block_size=block_size, reqs=reqs, seed=draw(st.integers(0, 2**16)),
                blocks=draw(st.integers(longest + 1, longest + 24)),
                budget=draw(st.integers(4, 48)), max_num_seqs=draw(st.integers(3, 8)),
                mode=draw(st.sampled_from(["recompute", "swap"])), host=draw(st.integers(0, 16)),
                caching=draw(st.booleans()), mixed=draw(st.booleans()),
                cap=draw(st.one_of(st.none(), st.integers(1, 16))), token_budget=draw(st.one_of(st.none(),
                                                                                             st.integers(33, 48))),
                window=draw(st.sampled_from([None, 6, 13])),
                aborts=draw(st.lists(st.integers(0, 9), max_size=3)), spec=draw(st.booleans()),
                timed=draw(st.booleans()))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lifecycles())
def test_fuzz_lifecycles_keep_the_invariants(case: dict) -> None:
    """Random arrivals (some n > 1, some sharing prompts), aborts, EOS, budgets, pools, both preemption modes,
    prefix caching on and off, mixed batches or alternation, the decode-step cap (a number, the token budget or the
    time rule over random step times) and sliding windows. After every
    step: the budget, the cap and max_num_seqs hold, every request is in exactly one queue, no request preempted
    in a step is scheduled in it, the KV manager's invariants hold and every scheduled context reads back its own
    tokens; at the end every request finished and every block is free. With ``spec``, decoding requests bring
    random drafts that are accepted in part: a rejected draft's slot must be rewritten before any context (or a
    prefix-cache hit) reads it."""
    rng = random.Random(case["seed"])
    budget, cap, mixed = case["budget"], case["cap"], case["mixed"]
    s, fake = make(case["blocks"], case["block_size"], caching=case["caching"], host=case["host"],
                   max_num_seqs=case["max_num_seqs"], max_num_batched_tokens=budget, mixed_batches=mixed,
                   preemption_mode=case["mode"], max_prefill_tokens_with_decodes=cap,
                   decode_step_token_budget=case["token_budget"], sliding_window=case["window"],
                   mixed_step_time_ratio=3.0 if case["timed"] else None)
    shared = [rng.randrange(3, 40) for _ in range(30)]
    pending, live = [], []
    for i, (n_prompt, max_tokens, n, arrive, share) in enumerate(case["reqs"]):
        prompt = shared[:n_prompt] if share else [rng.randrange(3, 40) for _ in range(n_prompt)]
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=i % 3 != 0, n=min(n, case["max_num_seqs"]))
        seqs = [Request(f"{i}-{k}", prompt, params) for k in range(params.n)]
        for f in seqs[1:]:
            f.parent = seqs[0]
        seqs[0].followers = seqs[1:]
        pending.append((arrive, seqs))
    for t in range(600):
        for _arrive, seqs in [p for p in pending if p[0] == t]:
            s.add(seqs[0])
            live += seqs
        if t in case["aborts"] and live:
            victim = rng.choice(live)
            if not victim.finished:
                if victim.parent is not None and victim in victim.parent.followers:
                    victim.parent.followers.remove(victim)
                s.finish(victim, "abort")
                for f in victim.followers:
                    s.finish(f, "abort")
                victim.followers = []
        if not s.has_unfinished() and t > 40:
            break
        if case["spec"]:  # never past max_tokens; also on a last prompt token and on leaders, which must not draft
            for r in s.running:
                room = r.params.max_tokens - len(r.output_token_ids) - 1
                one_left = r.num_tokens - r.num_computed_tokens == 1
                r.draft = [rng.randrange(3, 40) for _ in range(min(rng.randint(0, 3), room))] if one_left else []

        def keep(r: Request) -> list[int]:
            return [*r.draft[:rng.randint(0, len(r.draft))], EOS if rng.random() < 0.1 else rng.randrange(3, 40)]

        running = {id(r) for r in s.running}  # the cap bounds steps that carry *running* decodes (a request
        # resumed from waiting or swap with one token left computes like a decode but was not running)
        decodes = sum(r.num_tokens - r.num_computed_tokens == 1 for r in s.running)
        if cap is None and case["token_budget"]:
            cap = max(MIN_PREFILL_WITH_DECODES, case["token_budget"] - max(1, decodes))  # this step's
        fitted = s.step_cost.fit()
        if case["timed"] and fitted is not None:  # the time rule's: 3 times the decodes alone
            fixed_s, token_s = fitted
            timed = max(MIN_TIMED_PREFILL, int(2.0 * (fixed_s + token_s * max(1, decodes)) / token_s))
            cap = timed if cap is None else min(cap, timed)
        plan = step(s, fake, tokens=lambda r: EOS if rng.random() < 0.1 else rng.randrange(3, 40), verify=keep)
        assert plan.num_tokens <= budget
        if mixed and cap and any(x.num_new_tokens - x.num_draft == 1 and x.start >= len(x.request.prompt_token_ids)
                                 and id(x.request) in running for x in plan.scheduled):
            assert sum(x.num_new_tokens for x in plan.scheduled if x.num_new_tokens > 1 and not x.num_draft) <= cap
        cap = case["cap"]
        if case["timed"]:  # step times that vary with the plan's tokens (a decode ~3 ms, a prefill token ~0.4 ms)
            prefill = plan.num_tokens - plan.num_decode_tokens
            s.observe_step(prefill, plan.num_decode_tokens,
                           rng.uniform(0.5, 1.5) * (0.003 * bool(plan.num_decode_tokens) + 0.0004 * prefill))
        assert sum(1 + len(r.followers) for r in s.running) <= s.max_num_seqs  # seats: unforked followers too
        assert not {id(r) for r in plan.preempted} & {id(x.request) for x in plan.scheduled}
        queues = [*s.waiting, *s.running, *s.swapped]
        assert len({id(r) for r in queues}) == len(queues) and not any(r.finished for r in queues)
        s.kv.check_invariants()
    assert not s.has_unfinished()
    assert all(r.finished for _, seqs in pending for r in seqs)
    stats = s.kv.stats()
    assert stats.num_free == case["blocks"] and stats.num_host_free == case["host"]


def test_the_time_rule_sizes_prefill_beside_decodes_once_steps_are_timed() -> None:
    """``mixed_step_time_ratio``: the token rule (here a fixed 64) alone holds until the engine has fitted its step
    costs; then a step with decodes carries no more prefill than makes it last ~ratio times its decodes alone (never
    fewer than MIN_TIMED_PREFILL); steps without decodes still take the whole budget."""
    s, fake = make(blocks=1024, block_size=16, max_num_batched_tokens=512, max_prefill_tokens_with_decodes=64,
                   mixed_step_time_ratio=3.0)
    s.add(request("a", 20, max_tokens=1000))
    assert shape(step(s, fake)) == [("a", 20)]
    s.add(request("long", 900))
    assert shape(step(s, fake)) == [("a", 1), ("long", 64)]  # nothing timed yet: the token rule
    for _ in range(10):
        s.observe_step(0, 1, 0.090 + 0.010)  # a decode-only step: 90 ms fixed + 10 ms a token
        s.observe_step(64, 1, 0.090 + 65 * 0.010)
    plan = shape(step(s, fake))
    assert plan[0] == ("a", 1) and plan[1][0] == "long" and 19 <= plan[1][1] <= 20  # (3 - 1) * 100 ms / 10 ms
    for _ in range(200):
        s.observe_step(0, 1, 0.010)  # the fixed cost went (decay forgets the old steps): the floor holds
        s.observe_step(64, 1, 0.650)
    assert shape(step(s, fake)) == [("a", 1), ("long", MIN_TIMED_PREFILL)]
    for _ in range(200):
        s.observe_step(0, 1, 1.0 + 0.001)  # a slow fixed part: the time rule allows ~2,000 tokens, the token rule 64
        s.observe_step(64, 1, 1.0 + 0.065)
    assert shape(step(s, fake)) == [("a", 1), ("long", 64)]
    s2, fake2 = make(blocks=1024, block_size=16, max_num_batched_tokens=512, mixed_step_time_ratio=3.0)
    for _ in range(5):
        s2.observe_step(0, 1, 0.1)
        s2.observe_step(64, 1, 0.74)
    s2.add(request("b", 600))
    assert shape(step(s2, fake2)) == [("b", 512)]  # no decodes: the whole budget
    with pytest.raises(ValueError, match="mixed_step_time_ratio must be above 1"):
        SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=16, mixed_step_time_ratio=1.0)
