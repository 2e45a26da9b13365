"""Admission: a request is queued only while its sequences are predicted to start within ``max_queue_time_s``;
otherwise it hears 429 at once instead of a 503 after waiting the whole bound.

The engine thread reports every step (:meth:`QueueBudget.observe_step`): its seconds and tokens (the step cost,
:class:`StepTiming`), the sequences it finished (the pace, :class:`ServiceRate`) and what the engine holds after it
(:class:`EngineLoad`). The event loop asks :meth:`QueueBudget.refusal` with the sequences in flight (each a
:class:`SeqBound`, in arrival order) and the new ones. Two predictions of when the last new sequence starts, and
either one within ``ADMIT_FRACTION`` of the bound admits:

- measured: sequences finished per second while the engine was saturated (a sequence waited in it, or every slot
  ran), so the ``k``-th waiting sequence starts after about ``k / rate``. It describes the load of the latest
  saturated period: after ``STALE_S`` without saturation it is set aside, and the next period measures afresh.
- bounded (:meth:`QueueBudget.worst_start`): every sequence runs to its ``max_tokens``, slots and KV blocks (each
  sequence's whole length) are taken in arrival order, and a step lasts what the engine's own steps say a step of
  that many tokens lasts. Known from the first timed step on.

A sequence whose LoRA adapter would find every adapter slot held by others (``max_loras`` other adapters in
flight) starts only as those drain, whatever the seats and the pace: once a step is timed it is admitted by the
bounded prediction alone, which lets an adapter start only while it holds a slot or one is free.

Waiting is counted against the batch the engine runs: ``max_num_seqs``, or the running count while the KV pool
holds sequences back (some wait, the pool is full). What starts now is always admitted; before the engine has
timed a step, nothing more — but a request on an idle server, up to the configured depth (by default one batch,
engine_config.QUEUE_BATCHES). ``max_queue_time_s`` None: only the configured depth applies; a
``max_waiting_requests`` the caller gave is a hard cap on top.

Invariant: never more than :attr:`QueueBudget.capacity` sequences in flight.
"""

from __future__ import annotations

import heapq
import math
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from omforge.runtime.step_cost import StepCost

HALF_LIFE_S = 120.0
"""How fast the measured rate forgets: a saturated step this many saturated seconds ago counts half as much as one
now. Long against a batch's lifetime, because finishes come in bursts (a batch that shares its lengths ends in one
step): right after one such burst the estimate runs ~12% high for a 39 s batch, inside ADMIT_FRACTION."""
ADMIT_FRACTION = 0.8
"""A sequence is admitted while its predicted wait is at most this fraction of ``max_queue_time_s`` (both
predictions are estimates: finishes come in bursts, step times drift as contexts grow)."""
MIN_SATURATED_S = 1.0
"""The rate is trusted after this many seconds of saturated steps with at least one finish in them."""
STALE_S = 30.0
"""The measured rate is set aside after this many seconds without a saturated step: it describes the lengths of
a load that is gone (an idle server kept a rate of long generations and refused short requests)."""
MAX_QUEUE_BATCHES = 8
"""The deepest default queue a prediction may justify, in batches of ``max_num_seqs``."""
TIMING_WINDOW = 32
"""Steps :class:`StepTiming` keeps for its estimate before the cost fit can separate fixed and per-token costs."""


@dataclass
class SeqBound:
    """One sequence as admission sees it: its prompt's tokens, the most tokens it may generate (0: a pooling
    input), the tokens it has generated (0: not started) and its LoRA adapter (None: the base model)."""

    prompt: int
    max_new: int
    generated: int = 0
    lora: str | None = None

    def steps_left(self, chunk: int) -> int:
        """Steps until it ends at the latest: its prompt's prefill chunks (none once it generates), then one per
        token after the first (which comes with the last chunk)."""
        if self.generated:
            return max(1, self.max_new - self.generated)
        return max(1, -(-self.prompt // chunk) + self.max_new - 1)

    def tokens_left(self) -> int:
        """Tokens its remaining steps compute: the prompt (not started) and the tokens still to generate."""
        return (0 if self.generated else self.prompt) + max(0, self.max_new - self.generated)

    def blocks(self, block_size: int) -> int:
        """KV blocks it holds at its longest."""
        return -(-(self.prompt + self.max_new) // block_size)


@dataclass(frozen=True)
class EngineLoad:
    """The engine after its latest step: sequences running (after the step's finishes), requests waiting in it,
    and whether the KV pool held waiting ones back (``running`` is then the batch it can run)."""

    running: int = 0
    waiting: int = 0
    kv_bound: bool = False


@dataclass
class ServiceRate:
    """Sequences finished per second while saturated, exponentially decayed (the engine thread writes; the event
    loop reads :meth:`at`)."""

    half_life_s: float = HALF_LIFE_S
    _finished: float = 0.0
    _seconds: float = 0.0
    _per_second: float | None = None  # None until MIN_SATURATED_S of saturated steps with a finish
    _last: float | None = None  # when the latest saturated step ended (time.monotonic())
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def step(self, seconds: float, finished: int, saturated: bool, now: float) -> None:
        """Record one engine step of ``seconds`` that ended at ``now`` and finished ``finished`` sequences."""
        if not saturated or seconds <= 0:
            return
        with self._lock:
            if self._last is not None and now - self._last > STALE_S:  # a new saturated period: measure afresh
                self._finished = self._seconds = 0.0
                self._per_second = None
            keep = math.exp(-seconds * math.log(2) / self.half_life_s)
            self._finished = self._finished * keep + finished
            self._seconds = self._seconds * keep + seconds
            if self._seconds >= MIN_SATURATED_S and self._finished > 0:
                self._per_second = self._finished / self._seconds
            self._last = now

    def at(self, now: float) -> float | None:
        """The rate at ``now``: None before it is measured, or when no step was saturated for ``STALE_S``."""
        last = self._last
        return self._per_second if last is not None and now - last <= STALE_S else None


class StepTiming:
    """Seconds a step of ``tokens`` tokens takes, from the engine's steps (the engine thread observes; the event
    loop reads one published tuple): runtime/step_cost.py's fit of fixed and per-token costs (the latest one: steps
    of one size, as a steady decode load runs, cannot separate them again, but the machine's costs stay), or
    before any fit, the slowest recent step scaled up in proportion to more tokens (an over-estimate)."""

    def __init__(self) -> None:
        self._cost = StepCost()
        self._recent: deque[tuple[int, float]] = deque(maxlen=TIMING_WINDOW)
        self._fit: tuple[float, float] | None = None
        self._published: tuple[tuple[float, float] | None, tuple[tuple[int, float], ...]] | None = None

    def observe(self, prefill_tokens: int, decode_tokens: int, seconds: float) -> None:
        """One step's tokens and seconds (steps of no tokens say nothing)."""
        tokens = prefill_tokens + decode_tokens
        if tokens <= 0 or seconds <= 0:
            return
        self._cost.observe(prefill_tokens, decode_tokens, seconds)
        self._recent.append((tokens, seconds))
        self._fit = self._cost.fit() or self._fit
        self._published = (self._fit, tuple(self._recent))

    def seconds(self, tokens: float) -> float | None:
        """A step of ``tokens`` tokens, in seconds; None before any step."""
        published = self._published
        if published is None:
            return None
        fit, recent = published
        if fit is not None:
            return fit[0] + fit[1] * tokens
        return max(s * max(1.0, tokens / t) for t, s in recent)


@dataclass
class QueueBudget:
    """Admission of waiting sequences (module docstring). ``configured``: the waiting depth without a queue-time
    bound (and the hard cap when ``explicit``); ``token_budget``: the tokens one step carries; ``num_kv_blocks``
    of ``block_size`` tokens (0: no KV pool, a pooling engine)."""

    max_num_seqs: int
    configured: int
    explicit: bool
    max_queue_time_s: float | None
    token_budget: int = 512
    num_kv_blocks: int = 0
    block_size: int = 1
    max_loras: int = 0  # adapter slots (0: no LoRA)
    rate: ServiceRate = field(default_factory=ServiceRate)
    timing: StepTiming = field(default_factory=StepTiming)
    load: EngineLoad = field(default_factory=EngineLoad)  # replaced whole by the engine thread

    @property
    def capacity(self) -> int:
        """The most sequences ever in flight: what a request larger than this can never get (a 400, not a 429)."""
        return self.max_num_seqs + (self.configured if self.explicit else
                                    max(self.configured, MAX_QUEUE_BATCHES * self.max_num_seqs))

    # --- the engine thread --------------------------------------------------------------------------------

    def observe_step(self, seconds: float, prefill_tokens: int, decode_tokens: int, finished: int, running: int,
                     waiting: int, free_blocks: int, now: float) -> None:
        """One engine step: its seconds and tokens, the sequences it finished, and the engine after it (sequences
        running, requests waiting, KV blocks free). Saturated: something waited through the step, or every slot
        ran."""
        self.timing.observe(prefill_tokens, decode_tokens, seconds)
        saturated = waiting > 0 or running + finished >= self.max_num_seqs
        self.rate.step(seconds, finished, saturated, now)
        # the pool holds waiting sequences back when it has no room left for one step's prefill
        kv_bound = (waiting > 0 and running < self.max_num_seqs and self.num_kv_blocks > 0
                    and free_blocks * self.block_size < min(self.token_budget, self.num_kv_blocks * self.block_size))
        self.load = EngineLoad(running, waiting, kv_bound)

    # --- the event loop -----------------------------------------------------------------------------------

    def slots(self) -> int:
        """The batch the engine runs: ``max_num_seqs``, or what runs while the KV pool holds the rest back."""
        load = self.load
        return max(1, min(load.running, self.max_num_seqs)) if load.kv_bound else self.max_num_seqs

    def refusal(self, in_flight: Sequence[SeqBound], new: Sequence[SeqBound], now: float,
                continuing: bool = False) -> str | None:
        """Why the sequences ``new`` are refused now (None: admitted); ``in_flight``: those already running or
        waiting, in arrival order. ``continuing``: the next part of a request already admitted (a pooling
        request's inputs beyond its first batch), which only the capacity refuses."""
        after = len(in_flight) + len(new)
        if after > self.capacity:
            return f"{len(in_flight)} sequences running or waiting, limit {self.capacity}"
        if continuing:
            return None
        if self.max_queue_time_s is not None and self.lora_contended(in_flight, new):
            worst = self.worst_start(in_flight, new)
            if worst is not None:  # untimed: the seats' rules below (no prediction of the slots yet)
                return self._lora_refusal(worst, new[0].lora, self.max_queue_time_s)
        queued = after - self.slots()
        if queued <= 0:
            return None
        bound = self.max_queue_time_s
        if bound is None:
            if queued > self.configured:
                return f"{len(in_flight)} sequences running or waiting, limit {self.max_num_seqs + self.configured}"
            return None
        most = ADMIT_FRACTION * bound
        rate = self.rate.at(now)
        if rate is not None and queued / rate <= most:
            return None
        worst = self.worst_start(in_flight, new)
        if worst is not None and worst <= most:
            return None
        measured = f"{queued / rate:.0f}s at the {rate:.2g} sequences/s this server finishes" if rate else None
        bounded = f"{worst:.0f}s if every sequence runs to its max_tokens" if worst is not None else None
        if measured is None and bounded is None:
            if not in_flight and queued <= self.configured:  # an idle server, not yet timed: the configured depth
                return None
            return f"{queued} sequences would wait and the server has not yet timed a step; retry in a moment"
        return (f"{queued} sequences would wait, the last starting after about "
                f"{' or '.join(w for w in (measured, bounded) if w)}, past {ADMIT_FRACTION:.0%} of the "
                f"{bound:g}s queue-time bound")

    def lora_contended(self, in_flight: Sequence[SeqBound], new: Sequence[SeqBound]) -> bool:
        """Whether ``new``'s adapter may find every slot held: ``max_loras`` other adapters among the sequences in
        flight (a free seat does not start it then; neither pace nor seats predict when it does)."""
        lora = new[0].lora if new else None
        if lora is None or not self.max_loras:
            return False
        return len({s.lora for s in in_flight if s.lora is not None} - {lora}) >= self.max_loras

    def _lora_refusal(self, worst: float, lora: str | None, bound: float) -> str | None:
        """Admission of an adapter's sequences while other adapters hold every slot, by the bounded prediction
        alone (``worst``: when the last of them starts; slots drain as their sequences end)."""
        if worst <= ADMIT_FRACTION * bound:
            return None
        return (f"every LoRA adapter slot ({self.max_loras}) is held by other adapters; '{lora}' would start after "
                f"about {worst:.0f}s if every sequence runs to its max_tokens, past {ADMIT_FRACTION:.0%} of the "
                f"{bound:g}s queue-time bound")

    def worst_start(self, in_flight: Sequence[SeqBound], new: Sequence[SeqBound]) -> float | None:
        """Seconds until the last of ``new`` starts if every sequence runs to its ``max_tokens``: slots and KV blocks
        are taken in arrival order (started sequences hold theirs), a sequence with an adapter starts only while
        its adapter holds a slot or one is free (``max_loras``), and each step carries the slots' share of the
        work, at the seconds :class:`StepTiming` gives for that many tokens (more than a step's token budget
        stretches the steps). None before any timed step."""
        chunk, slots = max(1, self.token_budget), self.slots()
        seqs = [*in_flight, *new]
        steps = sum(s.steps_left(chunk) for s in seqs)
        tokens = sum(s.tokens_left() for s in seqs)
        demand = slots * tokens / max(1, steps)  # tokens a step carries with every slot busy
        step_s = self.timing.seconds(min(demand, chunk))
        if step_s is None:
            return None
        stretch = max(1.0, demand / chunk)
        total = self.num_kv_blocks
        ends: list[tuple[int, int, str]] = []  # (the step it ends at the latest, its blocks, its adapter or "")
        users: dict[str, int] = {}  # adapter → sequences holding its slot
        used = 0

        def start(s: SeqBound, at: int, need: int) -> None:
            heapq.heappush(ends, (at + s.steps_left(chunk), need, s.lora or ""))
            if s.lora is not None:
                users[s.lora] = users.get(s.lora, 0) + 1

        def lora_blocked(s: SeqBound) -> bool:
            return (s.lora is not None and self.max_loras > 0 and not users.get(s.lora)
                    and len(users) >= self.max_loras)

        for s in in_flight:
            if s.generated:
                need = min(s.blocks(self.block_size), total) if total else 0
                start(s, 0, need)
                used += need
        clock = 0
        for s in [*(s for s in in_flight if not s.generated), *new]:
            need = min(s.blocks(self.block_size), total) if total else 0
            while ends and (len(ends) >= slots or (total and used + need > total) or lora_blocked(s)):
                end, freed, lora = heapq.heappop(ends)
                clock, used = max(clock, end), used - freed
                if lora:
                    users[lora] -= 1
                    if not users[lora]:
                        del users[lora]
            start(s, clock, need)
            used += need
        return clock * stretch * step_s
