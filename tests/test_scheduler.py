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
