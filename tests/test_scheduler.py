"""The scheduler's step policy: budgets, and the cap on prefill tokens in a step that carries decodes."""

from __future__ import annotations

from omforge.runtime.kv_cache_manager import KVCacheManager
from omforge.runtime.request import Request
from omforge.runtime.sampling_params import SamplingParams
from omforge.runtime.scheduler import Scheduler


def run_step(s: Scheduler) -> list[tuple[str, int]]:
    """Schedule one step and apply it as the engine would (tokens computed; a finished prefill samples one)."""
    out = s.schedule()
    for sch in out.scheduled:
        sch.request.num_computed_tokens += sch.num_new_tokens
        if sch.samples:
            sch.request.output_token_ids.append(1)
    return [(sch.request.request_id, sch.num_new_tokens) for sch in out.scheduled]


def scheduler(cap: int | None) -> Scheduler:
    kv = KVCacheManager(256, 16, enable_prefix_caching=False)
    return Scheduler(kv, max_num_seqs=16, max_num_batched_tokens=512, mixed_steps=True,
                     max_prefill_tokens_with_decodes=cap)


def add(s: Scheduler, rid: str, n: int) -> None:
    s.add(Request(rid, list(range(3, 3 + n)), SamplingParams(max_tokens=100)))


def test_prefill_beside_decodes_is_capped() -> None:
    s = scheduler(cap=128)
    add(s, "a", 20)
    add(s, "b", 20)
    assert run_step(s) == [("a", 20), ("b", 20)]  # no decodes yet: the whole budget
    add(s, "long", 600)
    add(s, "short", 50)
    step = run_step(s)
    assert step[:2] == [("a", 1), ("b", 1)] and step[2:] == [("long", 128)]  # decodes + at most 128 prefill tokens
    step = run_step(s)
    assert step == [("a", 1), ("b", 1), ("long", 128)]  # the chunk continues, still capped; "short" waits
    for _ in range(2):
        run_step(s)
    step = run_step(s)  # the last of "long" (600 = 4 x 128 + 88); "short" takes the rest of the cap
    assert step == [("a", 1), ("b", 1), ("long", 88), ("short", 40)]


def test_without_cap_or_decodes_the_budget_rules() -> None:
    s = scheduler(cap=None)
    add(s, "a", 20)
    run_step(s)
    add(s, "long", 600)
    assert run_step(s) == [("a", 1), ("long", 511)]
    s = scheduler(cap=64)
    add(s, "long", 600)
    assert run_step(s) == [("long", 512)]  # no decodes in the step: the cap does not apply


def test_fuzz_no_same_step_readmission_and_invariants() -> None:
    """Issue 12 defect 2: a request preempted for recompute is not re-admitted in the step that preempted it (the
    swapped queue had this gate, the waiting queue did not: seeds 75, 87, 195 … re-admitted). Random lifecycles,
    mixed steps and alternation, prefix caching on and off; the step budget and the KV invariants hold throughout."""
    import random

    for seed in range(200):
        rng = random.Random(seed)
        kv = KVCacheManager(12, 4, enable_prefix_caching=bool(seed % 3))
        s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=16, preemption_mode="recompute",
                      mixed_steps=bool(seed % 2))
        for i in range(6):
            prompt = [rng.randrange(3, 50) for _ in range(rng.randrange(2, 14))]
            s.add(Request(str(i), prompt, SamplingParams(max_tokens=rng.randrange(2, 12), ignore_eos=True)))
        for _ in range(300):
            if not s.has_unfinished():
                break
            out = s.schedule()
            assert not {r.request_id for r in out.preempted} & {x.request.request_id for x in out.scheduled}, seed
            assert out.num_tokens <= 16
            for sch in out.scheduled:
                req = sch.request
                req.num_computed_tokens += sch.num_new_tokens
                kv.commit(req.request_id, req.all_token_ids, req.num_computed_tokens)
                if sch.samples:
                    req.output_token_ids.append(7)
                    if len(req.output_token_ids) >= req.params.max_tokens:
                        s.remove(req)
            kv.check_invariants()
        assert not s.has_unfinished(), seed
