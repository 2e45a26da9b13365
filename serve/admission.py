"""How many sequences the server lets wait: sized from the rate the engine has shown it serves, so a request that
could not start within ``max_queue_time_s`` hears 429 at once instead of a 503 after waiting the whole bound.

:class:`ServiceRate` is fed by the engine thread after every step: the step's length and how many sequences
finished in it, counted only while the engine was saturated (sequences waiting, or ``max_num_seqs`` running) —
then finishes are the pace at which a waiting sequence reaches a slot. Both sums decay with a time constant of
``HALF_LIFE_S``, so the rate follows the load's current request lengths. :class:`QueueBudget` reads it on the
event loop: a sequence that would be the ``k``-th waiting is admitted while ``k / rate`` stays within
``ADMIT_FRACTION`` of the bound; before any rate is known, the configured depth applies (by default one batch,
engine_config.QUEUE_BATCHES). The configured ``max_waiting_requests``, when a caller gives it, is a hard cap on
top; by default the measured depth may grow to ``MAX_QUEUE_BATCHES`` batches.

Invariant: the budget never admits more than ``max_num_seqs + hard cap`` sequences in flight.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

HALF_LIFE_S = 120.0
"""How fast the measured rate forgets: a step this many seconds ago counts half as much as one now. Long against
a batch's lifetime, because finishes come in bursts (a batch that shares its lengths ends in one step): right
after one such burst the estimate runs ~12% high with this half-life for a 39 s batch, inside ADMIT_FRACTION."""
ADMIT_FRACTION = 0.8
"""A sequence is admitted while its predicted wait is at most this fraction of ``max_queue_time_s`` (the rate is
an estimate; finishes come in bursts when a batch shares its lengths)."""
MIN_SATURATED_S = 1.0
"""The rate is trusted after this many seconds of saturated steps with at least one finish in them."""
MAX_QUEUE_BATCHES = 8
"""The deepest default queue the measured rate may justify, in batches of ``max_num_seqs``."""


@dataclass
class ServiceRate:
    """Sequences finished per second while saturated, exponentially decayed (engine thread writes, event loop
    reads ``per_second``: a float, replaced whole)."""

    half_life_s: float = HALF_LIFE_S
    _finished: float = 0.0
    _seconds: float = 0.0
    per_second: float | None = None  # None until MIN_SATURATED_S of saturated steps with a finish
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def step(self, seconds: float, finished: int, saturated: bool) -> None:
        """Record one engine step of ``seconds`` that finished ``finished`` sequences."""
        if not saturated or seconds <= 0:
            return
        with self._lock:
            keep = math.exp(-seconds * math.log(2) / self.half_life_s)
            self._finished = self._finished * keep + finished
            self._seconds = self._seconds * keep + seconds
            if self._seconds >= MIN_SATURATED_S and self._finished > 0:
                self.per_second = self._finished / self._seconds


@dataclass(frozen=True)
class QueueBudget:
    """Admission of waiting sequences (event loop). ``configured``: the waiting depth before a rate is known (and
    the hard cap when ``explicit``); ``max_queue_time_s`` None: no bound, so only the configured depth applies."""

    max_num_seqs: int
    configured: int
    explicit: bool
    max_queue_time_s: float | None
    rate: ServiceRate

    @property
    def capacity(self) -> int:
        """The most sequences ever in flight: what a request larger than this can never get (a 400, not a 429)."""
        return self.max_num_seqs + (self.configured if self.explicit else
                                    max(self.configured, MAX_QUEUE_BATCHES * self.max_num_seqs))

    def refusal(self, in_flight: int, num_seqs: int) -> str | None:
        """Why ``num_seqs`` more sequences are refused now (None: admitted), ``in_flight`` being those already
        running or waiting."""
        after = in_flight + num_seqs
        if after > self.capacity:
            return f"{in_flight} sequences running or waiting, limit {self.capacity}"
        waiting = after - self.max_num_seqs
        if waiting <= 0:
            return None
        rate = self.rate.per_second
        if rate is None or self.max_queue_time_s is None:
            if waiting > self.configured:
                return f"{in_flight} sequences running or waiting, limit {self.max_num_seqs + self.configured}"
            return None
        wait = waiting / rate
        if wait > ADMIT_FRACTION * self.max_queue_time_s:
            return (f"{waiting} sequences would be waiting, about {wait:.0f}s at the {rate:.2g} sequences/s this "
                    f"server is finishing, past the {self.max_queue_time_s:g}s queue-time bound")
        return None
