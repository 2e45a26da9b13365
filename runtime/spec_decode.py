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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from omforge.contract.speculative import METHODS as METHODS
from omforge.contract.speculative import SpeculativeConfig as SpeculativeConfig
from omforge.contract.speculative import SpeculativeConfigError as SpeculativeConfigError


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
