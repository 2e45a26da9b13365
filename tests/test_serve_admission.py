"""The server's admission (serve/admission.py) in simulated time: a small engine model — slots, a KV pool, steps
that cost ``fixed + per token`` seconds, sequences that end before their ``max_tokens`` — drives the real
:class:`QueueBudget` the way the engine thread and the event loop do, and every request ends 200, 429 (refused at
arrival) or 503 (still waiting after ``max_queue_time_s``: what admission exists to prevent).

Issue 46 sized the queue from the measured finish rate; issue 64 item 6 found it wrong where it matters: a rate
kept while idle refused an idle server's short requests, sequences waiting inside a KV-bound engine were invisible
(late 503s), and a fresh server admitted one whole batch of waiting requests before any measurement (20 × 503 at
61 s in a burst of 150 chats)."""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

import pytest

from omforge.serve.admission import (
    ADMIT_FRACTION,
    MAX_QUEUE_BATCHES,
    MIN_SATURATED_S,
    STALE_S,
    QueueBudget,
    SeqBound,
    ServiceRate,
)


@dataclass
class Req:
    at: float  # arrival, seconds
    prompt: int  # prompt tokens
    max_tokens: int
    lengths: list[int]  # each sequence's real output length (<= max_tokens)
    outcome: str = ""  # 200 | 429 | 503
    waited: float = 0.0  # seconds its last sequence waited to start


@dataclass
class Seq:
    req: Req
    bound: SeqBound
    length: int
    blocks: int = 0


@dataclass
class Engine:
    """Slots, a KV pool (each sequence holds the blocks of its whole real length from its start) and steps of
    ``fixed_s + token_s * tokens`` seconds; a request whose sequence waits past ``bound`` ends with a 503."""

    budget: QueueBudget
    fixed_s: float
    token_s: float
    bound: float
    num_blocks: int = 0
    block_size: int = 16
    clock: float = 0.0
    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)

    def arrive(self, req: Req) -> None:
        bounds = [SeqBound(req.prompt, req.max_tokens) for _ in req.lengths]
        in_flight = [s.bound for s in (*self.running, *self.waiting)]
        if self.budget.refusal(in_flight, bounds, self.clock) is not None:
            req.outcome = "429"
            return
        self.waiting.extend(Seq(req, b, n) for b, n in zip(bounds, req.lengths))

    def step(self) -> None:
        for seq in list(self.waiting):  # the queue-time bound
            if self.clock - seq.req.at > self.bound and seq in self.waiting:
                seq.req.outcome = "503"
                self.waiting = deque(s for s in self.waiting if s.req is not seq.req)
                self.running = [s for s in self.running if s.req is not seq.req]
        free = self.num_blocks - sum(s.blocks for s in self.running)
        started = []
        while self.waiting and len(self.running) + len(started) < self.budget.max_num_seqs:
            seq = self.waiting[0]
            need = -(-(seq.req.prompt + seq.length) // self.block_size) if self.num_blocks else 0
            if need > free:
                break  # the KV pool, not max_num_seqs, bounds the batch
            free -= need
            seq.blocks = need
            started.append(self.waiting.popleft())
            seq.req.waited = max(seq.req.waited, self.clock - seq.req.at)
        decodes, prefill = len(self.running), sum(s.req.prompt for s in started)
        seconds = self.fixed_s + self.token_s * (decodes + prefill)
        self.clock += seconds
        self.running += started
        finished = 0
        for seq in list(self.running):
            seq.bound.generated += 1  # what the server's outputs tell it
            if seq.bound.generated >= seq.length:
                self.running.remove(seq)
                finished += 1
                if not any(s.req is seq.req for s in (*self.running, *self.waiting)) and not seq.req.outcome:
                    seq.req.outcome = "200"
        self.budget.observe_step(seconds, prefill, decodes, finished, len(self.running), len(self.waiting),
                                 self.num_blocks - sum(s.blocks for s in self.running), self.clock)

    def serve(self, reqs: list[Req]) -> list[Req]:
        """Every request to its end (bounded: the model always progresses)."""
        arrivals = deque(sorted(reqs, key=lambda r: r.at))
        for _ in range(1_000_000):
            while arrivals and arrivals[0].at <= self.clock:
                self.arrive(arrivals.popleft())
            if self.running or self.waiting:
                self.step()
            elif arrivals:
                self.clock = arrivals[0].at  # idle until the next arrival
            else:
                return reqs
        raise AssertionError("the simulation did not end")


def outcomes(reqs: list[Req]) -> dict[str, int]:
    return {k: sum(r.outcome == k for r in reqs) for k in ("200", "429", "503")}


def budget(max_num_seqs: int = 8, bound: float | None = 60.0, configured: int | None = None,
           explicit: bool = False, num_blocks: int = 0, token_budget: int = 512) -> QueueBudget:
    return QueueBudget(max_num_seqs, configured if configured is not None else max_num_seqs, explicit, bound,
                       token_budget, num_blocks, 16)


def test_an_idle_server_admits_short_requests_after_a_saturated_phase_of_long_ones() -> None:
    """A saturated phase of long generations (the rate it measures: ~1.4 sequences/s), two idle minutes, then 30
    short requests at once. The old estimator kept the long phase's rate while idle and predicted the 22 that wait
    at 15 s against an 8 s allowance: 11 refused. The stale rate is set aside; the bound from the requests' own
    max_tokens and the engine's step cost admits all 30, and all are answered."""
    b = budget(max_num_seqs=8, bound=10.0)
    engine = Engine(b, fixed_s=0.02, token_s=0.001, bound=10.0)
    long = [Req(i * 0.1, 32, 200, [200]) for i in range(40)]
    engine.serve(long)
    assert b.rate.at(engine.clock) is not None  # the long phase was measured
    idle = engine.clock + 120.0
    assert b.rate.at(idle) is None  # … and set aside once stale
    short = [Req(idle, 16, 16, [16]) for _ in range(30)]
    engine.serve(short)
    assert outcomes(short) == {"200": 30, "429": 0, "503": 0}


def test_a_request_of_many_sequences_on_an_idle_server_is_admitted_when_they_start_in_time() -> None:
    """One request of 40 prompts × 16 tokens on an idle 8-slot server whose measured rate (long generations) said
    32 would wait 22 s: it was refused hour after hour. Its own bound says they start within 2 s."""
    b = budget(max_num_seqs=8, bound=10.0)
    engine = Engine(b, fixed_s=0.02, token_s=0.001, bound=10.0)
    engine.serve([Req(i * 0.1, 32, 200, [200]) for i in range(40)])
    big = Req(engine.clock + STALE_S + 1, 16, 16, [16] * 40)
    engine.serve([big])
    assert big.outcome == "200" and big.waited < ADMIT_FRACTION * 10.0


def test_a_kv_bound_engine_counts_the_sequences_waiting_inside_it() -> None:
    """max_num_seqs 32, but the KV pool holds ~6 of these sequences: most in-flight sequences wait inside the
    engine. The old estimator counted waiting from max_num_seqs (none waited, so all were admitted) and measured
    no rate (never 32 in flight and saturated): a Poisson load above capacity ended in late 503s. Counted against
    the batch the engine runs, every request is answered 200 or refused at arrival, and it keeps serving."""
    rng = random.Random(64)
    b = budget(max_num_seqs=32, bound=20.0, num_blocks=6 * 24)
    engine = Engine(b, fixed_s=0.02, token_s=0.0005, bound=20.0, num_blocks=6 * 24)
    t, reqs = 0.0, []
    for _ in range(400):
        t += rng.expovariate(1.5)
        reqs.append(Req(t, 64, 320, [rng.randint(100, 320)]))
    engine.serve(reqs)
    got = outcomes(reqs)
    assert got["503"] == 0, got
    assert got["200"] >= 100, got  # a queue was kept, not just the running batch
    assert b.load.kv_bound or b.slots() == 32


def test_a_fresh_server_sizes_its_queue_from_its_step_cost() -> None:
    """150 chats at once on a fresh server (64 slots, ~0.2 s a full step, max_tokens 400, real lengths 100–400):
    the old default queue (one batch) admitted 64 waiting, of which ~20 were still waiting at 60 s (503). The
    bound from the step cost says no waiting chat is sure to start within 48 s: those beyond the batch hear 429
    at once, and no admitted request ends in a 503."""
    rng = random.Random(150)
    b = budget(max_num_seqs=64, bound=60.0)
    engine = Engine(b, fixed_s=0.07, token_s=0.002, bound=60.0)
    reqs = [Req(rng.uniform(0, 0.6), 40, 400, [rng.randint(100, 400)]) for _ in range(150)]
    engine.serve(reqs)
    got = outcomes(reqs)
    assert got["503"] == 0 and got["200"] >= 64, got


def test_a_fresh_server_queues_more_than_one_batch_when_its_step_cost_says_they_start_in_time() -> None:
    """The same burst with max_tokens 50: a batch lasts ~10 s, so the whole burst starts well within the bound —
    the old default (one batch waiting) refused 22 of them."""
    rng = random.Random(150)
    b = budget(max_num_seqs=64, bound=60.0)
    engine = Engine(b, fixed_s=0.07, token_s=0.002, bound=60.0)
    reqs = [Req(rng.uniform(0.25, 0.6), 40, 50, [rng.randint(20, 50)]) for _ in range(150)]
    first = Req(0.0, 40, 50, [50])  # the first request times the engine's first steps
    engine.serve([first, *reqs])
    assert outcomes(reqs) == {"200": 150, "429": 0, "503": 0}


def test_before_any_step_only_what_starts_now_is_admitted() -> None:
    """Nothing timed: a burst's requests beyond the slots hear 429 at once; one request on an idle server may
    still bring up to the configured depth of its own waiting sequences."""
    b = budget(max_num_seqs=4)
    assert b.refusal([], [SeqBound(8, 8)] * 4, 0.0) is None
    why = b.refusal([SeqBound(8, 8)] * 4, [SeqBound(8, 8)], 0.0)
    assert why is not None and "not yet timed a step" in why
    assert b.refusal([], [SeqBound(8, 8)] * 8, 0.0) is None
    assert b.refusal([], [SeqBound(8, 8)] * 9, 0.0) is not None
    assert b.capacity == 4 + MAX_QUEUE_BATCHES * 4  # the 400 threshold


def test_the_rate_counts_only_saturated_steps_and_needs_a_second_of_them() -> None:
    rate = ServiceRate()
    for i in range(100):
        rate.step(0.05, 4, saturated=False, now=i * 0.05)  # an engine with free slots says nothing of the queue
    assert rate.at(5.0) is None
    for i in range(int(MIN_SATURATED_S / 0.1) // 2):
        rate.step(0.1, 1, saturated=True, now=5.0 + i * 0.1)
    assert rate.at(5.5) is None  # half a second of saturated steps: not yet
    for i in range(int(MIN_SATURATED_S / 0.1)):
        rate.step(0.1, 1, saturated=True, now=5.5 + i * 0.1)
    assert rate.at(6.5) == pytest.approx(10.0)
    assert rate.at(6.5 + STALE_S + 1) is None  # stale after STALE_S without saturation
    rate.step(0.1, 0, saturated=True, now=6.5 + STALE_S + 2)
    assert rate.at(6.5 + STALE_S + 2) is None  # a new saturated period measures afresh


def test_a_slow_server_refuses_at_once_what_could_not_start_within_the_bound() -> None:
    """64 sequences finishing every 38 s (issue 46's machine), max_tokens unknown (the whole context): only the
    measured rate can admit, and only what it starts within 80% of the bound."""
    b = budget(max_num_seqs=64, bound=60.0)
    for i in range(40):
        b.observe_step(0.95, 0, 64, 0, 64, 1, 0, i * 0.95)
    b.observe_step(0.95, 0, 64, 64, 0, 1, 0, 40 * 0.95)
    per_s = b.rate.at(40 * 0.95)
    assert per_s == pytest.approx(64 / 38.95, rel=0.15)
    most = int(ADMIT_FRACTION * 60.0 * per_s)
    running = [SeqBound(100, 8000, 1)] * 64

    def refused(waiting: int) -> str | None:
        return b.refusal(running + [SeqBound(100, 8000)] * waiting, [SeqBound(100, 8000)], 40 * 0.95)

    assert most < 2 * 64 and refused(most - 1) is None
    why = refused(most)
    assert why is not None and "queue-time bound" in why and "sequences/s" in why


def test_an_explicit_depth_is_a_hard_cap_and_no_bound_means_only_the_configured_depth() -> None:
    b = budget(max_num_seqs=4, configured=2, explicit=True)
    b.observe_step(0.01, 8, 0, 0, 1, 0, 0, 0.0)
    assert b.capacity == 6
    assert b.refusal([SeqBound(8, 4)] * 6, [SeqBound(8, 4)], 0.1) is not None
    assert b.refusal([SeqBound(8, 4)] * 5, [SeqBound(8, 4)], 0.1) is None
    unbounded = budget(max_num_seqs=4, configured=4, bound=None)
    assert unbounded.refusal([SeqBound(8, 9000)] * 7, [SeqBound(8, 9000)], 0.0) is None
    assert unbounded.refusal([SeqBound(8, 9000)] * 8, [SeqBound(8, 9000)], 0.0) is not None


def test_a_continuing_part_is_refused_only_past_the_capacity() -> None:
    """A pooling request's later parts take the room their predecessor left (its own inputs never queue against
    it); the capacity still holds."""
    b = budget(max_num_seqs=4)
    assert b.refusal([SeqBound(8, 0)] * 30, [SeqBound(8, 0)] * 4, 0.0, continuing=True) is None
    assert b.refusal([SeqBound(8, 0)] * 34, [SeqBound(8, 0)] * 4, 0.0, continuing=True) is not None


def test_an_adapter_whose_slots_are_all_held_by_others_is_admitted_only_if_they_drain_in_time() -> None:
    """Two adapter slots held by running sequences of adapters a and b, seats free: a request for adapter c cannot
    start until one of them has drained (issue 64's soak: 503s after the whole bound for the third adapter). It is
    admitted when the holders end within 80% of the bound, refused at once with a 429 naming the slots otherwise;
    a request for a or b, or for the base model, is not held to that."""
    b = budget(max_num_seqs=16, bound=10.0)
    b.max_loras = 2
    for i in range(20):  # 0.1 s steps of 2 to 32 decodes: the fixed cost
        b.observe_step(0.1, 0, 2 << (i % 5), 0, 4, 0, 1000, i * 0.1)
    short = [SeqBound(50, 20, 1, "a"), SeqBound(50, 20, 1, "b")]  # ~19 steps left each: ~2 s
    assert b.refusal(short, [SeqBound(50, 20, lora="c")], 2.0) is None
    long = [SeqBound(50, 300, 1, "a"), SeqBound(50, 300, 1, "b")]  # ~299 steps left: ~30 s
    why = b.refusal(long, [SeqBound(50, 20, lora="c")], 2.0)
    assert why is not None and "LoRA adapter slot" in why and "'c'" in why
    assert b.refusal(long, [SeqBound(50, 20, lora="a")], 2.0) is None
    assert b.refusal(long, [SeqBound(50, 20)], 2.0) is None
