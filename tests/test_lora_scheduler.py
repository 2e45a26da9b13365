"""LoRA in the scheduler (docs/lora.md), with the real :class:`~omforge.runtime.lora.registry.LoraRegistry` and
small pools the plans' ``lora_loads`` are written into (as ``run_plan`` does): a waiting request is admitted only
when its adapter gets a slot, the ones behind it go first meanwhile,
least-recently-used replacement of an unpinned slot, pins released on finish, abort and preemption (kept while
swapped), ``n > 1`` followers pinning their leader's adapter, each work item carrying its adapter's slot, and the
prefix cache keyed by the adapter's digest. No bundle, no model: the plans are finished with a fixed token.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from omforge.contract.lora import pool_a, pool_b
from omforge.contract.manifest import LoraPart, LoraProjection, LoraSection, ModelConfig
from omforge.runtime.kv_cache_manager import KVCacheManager
from omforge.runtime.lora.adapter import LoraAdapter, make_adapter
from omforge.runtime.lora.registry import LoraRegistry
from omforge.runtime.request import Request, Status
from omforge.runtime.sampling_params import SamplingParams
from omforge.runtime.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

HIDDEN, RANK = 8, 2
CONFIG = ModelConfig(family="llama", vocab_size=64, hidden_size=HIDDEN, intermediate_size=16, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=2, head_dim=4)


def spec(max_loras: int) -> LoraSection:
    return LoraSection(max_loras=max_loras, max_rank=RANK, target_modules=("q_proj",), projections=(
        LoraProjection(layer=0, name="q", in_features=HIDDEN, out_features=HIDDEN,
                       parts=(LoraPart("q_proj", 0, HIDDEN),)),))


def adapter(name: str, seed: int) -> LoraAdapter:
    rng = np.random.default_rng(seed)
    a, b = rng.standard_normal((RANK, HIDDEN)), rng.standard_normal((HIDDEN, RANK))
    return make_adapter(name, Path(f"/adapters/{name}"), {(0, "q_proj"): (a, b)})


class Slots(LoraRegistry):
    """The registry with the pools its loads go to (the executor's, in the engine)."""

    pools: dict[str, np.ndarray]


def make(max_loras: int = 2, adapters: tuple[str, ...] = ("x", "y", "z"), *, blocks: int = 64, caching: bool = False,
         host: int = 0, **config: object) -> tuple[Scheduler, Slots]:
    lora = spec(max_loras)
    slots = Slots(lora, CONFIG)
    slots.pools = {pool_a(0, "q"): np.zeros((max_loras + 1, RANK, HIDDEN), np.float32),
                   pool_b(0, "q"): np.zeros((max_loras + 1, HIDDEN, RANK), np.float32)}
    for i, name in enumerate(adapters):
        slots.register(adapter(name, i))
    config.setdefault("max_num_seqs", 16)
    config.setdefault("max_num_batched_tokens", 64)
    config.setdefault("mixed_batches", True)
    kv = KVCacheManager(blocks, 4, enable_prefix_caching=caching, num_host_blocks=host)
    return Scheduler(kv, SchedulerConfig(**config), lora=slots), slots  # type: ignore[arg-type]


def request(rid: str, lora: str | None, n_prompt: int = 6, max_tokens: int = 50, seed: int = 0) -> Request:
    rng = random.Random(seed)
    return Request(rid, [rng.randrange(3, 50) for _ in range(n_prompt)],
                   SamplingParams(max_tokens=max_tokens, ignore_eos=True), lora=lora)


def step(s: Scheduler) -> SchedulerOutput:
    """Plan a step, carry out its adapter loads and finish it with token 7 for every sampling row; every work
    item's slot is checked against its request's adapter (resident and pinned while it runs)."""
    plan = s.schedule()
    for load in plan.lora_loads:
        load.apply(s.lora.pools)
    for sch, work in zip(plan.scheduled, plan.work):
        req = sch.request
        if req.lora is None:
            assert work.lora_slot == 0
        else:
            assert work.lora_slot == s.lora.slot_of(req.lora) and work.lora_slot >= 1
            assert s.lora.pinned(req.lora) >= 1
    s.update_from_output(plan, [7] * len(plan.sample_rows))
    check_pins(s)
    return plan


def check_pins(s: Scheduler) -> None:
    """Each adapter's pin count is the number of RUNNING, SWAPPED or loading requests that use it."""
    holders = [r for r in (*s.running, *s.swapped, *s.loading.values()) if not r.finished]
    for name in s.lora.names():
        assert s.lora.pinned(name) == sum(r.lora == name for r in holders), name
    assert len({r.lora for r in holders if r.lora is not None}) <= s.lora.max_loras


def ids(plan: SchedulerOutput) -> list[str]:
    return [x.request.request_id for x in plan.scheduled]


def slot_weights(slots: Slots, slot: int) -> np.ndarray:
    return slots.pools[pool_a(0, "q")][slot]


def test_a_request_waits_for_a_slot_and_the_ones_behind_it_go_first() -> None:
    s, slots = make(max_loras=2)
    for rid, lora in (("a", "x"), ("b", "y"), ("c", "z"), ("d", None), ("e", "x")):
        s.add(request(rid, lora))
    assert ids(step(s)) == ["a", "b", "d", "e"]  # c's adapter has no slot: x and y are pinned; d and e pass it
    assert [r.request_id for r in s.waiting] == ["c"] and s.waiting[0].status is Status.WAITING
    assert slots.pinned("x") == 2 and slots.pinned("y") == 1 and slots.slot_of("z") is None
    for _ in range(3):
        assert ids(step(s)) == ["a", "b", "d", "e"]  # still no free slot for z
    s.finish(s.running[0], "stop")  # a: x is still pinned by e
    assert ids(step(s)) == ["b", "d", "e"]
    y_slot = slots.slot_of("y")
    s.finish(next(r for r in s.running if r.request_id == "b"), "stop")  # y unpinned: z replaces it
    assert ids(step(s)) == ["d", "e", "c"]
    assert slots.slot_of("z") == y_slot and slots.slot_of("y") is None
    assert slots.evictions == 1 and slots.loads == 3
    np.testing.assert_array_equal(slot_weights(slots, y_slot), adapter("z", 2).weights[(0, "q_proj")][0])


def test_least_recently_used_unpinned_adapter_is_replaced() -> None:
    s, slots = make(max_loras=2)
    for rid, lora in (("a", "x"), ("b", "y")):
        s.add(request(rid, lora, max_tokens=1))
    step(s)  # both prefill, sample their one token and finish: x and y stay resident, unpinned
    assert not s.running and slots.pinned("x") == slots.pinned("y") == 0
    s.add(request("c", "x", max_tokens=1))  # x used again: y is now the least recently used
    step(s)
    x_slot = slots.slot_of("x")
    s.add(request("d", "z", max_tokens=1))
    step(s)
    assert slots.slot_of("x") == x_slot and slots.slot_of("y") is None and slots.slot_of("z") is not None
    assert slots.loads == 3 and slots.evictions == 1  # x was not written again


def test_pins_are_released_on_finish_abort_and_recompute_preemption() -> None:
    s, slots = make(max_loras=1, adapters=("x", "y"), blocks=6, max_num_seqs=4)
    a, b = request("a", "x", n_prompt=8, max_tokens=40), request("b", "x", n_prompt=8, max_tokens=40, seed=1)
    s.add(a)
    s.add(b)
    y = request("c", "y", max_tokens=1)
    s.add(y)
    step(s)
    assert slots.pinned("x") == 2 and y.status is Status.WAITING  # one slot: y waits for x's requests
    preempted = []
    for _ in range(12):  # 6 blocks of 4 tokens cannot hold both growing sequences: b is preempted (recompute)
        preempted += step(s).preempted
        if preempted:
            break
    assert preempted == [b] and b.status is Status.WAITING
    assert slots.pinned("x") == 1  # b gave its pin back with its blocks
    s.remove(a)  # aborted: its pin goes with it
    a.status = Status.FINISHED
    assert slots.pinned("x") == 0
    plan = step(s)
    assert "b" in ids(plan) and slots.pinned("x") == 1  # b readmitted with x pinned again; y still waits
    s.finish(b, "abort")
    assert slots.pinned("x") == 0
    assert ids(step(s)) == ["c"] and slots.slot_of("y") == 1 and slots.slot_of("x") is None


def test_a_swapped_request_keeps_its_pin() -> None:
    s, slots = make(max_loras=1, adapters=("x", "y"), blocks=6, host=16, preemption_mode="swap")
    a, b = request("a", "x", n_prompt=8), request("b", "x", n_prompt=8, seed=1)
    s.add(a)
    s.add(b)
    s.add(request("c", "y", max_tokens=1))
    swapped = False
    for _ in range(12):
        step(s)
        if b.status is Status.SWAPPED:
            swapped = True
            break
    assert swapped and slots.pinned("x") == 2  # swapped out, not ended: x cannot be replaced under it
    assert [r.request_id for r in s.waiting] == ["c"]


def test_n_followers_pin_their_leaders_adapter_when_they_fork() -> None:
    s, slots = make()
    leader = request("r-0", "x")
    followers = [request(f"r-{i}", "x") for i in (1, 2)]
    for f in followers:
        f.prompt_token_ids, f.parent = leader.prompt_token_ids, leader
    leader.followers = list(followers)
    s.add(leader)
    step(s)  # the leader's prefill: the followers fork from it and sample from its row
    assert all(f.status is Status.RUNNING for f in followers) and slots.pinned("x") == 3
    plan = step(s)
    assert sorted(ids(plan)) == ["r-0", "r-1", "r-2"]
    for f in followers:
        s.finish(f, "stop")
    assert slots.pinned("x") == 1


def test_prefix_cache_is_keyed_by_the_adapters_digest() -> None:
    s, slots = make(max_loras=3, adapters=("x", "y", "z"), caching=True)
    slots.register(make_adapter("x-again", Path("/adapters/x-again"), adapter("x", 0).weights))  # x's weights
    prompt = 13  # three full blocks of 4 and one token

    def cached(rid: str, lora: str | None) -> int:
        req = request(rid, lora, n_prompt=prompt, max_tokens=1)
        s.add(req)
        while not req.finished:
            step(s)
        return req.num_cached_tokens

    assert cached("x1", "x") == 0
    assert cached("x2", "x") == 12  # the same adapter: its blocks are found
    assert cached("y1", "y") == 0  # another adapter never reads x's KV
    assert cached("base1", None) == 0  # nor does the base model
    assert cached("base2", None) == 12
    assert cached("x3", "x-again") == 12  # the digest is the weights', whatever the name
    assert cached("y2", "y") == 12


def test_a_request_for_an_adapter_without_slots_is_refused() -> None:
    kv = KVCacheManager(8, 4)
    s = Scheduler(kv, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64))
    s.add(request("a", "x"))
    with pytest.raises(ValueError, match="names LoRA adapter 'x' but the scheduler has no adapter slots"):
        s.schedule()


def test_without_mixed_batches_a_request_waiting_for_a_slot_does_not_stall_the_decodes() -> None:
    """Steps of one kind (decodes or prefill): a waiting request whose adapter cannot get a slot is no prefill
    work, so the running decodes run every step instead of every other one."""
    s, slots = make(max_loras=1, adapters=("x", "y"), mixed_batches=False)
    s.add(request("a", "x"))
    step(s)  # a's prefill
    s.add(request("b", "y"))
    for _ in range(5):
        assert ids(step(s)) == ["a"]  # a decodes; b waits for x's slot
    assert s.waiting[0].request_id == "b"



def test_an_adapter_passed_over_gets_a_slot_while_the_adapters_holding_them_stay_busy() -> None:
    """issue 64 item 4: both slots pinned by adapters x and y that get a new request every step (each lives a few
    steps); a request for a third adapter z waited until the queue-time bound ended it. Now, once z has been passed
    over for LORA_FAIRNESS_S (the scheduler's clock: 0.1 s a step), x and y get no new work, a slot drains and z
    gets it within a request's lifetime; a base-model request meanwhile is not held back; then everything
    finishes and the pins are back to 0."""
    from omforge.runtime.scheduler import LORA_FAIRNESS_S

    s, slots = make(max_loras=2, max_num_seqs=24, blocks=128)
    now = [0.0]
    s.clock = lambda: now[0]
    s.add(request("x-0", "x", max_tokens=3))
    s.add(request("y-0", "y", max_tokens=3))
    step(s)
    z = request("z", "z", max_tokens=3)
    s.add(z)
    base = request("base", None, max_tokens=1)
    started = None
    for i in range(1, 201):  # 20 s of the clock: far past the bound, far inside the 60 s queue bound
        now[0] += 0.1
        s.add(request(f"x-{i}", "x", max_tokens=3, seed=i))
        s.add(request(f"y-{i}", "y", max_tokens=3, seed=i))
        if i == 22:  # while x and y are held back
            s.add(base)
        plan = step(s)
        if i == 22:
            assert "base" in ids(plan) and z.status is Status.WAITING
        if z.status is not Status.WAITING:
            started = now[0]
            break
    assert started is not None, "z was passed over for 20 s while x and y stayed busy: starved"
    assert LORA_FAIRNESS_S <= started <= LORA_FAIRNESS_S + 1.0, started  # not before the bound; soon after it
    assert slots.slot_of("z") is not None
    for _ in range(400):  # the held-back requests resume and everything finishes (bounded)
        if not s.has_unfinished():
            break
        step(s)
    assert not s.has_unfinished() and not slots.pins() and base.finished
