"""The time rule's model (runtime/step_cost.py): a step's seconds ≈ fixed + per token, fitted by exponentially
weighted least squares over the steps the engine ran, and the prefill a step with decodes may carry to last
``ratio`` times its decodes alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import TINY_RECIPE, compile_bundle
from omforge.runtime.engine_config import MIXED_STEP_TIME_RATIO
from omforge.runtime.llm import LLM
from omforge.runtime.sampling_params import SamplingParams
from omforge.runtime.step_cost import StepCost


def test_nothing_is_predicted_before_steps_differ_enough() -> None:
    c = StepCost()
    assert c.prefill_within(3.0, 8, 16) is None
    for _ in range(20):
        c.observe(0, 8, 0.13)  # every step the same size: the fixed and per-token costs are not separable
    assert c.fit() is None and c.prefill_within(3.0, 8, 16) is None
    c.observe(0, 0, 1.0)  # an empty step says nothing
    c.observe(64, 0, -1.0)
    assert c.fit() is None


def test_the_fit_recovers_the_costs_and_sizes_the_prefill() -> None:
    """The 1B fp32 shape of 2026-12-06: ~57 ms a step plus ~9 ms a row, decodes and prefill alike."""
    c = StepCost()
    for i in range(40):
        decodes = 8 if i % 3 else 30
        prefill = 0 if i % 2 else 40
        c.observe(prefill, decodes, 0.057 + 0.009 * (decodes + prefill))
    fixed_s, token_s = c.fit()
    assert fixed_s == pytest.approx(0.057) and token_s == pytest.approx(0.009)
    # 8 decodes alone: 129 ms; 3 times that leaves 258 ms of prefill rows = 28 tokens
    assert c.prefill_within(3.0, 8, 16) == int(2 * (0.057 + 0.072) / 0.009)
    # 32 decodes alone take 345 ms: the same ratio allows 76 tokens beside them (a token rule of 64 then holds)
    assert c.prefill_within(3.0, 32, 16) == int(2 * (0.057 + 0.288) / 0.009)
    assert c.prefill_within(1.1, 1, 16) == 16  # never below the floor


def test_recent_steps_outweigh_old_ones() -> None:
    c = StepCost()
    for i in range(200):
        c.observe(40 * (i % 2), 8, 0.1 + 0.02 * (8 + 40 * (i % 2)))  # slow steps first
    for i in range(200):
        c.observe(40 * (i % 2), 8, 0.05 + 0.005 * (8 + 40 * (i % 2)))  # then four times faster per token
    fixed_s, token_s = c.fit()
    assert token_s == pytest.approx(0.005, rel=0.01) and fixed_s == pytest.approx(0.05, rel=0.05)


def test_the_serving_engine_times_its_steps_for_the_rule(tmp_path: Path) -> None:
    """A float32 bundle served (``auto``): the engine feeds every step's tokens and time to its scheduler's cost
    model, and its steps with decodes keep to the cap the scheduler planned. (Whether this tiny model's steps
    separate a cost per token is up to the machine's noise — a test run beside another once gave no fit — so the
    fit is checked against the same observations replayed, not for existence.)"""
    bundle = compile_bundle(TINY_RECIPE, tmp_path / "bundle", tmp_path / "cache")
    with LLM(bundle, max_num_batched_tokens=64, serving=True) as llm:
        sched = llm.engine.scheduler
        assert sched.config.mixed_step_time_ratio == MIXED_STEP_TIME_RATIO
        seen: list[tuple[int, int, float]] = []
        observe = sched.observe_step

        def spy(prefill: int, decode: int, seconds: float) -> None:
            seen.append((prefill, decode, seconds))
            observe(prefill, decode, seconds)

        sched.observe_step = spy
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        llm.engine.add_request(list(range(3, 20)), params, "a")
        for _ in range(12):
            llm.engine.step()  # a's prefill, then decode-only steps
        llm.engine.add_request(list(range(3, 200)), params, "b")  # its chunks beside a's decodes
        caps = []
        while sched.waiting or any(r.num_computed_tokens < len(r.prompt_token_ids) for r in sched.running):
            cap = sched._prefill_cap(1)
            before = llm.engine.stats.prefill_tokens
            llm.engine.step()
            caps.append((cap, llm.engine.stats.prefill_tokens - before))
        stats = llm.engine.stats
        assert [s for _, _, s in seen] == list(stats.step_times)[-len(seen):] and len(seen) == 12 + len(caps)
        assert sum(p for p, _, _ in seen) == stats.prefill_tokens and sum(d for _, d, _ in seen) == stats.decode_tokens
        replay = StepCost()
        for p, d, s in seen:
            replay.observe(p, d, s)
        assert sched.step_cost.fit() == replay.fit()
        assert all(0 < took <= cap for cap, took in caps)
