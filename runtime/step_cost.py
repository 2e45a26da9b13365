"""How long a step will take, learnt from the steps the engine has run: the scheduler's time rule for mixed steps.

A step that carries running decodes is every running stream's inter-token gap. The token rules (a fixed prefill cap,
a token budget) bound its tokens, but what a token costs differs by two orders of magnitude between a 135M int4
bundle and a 1B float32 one (benchmarks/RESULTS.md, issue 48: a 64-token fp32 chunk beside ~6 decodes took 700 ms
on the 1B shape against a 123 ms decode-only step). The time rule bounds the step's time as well: a step with
decodes may last ``ratio`` times a decode-only step, the prefill chunks taking what is left (Sarathi-Serve sizes its
token budget from a time-between-tokens target the same way, by profiling; here the profile is the running engine).

The model, two exponentially weighted means over the engine's own steps (total step seconds, as a stream sees them):
  - ``decode_s``: steps that carried decodes and no prefill (the part of a mixed step that the decodes cost);
  - ``prefill_token_s``: steps that carried at least :data:`MIN_OBSERVED_PREFILL` prefill tokens, their seconds
    beyond ``decode_s`` (all of them before any decode-only step was seen) per prefill token.
Invariants: nothing is predicted until both means have a sample (:meth:`prefill_within` returns None: the caller
keeps its token rule); a prediction is never below ``floor`` tokens, so prefill always progresses.
"""

from __future__ import annotations

EWMA_WEIGHT = 0.25  # the newest step's share of a mean: it follows batch-size and context changes in a few steps
MIN_OBSERVED_PREFILL = 8  # steps with fewer prefill tokens say little about a prefill token's cost


class StepCost:
    """Running means of a decode-only step's seconds and a prefill token's seconds beyond it."""

    def __init__(self) -> None:
        self.decode_s: float | None = None
        self.prefill_token_s: float | None = None

    @staticmethod
    def _mean(old: float | None, new: float) -> float:
        return new if old is None else old + EWMA_WEIGHT * (new - old)

    def observe(self, prefill_tokens: int, decode_tokens: int, seconds: float) -> None:
        """One finished step: its prefill and decode tokens and its duration in seconds."""
        if seconds <= 0:
            return
        if decode_tokens and not prefill_tokens:
            self.decode_s = self._mean(self.decode_s, seconds)
        elif prefill_tokens >= MIN_OBSERVED_PREFILL:
            beyond = seconds - (self.decode_s or 0.0)
            if beyond > 0:
                self.prefill_token_s = self._mean(self.prefill_token_s, beyond / prefill_tokens)

    def prefill_within(self, ratio: float, floor: int) -> int | None:
        """Prefill tokens a step with decodes may carry to last about ``ratio`` decode-only steps (at least
        ``floor``); None while either mean has no sample yet."""
        if self.decode_s is None or self.prefill_token_s is None:
            return None
        return max(floor, int((ratio - 1.0) * self.decode_s / self.prefill_token_s))
