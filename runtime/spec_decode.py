"""Speculative decoding: n-gram (prompt lookup) drafts, verified in the paged step.

A decode step reads every weight once whatever the number of query rows, so a sequence can bring its next token
plus ``k`` drafted ones and keep the prefix the model agrees with. Drafts come from a :class:`Drafter`; the only one
built is :class:`NgramDrafter` (the longest suffix of the sequence, n in [min, max], that occurred earlier proposes
the tokens that followed it). The interface takes a sequence's tokens and returns up to ``k`` tokens, so a draft
model fits behind it later (it would also need its own KV; not built).

Verification (:func:`verify`) is exact. Greedy: drafted tokens are accepted while each equals the argmax of the
target row before it; the first row that disagrees gives its argmax instead (the "bonus" token when all agree).
Sampling: the draft is a point mass, so the standard speculative-sampling rule is: accept drafted ``x`` with
probability ``p(x)``; on rejection sample from ``p`` with ``x`` removed and renormalised — the output
distribution is exactly ``p`` (tests/test_spec_decode.py checks it statistically). The configuration's schema,
which a recipe validates too, is :mod:`omforge.contract.speculative`.

The policy the engine calls each step is :class:`SpeculativeDecoder`: :meth:`~SpeculativeDecoder.draft` before
scheduling, :meth:`~SpeculativeDecoder.verify` on each speculating sequence's logits rows after the step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from omforge.contract.speculative import METHODS as METHODS
from omforge.contract.speculative import SpeculativeConfig as SpeculativeConfig
from omforge.contract.speculative import SpeculativeConfigError as SpeculativeConfigError
from omforge.runtime.request import Request
from omforge.runtime.sampler import LogprobEntry, Sampler, with_logprobs
from omforge.runtime.sampling_params import GREEDY_TEMPERATURE, SamplingParams

# A sequence's acceptance (``Request.spec_acceptance``, from 1.0) is an exponential moving average of the fraction of
# each draft the model accepted: ``(1 - ACCEPTANCE_WEIGHT) * previous + ACCEPTANCE_WEIGHT * latest`` (0.7 / 0.3).
# Below ``min_acceptance`` the sequence stops drafting (it would pay the draft rows for nothing); the average is not
# updated without drafts, so the stop is for the rest of the request.
ACCEPTANCE_WEIGHT = 0.3


class Drafter(Protocol):
    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens that may follow ``token_ids`` (possibly none)."""
        ...


class NgramDrafter:
    """Prompt lookup: the longest suffix of ``token_ids`` of length n in [min_n, max_n] that occurs earlier;
    the tokens after its latest earlier occurrence are the draft."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        tokens = np.asarray(token_ids, dtype=np.int64)
        total = len(tokens)
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            suffix = tokens[total - n:]
            # every earlier start i (i + n < total) whose n tokens equal the suffix; the latest one wins
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:total - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start:start + k].tolist()
        return []


def verify(rows: np.ndarray, draft: Sequence[int], greedy: bool, rng: np.random.Generator | None,
           temperature: float = 1.0) -> list[int]:
    """The tokens a sequence keeps from one verification step. ``rows [len(draft) + 1, V]``: the target's
    processed logits at the sequence's last token and at each drafted position. Returns the accepted drafted
    tokens followed by one more token (the correction at the first rejection, or the bonus after all)."""
    out: list[int] = []
    for i, x in enumerate(draft):
        row = rows[i]
        if greedy:
            best = int(np.argmax(row))
            if best != x:
                return [*out, best]
            out.append(int(x))
            continue
        p = _probs(row, temperature)
        if rng.random() < p[x]:
            out.append(int(x))
            continue
        p[x] = 0.0  # the residual (p - point mass)+, renormalised
        total = p.sum()
        if total <= 0:  # p was the point mass itself: x is certain (cannot be rejected in exact arithmetic)
            return [*out, int(x)]
        return [*out, int(np.searchsorted(np.cumsum(p / total), rng.random(), side="right").clip(0, len(p) - 1))]
    last = rows[len(draft)]
    if greedy:
        return [*out, int(np.argmax(last))]
    p = _probs(last, temperature)
    return [*out, int(np.searchsorted(np.cumsum(p), rng.random() * p.sum(), side="right").clip(0, len(p) - 1))]


def _probs(row: np.ndarray, temperature: float) -> np.ndarray:
    x = row.astype(np.float64) / max(temperature, 1e-6)
    x -= x.max()
    p = np.exp(x)
    p /= p.sum()
    return p


def verifiable(p: SamplingParams, num_output: int) -> bool:
    """Whether a point-mass draft can be verified exactly against this request's sampling: the per-row
    distribution must not depend on earlier drafted tokens (penalties, min_tokens) nor be truncated (top-k/p,
    min-p; verify() samples the full distribution)."""
    plain = p.top_k <= 0 and p.top_p >= 1.0 and p.min_p <= 0.0
    no_penalty = p.presence_penalty == 0 and p.frequency_penalty == 0 and p.repetition_penalty == 1.0
    return (p.temperature < GREEDY_TEMPERATURE or plain) and no_penalty and num_output >= p.min_tokens


@dataclass(frozen=True)
class Verified:
    """One sequence's verification: ``tokens`` (the accepted drafted tokens, then the correction or bonus) out of
    ``num_drafted``; ``logprobs``: the kept tokens' entries when the request asks (the model's raw logprobs, as
    without drafts), else None."""

    tokens: list[int]
    num_drafted: int
    logprobs: list[LogprobEntry] | None

    @property
    def num_accepted(self) -> int:
        return len(self.tokens) - 1


class SpeculativeDecoder:
    """The speculative-decoding policy: which running sequences draft this step, and what each keeps.

    Invariant: a draft lives one step (``draft`` clears every running sequence's before proposing, so no stale
    draft survives a preemption). A sequence drafts only when the batch is at most ``max_batch`` (beyond it the
    step is compute-bound), it is decoding (one known token to compute), its sampling can be verified exactly
    (:func:`verifiable`; no grammar, no unforked followers), it has room for a bonus token, and its acceptance
    average (:data:`ACCEPTANCE_WEIGHT`) has not fallen below ``min_acceptance``."""

    def __init__(self, config: SpeculativeConfig, sampler: Sampler, max_model_len: int):
        self.config = config
        self.sampler = sampler
        self.max_model_len = max_model_len
        self.drafter: Drafter = NgramDrafter(config.prompt_lookup_min, config.prompt_lookup_max)

    def draft(self, running: Sequence[Request]) -> None:
        """Set ``req.draft`` of every running sequence: its proposal, or [] when it does not speculate."""
        spec = self.config
        for req in running:
            req.draft = []
        if len(running) > spec.max_batch:
            return
        for req in running:
            p = req.params
            left = min(p.max_tokens - len(req.output_token_ids) if p.max_tokens is not None else 1 << 30,
                       self.max_model_len - req.num_tokens) - 1
            if (req.num_tokens - req.num_computed_tokens != 1 or not req.output_token_ids or req.followers
                    or left < 1 or req.matcher is not None or (req.reasoning is not None and req.reasoning.steers)
                    or req.spec_acceptance < spec.min_acceptance or not verifiable(p, len(req.output_token_ids))):
                continue
            req.draft = self.drafter.propose(req.all_token_ids, min(spec.num_speculative_tokens, left))

    def verify(self, req: Request, rows: np.ndarray) -> Verified:
        """What ``req`` keeps of its draft (``rows``: raw logits at its last token and at each drafted one);
        updates its acceptance average."""
        p, draft = req.params, list(req.draft)
        x = self.sampler.process_logits(rows, [p] * len(rows), [req.output_token_ids] * len(rows),
                                        [req.prompt_token_ids] * len(rows))
        gen = req.generator if req.generator is not None else self.sampler.rng
        kept = verify(x, draft, p.temperature < GREEDY_TEMPERATURE, gen, p.temperature)
        accepted = (len(kept) - 1) / len(draft)
        req.spec_acceptance = (1 - ACCEPTANCE_WEIGHT) * req.spec_acceptance + ACCEPTANCE_WEIGHT * accepted
        entries = None
        if p.logprobs is not None:
            entries = with_logprobs(rows[:len(kept)], np.asarray(kept, np.int64),
                                    [p.logprobs] * len(kept)).entries(p.logprobs)
        return Verified(kept, len(draft), entries)
