"""How long a step will take, learnt from the steps the engine has run: the scheduler's time rule for mixed steps.

A step that carries running decodes is every running stream's inter-token gap. The token rules (a fixed prefill cap,
a token budget) bound its tokens, but what a token costs differs by two orders of magnitude between a 135M int4
bundle and a 1B float32 one (benchmarks/RESULTS.md, issue 48: a 64-token fp32 chunk beside ~6 decodes took 700 ms
on the 1B shape against a 130 ms decode-only step). The time rule bounds the step's time as well: a step with
decodes may last ``ratio`` times what its decodes alone would take, the prefill chunks taking what is left
(Sarathi-Serve sizes its token budget from a time-between-tokens target the same way, by profiling; here the
profile is the running engine).

The model: a step's seconds ≈ ``fixed_s + token_s · tokens`` (its decode and prefill tokens alike: a fixed part,
the weights streamed once, and a part per row — at 1B float32 a row is ~9 ms of GEMM whether it decodes or
prefills), fitted by least squares over the engine's recent steps, each weighted ``DECAY`` less per later step.
A per-kind model was tried first: the decode-only mean came from the few small decode-only steps a busy server
still runs, the prefill token then carried the rest of the decodes' cost, and at concurrency 32 the rule starved
prefill to its floor (TTFT p50 10.6 → 40.1 s; RESULTS 2026-12-06 "the time rule").
Invariants: nothing is predicted until the steps seen differ enough in tokens to separate the two costs
(:meth:`prefill_within` returns None: the caller keeps its token rule); a prediction is never below ``floor``.
"""

from __future__ import annotations

DECAY = 0.97  # each step's weight relative to the next one's: the fit follows a few dozen steps
MIN_TOKEN_SPREAD = 4.0  # the weighted standard deviation of the steps' tokens needed to fit a cost per token


class StepCost:
    """Exponentially weighted least squares of a step's seconds on its tokens."""

    def __init__(self) -> None:
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, prefill_tokens: int, decode_tokens: int, seconds: float) -> None:
        """One finished step: its prefill and decode tokens and its duration in seconds."""
        tokens = prefill_tokens + decode_tokens
        if seconds <= 0 or tokens <= 0:
            return
        self._w, self._x, self._y = DECAY * self._w + 1, DECAY * self._x + tokens, DECAY * self._y + seconds
        self._xx = DECAY * self._xx + tokens * tokens
        self._xy = DECAY * self._xy + tokens * seconds

    def fit(self) -> tuple[float, float] | None:
        """``(fixed_s, token_s)``, or None while the steps seen cannot separate them."""
        if self._w <= 0:
            return None
        mx, my = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mx * mx
        if var < MIN_TOKEN_SPREAD ** 2:
            return None
        token_s = (self._xy / self._w - mx * my) / var
        if token_s <= 0:
            return None
        return max(0.0, my - token_s * mx), token_s

    def prefill_within(self, ratio: float, decodes: int, floor: int) -> int | None:
        """Prefill tokens a step with ``decodes`` decodes may carry to last about ``ratio`` times the decodes alone
        (at least ``floor``); None while :meth:`fit` has nothing."""
        fitted = self.fit()
        if fitted is None:
            return None
        fixed_s, token_s = fitted
        return max(floor, int((ratio - 1.0) * (fixed_s + token_s * decodes) / token_s))
