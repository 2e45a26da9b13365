"""A seeded lifecycle fuzz of the scheduler with every KV connector (issue 45): n > 1, speculative drafts, aborts,
swap and recompute preemption, the storage tier or the host tier below the pool, and PD legs — a prefill
replica's scheduler and this one as the decode replica, in one process over the FAKE NIXL fabric
(tests/fake_nixl.py), reads slow, failing or past their lease.

The "model" reads its context back through the block tables: a sampled token is a hash of the tokens the KV pool
holds at the sequence's positions (:class:`ModelStep`), so any wrong block — a bad copy, a load into the wrong
block, a block reused while read — changes the greedy output. After every step: each scheduled context reads back
its own tokens, the pool, KV manager and host tier invariants hold, seats are within ``max_num_seqs`` and every
live request is in one queue. At the end: nothing in flight or leaked (every block free or cached), and every
request that was neither aborted nor failed produced the greedy output of running it alone.

In the suite: ``SUITE_SEEDS`` seeds. Many more, once, outside it (one process, bounded in time)::

    .venv/bin/python tests/test_lifecycle_fuzz.py FIRST_SEED COUNT MAX_SECONDS
"""

from __future__ import annotations

import logging
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pytest
from fake_nixl import Fabric, FakeAgent
from test_hicache_scheduler import SlowTier
from test_scheduler import EOS, FakeStep, make

from omforge.contract import PagedLayout, cdiv
from omforge.runtime.executor import run_plan
from omforge.runtime.hicache.connectors import HostTierConnector, StorageConnector
from omforge.runtime.hicache.host_tier import HostTier
from omforge.runtime.kv_transfer.config import parse_kv_transfer_config
from omforge.runtime.kv_transfer.connector import PDConnector
from omforge.runtime.kv_transfer.params import KVTransferParams, parse_kv_transfer_params
from omforge.runtime.request import Request, Status
from omforge.runtime.sampling_params import SamplingParams
from omforge.runtime.scheduler import Scheduler

VOCAB = 48
SUITE_SEEDS = 40
LEASE_S = 5.0
TICK_S = 0.1  # fake seconds per step


def next_token(context: list[int]) -> int:
    """The fake model's greedy token after ``context``: a hash of it (EOS now and then)."""
    h = 1469598103
    for t in context:
        h = (h * 1099511 + t + 1) % 4294967291
    return EOS if h % 23 == 0 else 3 + h % (VOCAB - 3)


class ModelStep(FakeStep):
    """:class:`FakeStep` whose logits rows are one-hot at :func:`next_token` of the context read back through the
    block table (what the KV pool holds, not what the request says)."""

    def execute(self, work) -> np.ndarray:  # noqa: ANN001 - Sequence[SeqWork]
        super().execute(work)
        rows = []
        for w in work:
            last = w.start + len(w.token_ids)
            positions = range(w.start, last) if w.all_logits else [last - 1] if w.needs_logits else []
            for p in positions:
                row = np.zeros(VOCAB, np.float32)
                row[next_token(self.context(w.block_table, p + 1))] = 1.0
                rows.append(row)
        return np.array(rows, np.float32).reshape(-1, VOCAB)


@dataclass
class Replica:
    s: Scheduler
    model: ModelStep
    after: list = field(default_factory=list)  # callables after each step (tier write-through, checks)


def step(r: Replica, rng: random.Random, want: dict[str, list[int]]) -> None:
    """Plan, run, check every scheduled context, pick greedy tokens (verifying drafts), update."""
    s, model = r.s, r.model
    for req in s.running:  # drafts: the true continuation now and then, else noise
        if req.output_token_ids and not req.followers and rng.random() < 0.3:
            true = want.get(req.request_id, [])[len(req.output_token_ids):]
            k = rng.randint(1, 3)
            req.draft = (true[:k] if rng.random() < 0.6 else []) or [rng.randrange(3, VOCAB) for _ in range(k)]
    plan = s.schedule()
    logits = run_plan(model, plan)
    for sch in plan.scheduled:
        n = sch.start + sch.num_new_tokens
        got = model.context(s.kv.block_table(sch.request.request_id), n)
        assert all(g is None or g == w for g, w in zip(got, sch.request.all_token_ids[:n])), sch.request.request_id
    picks = [int(logits[row].argmax()) for _, row in plan.sample_rows]
    verified = {}
    for req, row, k in plan.spec_rows:
        accepted = []
        for i in range(k):
            if int(logits[row + i].argmax()) != req.draft[i]:
                break
            accepted.append(req.draft[i])
        verified[req.request_id] = [*accepted, int(logits[row + len(accepted)].argmax())]
    s.update_from_output(plan, picks, verified)
    for fn in r.after:
        fn()
    check(s)


def check(s: Scheduler) -> None:
    s.kv.check_invariants()
    assert sum(1 + len(q.followers) for q in (*s.running, *s.loading.values()) if not q.finished) <= s.max_num_seqs
    live = [*s.waiting, *s.running, *s.swapped, *(q for q in s.loading.values() if not q.finished)]
    assert len({id(q) for q in live}) == len(live) and not any(q.finished for q in live)
    assert all(q.finished for q in s.held.values())


def alone(tokens: list[int], max_tokens: int) -> list[int]:
    """The greedy output of ``tokens`` run alone on a roomy pool."""
    out: list[int] = []
    while len(out) < max_tokens:
        token = next_token(tokens + out)
        out.append(token)
        if token == EOS:
            break
    return out


def abort(s: Scheduler, req: Request) -> None:
    """What ``LLMEngine.abort`` does: unforked followers hold nothing; a leader takes its followers along."""
    if req.finished:
        return
    if req.parent is not None and req in req.parent.followers:
        req.parent.followers.remove(req)
    s.remove(req)
    req.status, req.finish_reason = Status.FINISHED, "abort"
    for follower in list(req.followers):
        abort(s, follower)


def run_seed(seed: int) -> dict[str, int]:
    """One case; returns what it exercised (requests compared, reads done, drafts accepted, preemptions)."""
    rng = random.Random(seed)
    bs = rng.choice([2, 4])
    blocks = rng.randint(14, 28)
    tier = rng.choice(["none", "storage", "host"])
    mode = rng.choice(["recompute", "swap"])
    policy = rng.choice(["recompute", "fail"])
    fabric = Fabric(delay=rng.choice([0.0, 0.2, 0.5]))
    s, _ = make(blocks, bs, caching=True, events=True, host=8, preemption_mode=mode,
                max_num_seqs=rng.randint(2, 6), max_num_batched_tokens=rng.choice([8, 16, 32]))
    capacity = rng.randint(4, 32)
    model = ModelStep(blocks, bs, num_host_blocks=8 + capacity)
    decode = Replica(s, model)
    layout = PagedLayout(num_layers=1, kv_heads=1, head_dim=1, block_size=bs)

    def pd(role: str, engine_id: str, m: ModelStep) -> PDConnector:
        config = parse_kv_transfer_config({"kv_connector": "NixlConnector", "kv_role": role, "engine_id": engine_id,
                                           "kv_load_failure_policy": policy,
                                           "kv_connector_extra_config": {"kv_lease_duration": LEASE_S}})
        return PDConnector(config, FakeAgent(fabric, engine_id, layout, [m.pool]), bs, "127.0.0.1", 1,
                           clock=fabric.clock)

    consumer = pd("kv_consumer", "decode-0", model)
    s.connectors = [consumer]
    if tier == "storage":
        slow = SlowTier(model, rng, capacity, loss=rng.choice([0.0, 0.2]))
        slow.connector = StorageConnector(slow, s.kv)
        s.connectors.append(slow.connector)
        decode.after.append(lambda: slow.connector.after_step(0, 0.0, idle=False))
    elif tier == "host":
        host = HostTier(base=8, num_slots=capacity, block_bytes=1)
        s.connectors.append(HostTierConnector(host, bs))
        decode.after.append(host.check_invariants)
    ps, _ = make(24, bs, caching=True, max_num_seqs=4, max_num_batched_tokens=16)
    pmodel = ModelStep(24, bs)
    producer = pd("kv_producer", "prefill-0", pmodel)
    ps.connectors = [producer]
    prefill = Replica(ps, pmodel)

    families = [[rng.randrange(3, VOCAB) for _ in range(24)] for _ in range(4)]
    arrivals = []
    for i in range(rng.randint(3, 12)):
        fam = families[rng.randrange(4)]
        tokens = fam[:rng.randint(3, 20)] + [rng.randrange(3, VOCAB) for _ in range(rng.randint(0, 4))]
        max_tokens = rng.randint(1, 10)
        if cdiv(len(tokens) + max_tokens, bs) + 1 > blocks:
            continue
        arrivals.append((rng.randint(0, 40), str(i), tokens, max_tokens, rng.choice([1, 1, 1, 2, 3]),
                         rng.random() < 0.35))
    want: dict[str, list[int]] = {}
    reqs: list[Request] = []
    legs: dict[str, tuple[Request, list[int], int, int]] = {}  # prefill leg id -> (leg, tokens, max_tokens, n)

    def submit(rid: str, tokens: list[int], max_tokens: int, n: int, kv: KVTransferParams | None) -> None:
        params = SamplingParams(n=n, max_tokens=max_tokens)
        ids = [rid] if n == 1 else [f"{rid}-{i}" for i in range(n)]
        group = [Request(sid, tokens, params, index=i, kv_transfer=kv, arrival_time=fabric.now)
                 for i, sid in enumerate(ids)]
        for follower in group[1:]:
            follower.parent = group[0]
            group[0].followers.append(follower)
        for req in group:
            want[req.request_id] = alone(tokens, max_tokens)
        reqs.extend(group)
        s.add(group[0])

    for t in range(800):
        for at, rid, tokens, max_tokens, n, remote in arrivals:
            if at != t:
                continue
            if remote:  # the prefill leg first, on the prefill replica
                leg = Request(rid, tokens, SamplingParams(max_tokens=1), kv_transfer=KVTransferParams(
                    do_remote_decode=True))
                ps.add(leg)
                legs[rid] = (leg, tokens, max_tokens, n)
            else:
                submit(rid, tokens, max_tokens, n, None)
        for rid, (leg, tokens, max_tokens, n) in list(legs.items()):
            if leg.finished:
                del legs[rid]
                answer = leg.kv_transfer_out
                submit(rid, tokens, max_tokens, n, parse_kv_transfer_params(answer) if answer else None)
        live = [r for r in reqs if not r.finished]
        if live and rng.random() < 0.03:
            abort(s, rng.choice(live))
        if rng.random() < 0.02 and fabric.reads:  # a read that fails (a peer error)
            read = rng.choice(fabric.reads)
            if not read.done:
                read.fail = "NIXL_ERR_REMOTE_DISCONNECT"
        busy = [c for c in (*s.connectors, producer) if c.busy()]
        if t > 40 and not legs and not s.has_unfinished() and not ps.has_unfinished() and not busy:
            break
        step(prefill, rng, {})
        step(decode, rng, want)
        fabric.now += TICK_S
    else:
        raise AssertionError(f"seed {seed}: not finished within 800 steps")
    for r in reqs:
        assert r.finished, (seed, r.request_id)
        if r.finish_reason != "abort":
            assert r.output_token_ids == want[r.request_id], (seed, r.request_id, r.output_token_ids,
                                                               want[r.request_id])
    for sched in (s, ps):
        assert not sched.loading and not sched.held and sched.kv.stats().num_used == 0, seed
    return {"compared": sum(r.finish_reason != "abort" for r in reqs), "aborted_or_failed":
            sum(r.finish_reason == "abort" for r in reqs), "reads":
            consumer.stats.read_requests - consumer.stats.read_failures, "read_failures": consumer.stats.read_failures,
            "preemptions": s.num_preemptions}


@pytest.mark.parametrize("seed", range(SUITE_SEEDS))
def test_lifecycles_with_every_connector_keep_the_invariants_and_the_greedy_output(seed: int) -> None:
    run_seed(seed)


if __name__ == "__main__":
    first, count, seconds = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    logging.disable(logging.WARNING)
    t0, ran, failed, seen = time.monotonic(), 0, [], Counter()
    for seed in range(first, first + count):
        if time.monotonic() - t0 > seconds:
            break
        try:
            seen.update(run_seed(seed))
        except AssertionError as exc:
            failed.append((seed, str(exc)[:300]))
        ran += 1
    print(f"{ran} seeds from {first} in {time.monotonic() - t0:.0f} s; {len(failed)} failed; {dict(seen)}")
    for seed, why in failed[:20]:
        print(seed, why)
