"""Turn a step's logits into next tokens: penalties, min_tokens, temperature, top-k, top-p, min-p (vLLM's order).

Vectorized across the batch: every stage is array ops over ``[R, V]``; the only loop over rows draws each
row's one uniform from its own generator. Greedy rows take an argmax and never touch randomness.

Top-k, top-p and min-p each become one logit threshold per row, so the kept set is ``{x >= threshold}``
(ties at the boundary are kept, as in vLLM). Sampling is then an inverse CDF in token-id order over the kept
set, driven by one uniform per row. Everything a row's token depends on (its threshold, its masses, its
uniform) is computed from that row alone, so a seeded request samples the same tokens whatever else is in the
batch; the tests check this across batch compositions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from omforge.contract import cdiv
from omforge.runtime.sampling_params import GREEDY_TEMPERATURE, SamplingParams

GROUPS = 1024  # strided token groups for finding a row's best values without sorting it (see _Groups)
CDF_BLOCK = 256  # tokens per block of the two-level inverse CDF


@dataclass(frozen=True, slots=True)
class LogprobEntry:
    """One token's logprob, as every consumer reads it (sampled tokens, verified drafts, prompt positions).

    ``token_id`` and its raw ``logprob``; ``rank``: 1 + the tokens with a strictly larger logit, where computed
    (prompt logprobs, vLLM's field), else None; ``top``: the best alternatives as ``(token_id, logprob)`` pairs,
    best first, as many as the request asked (empty for 0). Built only by :meth:`SamplerOutput.entries`.
    """

    token_id: int
    logprob: float
    rank: int | None
    top: tuple[tuple[int, float], ...]


@dataclass
class SamplerOutput:
    """The sampled tokens of one step and their logprobs.

    Logprobs are **raw**: log-softmax of the logits the model produced, before penalties, temperature and
    truncation (vLLM v1's default ``logprobs_mode``; OpenAI's logprobs describe the model, not the sampler).
    Rows whose request asked for no logprobs (``logprobs is None``) get NaN in ``logprobs`` and NaN / -1 in
    the top arrays, which are computed only for rows that asked. ``top_*`` hold ``K`` = the largest
    ``logprobs`` in the batch, best first (ties by token id); a row that asked for fewer slices ``[:n]``.
    """

    token_ids: np.ndarray  # [R] int64
    logprobs: np.ndarray  # [R] float32: raw logprob of the chosen token
    top_ids: np.ndarray | None  # [R, K] int64, None when no row asked for K > 0
    top_logprobs: np.ndarray | None  # [R, K] float32
    ranks: np.ndarray | None = None  # [R] int64, when asked: 1 + the tokens whose logit exceeds the chosen one's

    def entries(self, k: int | Sequence[int], rows: Sequence[int] | None = None) -> list[LogprobEntry]:
        """The :class:`LogprobEntry` of each of ``rows`` (None: every row) with its best ``k`` alternatives
        (``k``: one count for all, or one per row): the one place entries are made, a whole batch's at once.
        Only rows that asked for logprobs have entries to give."""
        sel: slice | np.ndarray = slice(None) if rows is None else np.asarray(rows, dtype=np.int64)
        ids, lps = self.token_ids[sel].tolist(), self.logprobs[sel].tolist()
        ks = [k] * len(ids) if isinstance(k, int) else list(k)
        ranks = self.ranks[sel].tolist() if self.ranks is not None else [None] * len(ids)
        K = max(ks, default=0)
        if self.top_ids is not None and K > 0:
            tops = [tuple(zip(i[:n], v[:n])) for i, v, n in zip(self.top_ids[sel, :K].tolist(),
                                                                self.top_logprobs[sel, :K].tolist(), ks)]
        else:
            tops = [()] * len(ids)
        return [LogprobEntry(*e) for e in zip(ids, lps, ranks, tops)]


class Sampler:
    """Stateless across steps except for the shared random stream used by unseeded requests."""

    def __init__(self, eos_token_ids: Sequence[int], seed: int | None = None):
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self.rng = np.random.default_rng(seed)  # the stream of rows without a seeded generator of their own

    def sample(self, logits: np.ndarray, params: Sequence[SamplingParams],
               generators: Sequence[np.random.Generator | None], output_token_ids: Sequence[Sequence[int]],
               prompt_token_ids: Sequence[Sequence[int]],
               allowed: tuple[np.ndarray, np.ndarray] | None = None) -> SamplerOutput:
        """One token per row of ``logits [R, V]``. ``generators[r]`` is row r's seeded stream (None: shared).
        ``allowed``: (rows, 0/1 [len(rows), V]) — structured output: every other token of those rows is
        excluded after the logits processing, for the whole batch at once, by adding a 0 / -1e30 bias (cheaper than
        a masked write: benchmarks/RESULTS.md); logprobs stay the model's. A grammar that allows nothing but the
        tokens min_tokens masks (it is complete: only EOS) wins over min_tokens."""
        R, V = logits.shape
        if not len(params) == len(generators) == len(output_token_ids) == len(prompt_token_ids) == R:
            raise ValueError(f"sample: {R} logit rows but {len(params)} params, {len(generators)} generators, "
                             f"{len(output_token_ids)} outputs and {len(prompt_token_ids)} prompts")
        if allowed is not None:
            params = self._grammar_ends(params, output_token_ids, allowed)
        x = self.process_logits(logits, params, output_token_ids, prompt_token_ids)
        if allowed is not None:
            rows, mask = allowed
            if x is logits:
                x = x.copy()
            bias = mask.astype(np.float32)
            bias -= 1
            bias *= np.float32(1e30)
            x[rows] += bias
        temperature = np.array([p.temperature for p in params], dtype=np.float32)
        greedy = temperature < GREEDY_TEMPERATURE
        if greedy.all():
            tokens = x.argmax(axis=1).astype(np.int64)
        else:
            tokens = np.empty(R, dtype=np.int64)
            if greedy.any():
                tokens[greedy] = x[greedy].argmax(axis=1)
            rows = np.flatnonzero(~greedy)
            uniform = np.array([(generators[r] if generators[r] is not None else self.rng).random()
                                for r in rows])
            sub = [params[r] for r in rows]
            tokens[rows] = _sample_rows(_rows(x, rows), temperature[rows],
                                        np.array([p.top_k for p in sub], dtype=np.int64),
                                        np.array([p.top_p for p in sub], dtype=np.float64),
                                        np.array([p.min_p for p in sub], dtype=np.float32), uniform)
        return with_logprobs(logits, tokens, [p.logprobs for p in params])

    def _grammar_ends(self, params: Sequence[SamplingParams], output_token_ids: Sequence[Sequence[int]],
                      allowed: tuple[np.ndarray, np.ndarray]) -> Sequence[SamplingParams]:
        """``params`` with min_tokens lifted on the rows whose grammar allows only tokens min_tokens would mask:
        masking them leaves no allowed token, and the row would sample one its grammar forbids."""
        rows, mask = allowed
        out = None
        for i, r in enumerate(np.asarray(rows).tolist()):
            p = params[r]
            if len(output_token_ids[r]) >= p.min_tokens:
                continue
            stops = {*p.stop_token_ids, *([] if p.ignore_eos else self.eos_token_ids)}
            ok = np.flatnonzero(mask[i])
            if ok.size and stops.issuperset(ok.tolist()):
                out = out or list(params)
                out[r] = replace(p, min_tokens=0)
        return out or params

    def process_logits(self, logits: np.ndarray, params: Sequence[SamplingParams],
                       output_token_ids: Sequence[Sequence[int]],
                       prompt_token_ids: Sequence[Sequence[int]]) -> np.ndarray:
        """Logit bias, repetition penalty (prompt + output), frequency/presence penalties (output), the min_tokens
        mask.

        Touches only the (row, token) pairs that occur, never a dense ``[R, V]`` mask. Returns a float32 copy
        when anything applies, else ``logits`` itself (as float32), so an all-default batch copies nothing.
        """
        R, V = logits.shape
        rep = np.array([p.repetition_penalty for p in params], dtype=np.float32)
        freq = np.array([p.frequency_penalty for p in params], dtype=np.float32)
        pres = np.array([p.presence_penalty for p in params], dtype=np.float32)
        rep_rows = np.flatnonzero(rep != 1.0)
        fp_rows = np.flatnonzero((freq != 0.0) | (pres != 0.0))
        min_rows = [r for r, p in enumerate(params) if len(output_token_ids[r]) < p.min_tokens]
        bias_rows = [r for r, p in enumerate(params) if p.logit_bias]
        if not (rep_rows.size or fp_rows.size or min_rows or bias_rows):
            return np.asarray(logits, dtype=np.float32)
        out = np.array(logits, dtype=np.float32, order="C")
        flat = out.reshape(-1)
        for r in bias_rows:  # token ids beyond the vocabulary are rejected at admission (LLMEngine.check_request)
            bias = params[r].logit_bias
            flat[np.fromiter(bias, dtype=np.int64, count=len(bias)) + r * V] += np.fromiter(
                bias.values(), dtype=np.float32, count=len(bias))
        if rep_rows.size:  # vLLM: logit > 0 → logit / p, else logit * p, once per distinct token seen
            keys = np.concatenate([_flat_keys(V, rep_rows, prompt_token_ids),
                                   _flat_keys(V, rep_rows, output_token_ids)])
            vals, p = flat[keys], rep[keys // V]
            flat[keys] = np.where(vals > 0, vals / p, vals * p)  # duplicates write the same value
        if fp_rows.size:
            keys, counts = np.unique(_flat_keys(V, fp_rows, output_token_ids), return_counts=True)
            row = keys // V
            flat[keys] -= freq[row] * counts + pres[row]
        if min_rows:
            stops = {r: [t for t in params[r].stop_token_ids + ([] if params[r].ignore_eos else self.eos_token_ids)
                         if t < V] for r in min_rows}
            flat[_flat_keys(V, min_rows, stops)] = -np.inf
        return out


def _flat_keys(V: int, rows: Sequence[int],
               token_ids: Sequence[Sequence[int]] | dict[int, list[int]]) -> np.ndarray:
    """Indices into the flattened ``[R, V]`` logits of every (row, token) in ``token_ids[row]`` for ``rows``."""
    return np.concatenate([np.asarray(token_ids[r], dtype=np.int64) + r * V for r in rows] or
                          [np.empty(0, dtype=np.int64)])


def _sample_rows(x: np.ndarray, t: np.ndarray, top_k: np.ndarray, top_p: np.ndarray, min_p: np.ndarray,
                 uniform: np.ndarray) -> np.ndarray:
    """One token per row of logits ``x [S, V]`` at temperatures ``t``: inverse CDF in token-id order over the
    kept set. Thresholds stay in logit space (temperature does not reorder) and probabilities are
    :func:`_weights`, so ``x`` is neither copied nor changed."""
    S, V = x.shape
    m = x.max(axis=1)
    threshold = np.full(S, -np.inf, dtype=np.float32)
    use_min_p = min_p > 0  # p >= min_p * p_max  <=>  (x - x_max) / t >= log(min_p)
    threshold[use_min_p] = m[use_min_p] + t[use_min_p] * np.log(min_p[use_min_p])
    k = np.where((top_k > 0) & (top_k < V), top_k, 0)
    tokens = np.empty(S, dtype=np.int64)
    whole = np.ones(S, dtype=bool)  # rows sampled over the whole vocabulary
    cut = np.flatnonzero((k > 0) | (top_p < 1.0))
    if cut.size:
        thr, tiers = _truncate(_rows(x, cut), m[cut], t[cut], k[cut], top_p[cut])
        threshold[cut] = np.maximum(threshold[cut], thr)
        for best in tiers:
            inside = threshold[cut[best.rows]] >= best.bound
            if inside.any():  # every kept value is among the row's gathered values: sample among those few
                rows, vals = cut[best.rows[inside]], best.values[inside]
                kept = _weights(vals, m[rows], t[rows])
                kept *= vals >= threshold[rows, None]
                tokens[rows] = best.ids[inside][np.arange(rows.size), _inverse_cdf(kept, uniform[rows])]
                whole[rows] = False
    rows = np.flatnonzero(whole)
    if rows.size:
        xr = _rows(x, rows)
        kept = _weights(xr, m[rows], t[rows])
        if np.isfinite(threshold[rows]).any():
            kept *= xr >= threshold[rows, None]
        tokens[rows] = _blocked_inverse_cdf(kept, uniform[rows])
    return tokens


def _truncate(x: np.ndarray, m: np.ndarray, t: np.ndarray, k: np.ndarray,
              p: np.ndarray) -> tuple[np.ndarray, list[_Best]]:
    """Per-row logit threshold of top-k then top-p (p of the top-k renormalized mass), and the best values
    gathered on the way (rows that would need over a quarter of the vocabulary sort their whole row)."""
    S, V = x.shape
    groups = _Groups(x)
    need = k.copy()
    total = np.zeros(S, dtype=np.float64)  # the whole row's mass, for top-p-only rows
    p_only = np.flatnonzero(k == 0)
    if p_only.size:
        total[p_only] = _weights(_rows(x, p_only), m[p_only], t[p_only]).sum(axis=1, dtype=np.float64)
        # group maxima alone are a lower bound on the mass at or above them: once they carry p (with a margin
        # for rounding), the nucleus lies within those groups
        lower = np.cumsum(_weights(groups.best[p_only], m[p_only], t[p_only]), axis=1, dtype=np.float64)
        need[p_only] = (lower < (p[p_only] * total[p_only] * (1 + 1e-6))[:, None]).sum(axis=1) + 1
    tiers = groups.gather(need)
    threshold = np.empty(S, dtype=np.float32)
    wide = np.ones(S, dtype=bool)
    for best in tiers:
        r = best.rows
        threshold[r] = _threshold(np.sort(best.values, axis=1)[:, ::-1], m[r], t[r], k[r], p[r], total[r])
        wide[r] = False
    r = np.flatnonzero(wide)
    if r.size:
        threshold[r] = _threshold(np.sort(x[r], axis=1)[:, ::-1], m[r], t[r], k[r], p[r], total[r])
    return threshold, tiers


def _threshold(top: np.ndarray, m: np.ndarray, t: np.ndarray, k: np.ndarray, p: np.ndarray,
               total: np.ndarray) -> np.ndarray:
    """Threshold from ``top``: each row's values best first, every value >= its k-th / in its nucleus present.

    Top-p keeps the shortest best-first prefix whose mass reaches ``p`` of the top-k set's mass (``total``
    for rows without top-k). Prefix sums are sequential, so values past the cut never change the result.
    """
    rows = np.arange(top.shape[0])
    thr_k = np.where(k > 0, top[rows, np.maximum(k, 1) - 1], np.float32(-np.inf)).astype(np.float32)
    if not (p < 1.0).any():
        return thr_k
    weights = _weights(top, m, t)
    weights *= top >= thr_k[:, None]
    mass = np.cumsum(weights, axis=1, dtype=np.float64)
    total = np.where(k > 0, mass[:, -1], total)
    hit = mass >= (p * total)[:, None]
    # no hit: rounding left the nucleus a hair short of the whole top-k set (or row), which is then kept
    thr_p = np.where((p < 1.0) & hit.any(axis=1), top[rows, hit.argmax(axis=1)], np.float32(-np.inf))
    return np.maximum(thr_k, thr_p.astype(np.float32))


@dataclass
class _Best:
    """Some rows' best values, gathered in token-id order: every value >= ``bound[i]`` of row ``rows[i]`` is
    in ``values[i]`` (with its id in ``ids[i]``); values of extra groups, all below the bound, may be mixed in."""

    rows: np.ndarray  # [N]
    ids: np.ndarray  # [N, C] (ids >= V are -inf padding)
    values: np.ndarray  # [N, C]
    bound: np.ndarray  # [N]


class _Groups:
    """``x [S, V]`` split into ``GROUPS`` strided groups (group g = tokens g, g + GROUPS, …).

    A row's best ``n`` values lie in its ``n`` groups with the largest maxima (a group holding one of them has
    a maximum at least that large), so finding them reads only those groups instead of sorting the row.
    """

    def __init__(self, x: np.ndarray):
        S, V = x.shape
        self.vocab = V
        self.n_groups = min(GROUPS, V)
        self.width = cdiv(V, self.n_groups)
        if self.width * self.n_groups != V:
            padded = np.full((S, self.width * self.n_groups), -np.inf, dtype=np.float32)
            padded[:, :V] = x
            x = padded
        self.grid = np.ascontiguousarray(x).reshape(S, self.width, self.n_groups)  # [S, width, groups]
        self.gmax = self.grid.max(axis=1)
        self.best = np.sort(self.gmax, axis=1)[:, ::-1]  # group maxima, best first

    def gather(self, need: np.ndarray) -> list[_Best]:
        """Each row's best ``need[r]`` values, and every value tied with the ``need[r]``-th group maximum.

        Rows are gathered in tiers of similar size, so one row reading many groups does not make every row
        read as many. Rows that would read over a quarter of the vocabulary are left out.
        """
        bound = self.best[np.arange(need.size), np.clip(need, 1, self.n_groups) - 1]
        count = (self.gmax >= bound[:, None]).sum(axis=1)  # groups holding a value >= bound
        count[need > self.n_groups] = self.n_groups + 1
        limit = self.vocab // 4 // self.width
        tiers = []
        for low, high in ((0, min(16, limit)), (min(16, limit), min(64, limit)), (min(64, limit), limit)):
            rows = np.flatnonzero((count > low) & (count <= high))
            if not rows.size:
                continue
            g = int(count[rows].max())  # a row's g best groups hold every group reaching its bound
            chosen = np.sort(np.argpartition(-self.gmax[rows], g - 1, axis=1)[:, :g], axis=1)
            ids = (chosen[:, None, :] + self.n_groups * np.arange(self.width)[None, :, None]).reshape(rows.size, -1)
            values = np.take(self.grid, ids + (rows * self.grid[0].size)[:, None])
            tiers.append(_Best(rows, ids, values, bound[rows]))
        return tiers


def _weights(x: np.ndarray, m: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Unnormalized probabilities ``exp((x - max) / t)`` of ``x [S, C]``, in one new array."""
    w = x - m[:, None]
    w /= t[:, None]
    return np.exp(w, out=w)


def _rows(a: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``a[rows]`` without the copy when ``rows`` (sorted, distinct) is every row."""
    return a if rows.size == a.shape[0] else a[rows]


def _inverse_cdf(weights: np.ndarray, uniform: np.ndarray) -> np.ndarray:
    """Per row, the index where the running sum of ``weights [S, C]`` first exceeds ``uniform`` of the total."""
    # u < 1 keeps u * total below total (x * (1 - 2^-53) never rounds up to x), so the index exists, and the
    # running sum rises there, so its weight is positive
    cdf = np.cumsum(weights, axis=1, dtype=np.float64)
    return (cdf <= (uniform * cdf[:, -1])[:, None]).sum(axis=1)


def _blocked_inverse_cdf(weights: np.ndarray, uniform: np.ndarray) -> np.ndarray:
    """:func:`_inverse_cdf` over a whole vocabulary in two levels (blocks, then within one block): a running
    sum over all of ``[S, V]`` would cost more than the exp that made the weights."""
    S, V = weights.shape
    n_blocks = cdiv(V, CDF_BLOCK)
    if n_blocks * CDF_BLOCK != V:
        weights = np.pad(weights, ((0, 0), (0, n_blocks * CDF_BLOCK - V)))
    blocks = weights.reshape(S, n_blocks, CDF_BLOCK)
    mass = blocks.sum(axis=2).astype(np.float64)
    block = _inverse_cdf(mass, uniform)
    rows = np.arange(S)
    cdf = np.cumsum(mass, axis=1)
    before = cdf[rows, block] - mass[rows, block]
    within = np.clip((uniform * cdf[:, -1] - before) / mass[rows, block], 0.0, np.nextafter(1.0, 0.0))
    return block * CDF_BLOCK + _inverse_cdf(blocks[rows, block], within)


def with_logprobs(logits: np.ndarray, tokens: np.ndarray, num_logprobs: Sequence[int | None],
                  ranks: bool = False) -> SamplerOutput:
    """Raw logprobs of ``tokens`` and of each row's top ``num_logprobs[r]`` (None: the row asked for none).

    The one log-softmax and top-k of the runtime (sampled tokens, verified drafts, prompt logprobs): float32,
    ``logit - (max + log sum exp(logit - max))``; the top K best first with ties going to the lower token id.
    ``ranks``: also each token's rank, 1 + the tokens with a strictly larger logit (tied tokens share a rank;
    vLLM's rule), compared on the logits themselves (subtracting the lse in float32 could round neighbours together).
    """
    R, V = logits.shape
    chosen = np.full(R, np.nan, dtype=np.float32)
    rows = np.array([r for r, n in enumerate(num_logprobs) if n is not None], dtype=np.int64)
    if not rows.size:
        return SamplerOutput(tokens, chosen, None, None)
    raw = _rows(np.asarray(logits, dtype=np.float32), rows)
    m = raw.max(axis=1)
    lse = m + np.log(_weights(raw, m, np.ones_like(m)).sum(axis=1))
    picked = raw[np.arange(rows.size), tokens[rows]]
    chosen[rows] = picked - lse
    rank = None
    if ranks:
        rank = np.zeros(R, dtype=np.int64)
        rank[rows] = (raw > picked[:, None]).sum(axis=1) + 1
    K = min(max(num_logprobs[r] for r in rows), V)
    if K == 0:
        return SamplerOutput(tokens, chosen, None, None, rank)
    tiers = [(b.rows, b.ids, b.values) for b in _Groups(raw).gather(np.full(rows.size, K))]
    wide = np.setdiff1d(np.arange(rows.size), np.concatenate([b[0] for b in tiers] + [np.empty(0, np.int64)]))
    if wide.size:  # ties everywhere: rank the whole row
        tiers.append((wide, np.broadcast_to(np.arange(V), (wide.size, V)), raw[wide]))
    top_ids = np.full((R, K), -1, dtype=np.int64)
    top_logprobs = np.full((R, K), np.nan, dtype=np.float32)
    for sub, ids, vals in tiers:
        order = np.argsort(-vals, axis=1, kind="stable")[:, :K]  # ids ascend: ties go to the lower id
        top_ids[rows[sub]] = np.take_along_axis(ids, order, axis=1)
        top_logprobs[rows[sub]] = np.take_along_axis(vals, order, axis=1) - lse[sub, None]
    return SamplerOutput(tokens, chosen, top_ids, top_logprobs, rank)


def prompt_logprobs(logits: np.ndarray, targets: Sequence[int], k: int) -> list[LogprobEntry]:
    """The entry of each prompt token ``targets[i]`` from the logits row ``logits[i]`` that predicts it: its
    logprob and rank, and the top ``k`` when ``k > 0`` (:func:`with_logprobs`' rules)."""
    return with_logprobs(logits, np.asarray(targets, np.int64), [k] * len(targets), ranks=True).entries(k)
