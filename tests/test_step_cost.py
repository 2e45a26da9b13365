"""The time rule's model (runtime/step_cost.py): a decode-only step's seconds and a prefill token's seconds beyond it,
learnt from the steps the engine ran, and the prefill a step with decodes may carry to last ``ratio`` of them."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import TINY_RECIPE, compile_bundle
from omforge.runtime.engine_config import MIXED_STEP_TIME_RATIO
from omforge.runtime.llm import LLM
from omforge.runtime.sampling_params import SamplingParams
from omforge.runtime.step_cost import EWMA_WEIGHT, MIN_OBSERVED_PREFILL, StepCost


def test_nothing_is_predicted_before_both_kinds_of_step() -> None:
    c = StepCost()
    assert c.prefill_within(3.0, 16) is None
    c.observe(0, 8, 0.100)
    assert c.prefill_within(3.0, 16) is None  # no prefill seen
    c = StepCost()
    c.observe(512, 0, 4.8)  # a prefill-only step first: all of it counts as prefill
    assert c.prefill_token_s == pytest.approx(4.8 / 512)
    assert c.prefill_within(3.0, 16) is None  # no decode-only step seen


def test_a_mixed_step_is_sized_to_the_ratio_of_a_decode_step() -> None:
    c = StepCost()
    c.observe(0, 8, 0.120)
    c.observe(64, 6, 0.120 + 64 * 0.009)  # the 1B fp32 shape of 2026-12-06: 9 ms per prefill token
    assert c.decode_s == pytest.approx(0.120) and c.prefill_token_s == pytest.approx(0.009)
    assert c.prefill_within(3.0, 16) == int(2 * 0.120 / 0.009)  # 26 tokens: the step lasts ~3 decode steps
    assert c.prefill_within(1.5, 16) == 16  # never below the floor
    c.observe(0, 8, 0.200)  # means move by EWMA_WEIGHT of the difference
    assert c.decode_s == pytest.approx(0.120 + EWMA_WEIGHT * 0.080)


def test_steps_that_say_little_are_ignored() -> None:
    c = StepCost()
    c.observe(0, 8, 0.1)
    c.observe(MIN_OBSERVED_PREFILL - 1, 8, 5.0)  # too few prefill tokens to price one
    c.observe(64, 8, 0.05)  # faster than the decode-only mean: no positive cost to learn from
    c.observe(0, 0, 0.0)
    assert c.prefill_token_s is None and c.decode_s == pytest.approx(0.1)


def test_the_serving_engine_times_its_steps_for_the_rule(tmp_path: Path) -> None:
    """A float32 bundle served (``auto``): the engine feeds each step's time to its scheduler, so that the time rule
    has both costs once decode-only and prefill steps ran, and its steps with decodes keep to its prediction."""
    bundle = compile_bundle(TINY_RECIPE, tmp_path / "bundle", tmp_path / "cache")
    with LLM(bundle, max_num_batched_tokens=64, serving=True) as llm:
        sched = llm.engine.scheduler
        assert sched.config.mixed_step_time_ratio == MIXED_STEP_TIME_RATIO
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        llm.engine.add_request(list(range(3, 20)), params, "a")
        for _ in range(12):
            llm.engine.step()  # a's prefill, then decode-only steps
        llm.engine.add_request(list(range(3, 200)), params, "b")  # its chunks beside a's decodes
        caps = []
        while sched.waiting or any(r.num_computed_tokens < len(r.prompt_token_ids) for r in sched.running):
            cap = sched._prefill_cap(1)
            plan_before = llm.engine.stats.prefill_tokens
            llm.engine.step()
            caps.append((cap, llm.engine.stats.prefill_tokens - plan_before))
        cost = sched.step_cost
        assert cost.decode_s is not None and cost.decode_s > 0
        assert cost.prefill_token_s is not None and cost.prefill_token_s > 0
        assert all(0 < took <= cap for cap, took in caps)
