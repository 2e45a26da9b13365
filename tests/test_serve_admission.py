"""The server's queue sized from the rate it serves (issue 46, finding 4): with the defaults, 150 concurrent
requests got 129 × 200 and 21 × 503 after waiting the 60 s bound, no 429 — the default depth assumed two batches
finish within the bound, and one batch of 64 took ~38 s. serve/admission.py: one batch until a rate is measured,
then as many waiting sequences as that rate starts within 80% of the bound; an explicit depth is a hard cap."""

from __future__ import annotations

import pytest

from omforge.serve.admission import ADMIT_FRACTION, MAX_QUEUE_BATCHES, MIN_SATURATED_S, QueueBudget, ServiceRate


def budget(rate: ServiceRate, configured: int = 4, explicit: bool = False, bound: float | None = 60.0,
           max_num_seqs: int = 4) -> QueueBudget:
    return QueueBudget(max_num_seqs=max_num_seqs, configured=configured, explicit=explicit, max_queue_time_s=bound,
                       rate=rate)


def test_before_a_rate_is_known_the_configured_depth_applies() -> None:
    b = budget(ServiceRate())
    assert b.refusal(0, 8) is None  # 4 running + 4 waiting
    assert "limit 8" in b.refusal(8, 1)
    assert b.capacity == 4 + MAX_QUEUE_BATCHES * 4  # what the measured depth may grow to (the 400 threshold)


def test_the_rate_counts_only_saturated_steps_and_needs_a_second_of_them() -> None:
    rate = ServiceRate()
    for _ in range(100):
        rate.step(0.05, 4, saturated=False)  # an engine with free slots says nothing about the queue's pace
    assert rate.per_second is None
    for _ in range(int(MIN_SATURATED_S / 0.1) // 2):
        rate.step(0.1, 1, saturated=True)
    assert rate.per_second is None  # half a second of saturated steps: not yet
    for _ in range(int(MIN_SATURATED_S / 0.1)):
        rate.step(0.1, 1, saturated=True)
    assert rate.per_second == pytest.approx(10.0)


def test_a_slow_server_refuses_at_once_what_could_not_start_within_the_bound() -> None:
    rate = ServiceRate()
    for _ in range(40):  # 64 sequences finishing every 38 s: the machine
        rate.step(0.95, 0, saturated=True)
    rate.step(0.95, 64, saturated=True)
    per_s = rate.per_second
    assert per_s == pytest.approx(64 / 38.95, rel=0.15)  # right after the burst: a little high
    b = budget(rate, configured=64, bound=60.0, max_num_seqs=64)
    most = int(ADMIT_FRACTION * 60.0 * per_s)  # waiting sequences that start within 80% of the bound
    assert most < 2 * 64  # the old default queue (two batches) would have admitted them all
    assert b.refusal(64 + most - 1, 1) is None
    why = b.refusal(64 + most, 1)
    assert why is not None and "queue-time bound" in why


def test_a_fast_server_may_queue_more_than_the_cold_default_but_an_explicit_cap_holds() -> None:
    rate = ServiceRate()
    for _ in range(20):
        rate.step(0.1, 2, saturated=True)  # 20 sequences/s
    assert budget(rate, configured=4).refusal(4 + 20, 1) is None  # 21 waiting: ~1 s, well within 48 s
    assert budget(rate, configured=4).refusal(4 + MAX_QUEUE_BATCHES * 4, 1) is not None
    assert budget(rate, configured=4, explicit=True).refusal(8, 1) is not None


def test_no_queue_time_bound_means_only_the_configured_depth() -> None:
    rate = ServiceRate()
    for _ in range(20):
        rate.step(0.1, 0, saturated=True)
    rate.step(0.1, 1, saturated=True)
    b = budget(rate, configured=4, bound=None)
    assert b.refusal(7, 1) is None and b.refusal(8, 1) is not None
