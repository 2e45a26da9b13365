"""The sampler against argmax, softmax frequencies and a sort-everything reference; penalties on hand-made
logits; logprobs; seeded determinism across batch compositions; SamplingParams validation."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from omforge.errors import OmforgeError
from omforge.runtime.sampler import LogprobEntry, Sampler, SamplerOutput, _truncate, with_logprobs
from omforge.runtime.sampling_params import SamplingParams, SamplingParamsError

V = 5000  # above the sampler's 1024 groups, not a multiple of them: padding and multi-token groups are live
EOS = 7


def peaked_logits(rng: np.random.Generator, rows: int, vocab: int = V) -> np.ndarray:
    """Logits shaped like a language model's: a noise floor and a few strong candidates per row."""
    x = rng.standard_normal((rows, vocab)).astype(np.float32) * 2
    for r in range(rows):
        x[r, rng.choice(vocab, 20, replace=False)] += rng.uniform(4, 12, 20).astype(np.float32)
    return x


def run(logits: np.ndarray, params: list[SamplingParams], seeds: list[int | None] | None = None,
        outputs: list[list[int]] | None = None, prompts: list[list[int]] | None = None,
        sampler: Sampler | None = None) -> SamplerOutput:
    R = len(params)
    gens = [None if s is None else np.random.default_rng(s) for s in (seeds or [None] * R)]
    return (sampler or Sampler([EOS], seed=0)).sample(logits, params, gens, outputs or [[]] * R,
                                                       prompts or [[]] * R)


def reference_kept(x: np.ndarray, t: float, k: int, p: float, min_p: float) -> np.ndarray:
    """vLLM's truncation by sorting the whole row in float64: top-k, then top-p on the renormalized
    top-k distribution, then min-p; ties with the boundary value are kept."""
    z = x.astype(np.float64) / t
    keep = np.ones(z.size, dtype=bool)
    desc = np.sort(z)[::-1]
    if 0 < k < z.size:
        keep &= z >= desc[k - 1]
    if p < 1:
        w = np.exp(desc - desc[0]) * (desc >= z[keep].min())
        cut = int(np.argmax(np.cumsum(w) >= p * w.sum()))
        keep &= z >= desc[cut]
    if min_p > 0:
        keep &= z >= z.max() + math.log(min_p)
    return keep


def test_greedy_is_argmax() -> None:
    x = peaked_logits(np.random.default_rng(0), 16)
    out = run(x, [SamplingParams(temperature=0.0)] * 16, seeds=list(range(16)))
    assert out.token_ids.dtype == np.int64
    np.testing.assert_array_equal(out.token_ids, x.argmax(axis=1))


@pytest.mark.parametrize("change", [dict(temperature=1e-6), dict(temperature=0.02), dict(top_k=1),
                                    dict(top_p=1e-6), dict(min_p=1.0)])
def test_degenerate_settings_are_greedy(change: dict) -> None:
    x = peaked_logits(np.random.default_rng(1), 32)
    x[np.arange(32), x.argmax(axis=1)] += 2  # a clear winner: at temperature 0.02 the rest is e^-100 away
    out = run(x, [SamplingParams(**change)] * 32, seeds=list(range(32)))
    np.testing.assert_array_equal(out.token_ids, x.argmax(axis=1))


def test_greedy_rows_consume_no_randomness() -> None:
    gen = np.random.default_rng(5)
    before = gen.bit_generator.state
    Sampler([EOS]).sample(peaked_logits(gen, 1), [SamplingParams(temperature=0.0)], [gen], [[]], [[]])
    after_logits = gen.bit_generator.state  # peaked_logits drew from gen; sampling must not
    Sampler([EOS]).sample(np.zeros((1, 10), np.float32), [SamplingParams(temperature=0.0)], [gen], [[]], [[]])
    assert gen.bit_generator.state == after_logits != before


def test_thresholds_match_sorting_reference() -> None:
    """Top-k/top-p via token groups equals sorting every row, on peaked, flat and tied rows, every path."""
    rng = np.random.default_rng(2)
    x = np.concatenate([peaked_logits(rng, 24), rng.standard_normal((8, V)).astype(np.float32),
                        np.round(peaked_logits(rng, 8) * 2) / 2])  # the last rows are full of ties
    S = x.shape[0]
    settings = [(k, p, t) for k in (0, 1, 5, 50, 300, 2000) for p in (1.0, 0.5, 0.9, 0.99) for t in (0.7, 1.3)
                if k or p < 1]
    picks = [settings[i % len(settings)] for i in rng.permutation(S * 3)]
    xs = np.concatenate([x, x, x])
    k = np.array([s[0] for s in picks], dtype=np.int64)
    p = np.array([s[1] for s in picks], dtype=np.float64)
    t = np.array([s[2] for s in picks], dtype=np.float32)
    threshold, _ = _truncate(xs, xs.max(axis=1), t, k, p)
    for r in range(xs.shape[0]):
        expected = reference_kept(xs[r], float(t[r]), int(k[r]), float(p[r]), 0.0)
        np.testing.assert_array_equal(xs[r] >= threshold[r], expected, err_msg=f"row {r}: k, p, t = {picks[r]}")


@pytest.mark.parametrize("setting", [dict(top_k=5), dict(top_p=0.8), dict(min_p=0.2),
                                     dict(top_k=40, top_p=0.9, min_p=0.05, temperature=0.7),
                                     dict(top_p=0.999, temperature=1.5)])
@pytest.mark.parametrize("shape", ["peaked", "flat"])
def test_samples_stay_in_the_kept_set(setting: dict, shape: str) -> None:
    rng = np.random.default_rng(3)
    row = peaked_logits(rng, 1) if shape == "peaked" else rng.standard_normal((1, V)).astype(np.float32)
    params = SamplingParams(**setting)
    out = run(np.repeat(row, 200, axis=0), [params] * 200, seeds=list(range(200)))
    kept = reference_kept(row[0], params.temperature, params.top_k, params.top_p, params.min_p)
    assert kept[out.token_ids].all()


def test_ties_at_the_top_k_boundary_are_all_kept() -> None:
    """vLLM keeps every token tied with the k-th value; the tied tokens sit in different token groups."""
    row = np.full(V, -10.0, dtype=np.float32)
    row[100] = 3.0
    row[[5, 1029, 4000]] = 2.0
    tokens = run(np.tile(row, (3000, 1)), [SamplingParams(top_k=2)] * 3000, sampler=Sampler([], seed=2)).token_ids
    assert set(tokens.tolist()) == {100, 5, 1029, 4000}


class ExtremeUniform:
    """A stand-in generator whose draw is fixed, to pin the ends of the inverse CDF."""

    def __init__(self, value: float):
        self.value = value

    def random(self) -> float:
        return self.value


@pytest.mark.parametrize("setting", [dict(), dict(top_k=30), dict(top_p=0.9), dict(min_p=0.1)])
def test_extreme_uniforms_pick_the_first_and_last_kept_tokens(setting: dict) -> None:
    row = peaked_logits(np.random.default_rng(8), 1)[0]
    params = SamplingParams(**setting)
    kept = np.flatnonzero(reference_kept(row, 1.0, params.top_k, params.top_p, params.min_p)
                          & (np.exp(row - row.max()) > 0))
    for value, expected in ((0.0, kept[0]), (np.nextafter(1.0, 0.0), kept[-1])):
        got = Sampler([]).sample(row[None], [params], [ExtremeUniform(value)], [[]], [[]]).token_ids[0]
        assert got == expected


def test_min_p_keeps_tokens_near_the_best() -> None:
    x = np.log(np.array([[0.5, 0.3, 0.15, 0.05]], dtype=np.float32)).repeat(200, axis=0)
    out = run(x, [SamplingParams(min_p=0.5)] * 200, seeds=list(range(200)))
    assert set(out.token_ids.tolist()) == {0, 1}  # p >= 0.5 * 0.5


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("temperature, top_k", [(1.0, 0), (0.6, 3)])
def test_frequencies_match_softmax(temperature: float, top_k: int) -> None:
    """20,000 draws over 5 tokens (fixed seed): chi-square below the 0.1% critical value for their dof."""
    logits = np.array([1.0, 0.5, 0.0, -0.5, -1.0], dtype=np.float32)
    sampler = Sampler([], seed=0)
    params = [SamplingParams(temperature=temperature, top_k=top_k)] * 4000
    tokens = np.concatenate([run(np.tile(logits, (4000, 1)), params, sampler=sampler).token_ids for _ in range(5)])
    z = logits.astype(np.float64) / temperature
    z[np.argsort(-z)[top_k:] if top_k else []] = -np.inf
    probs = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
    support = probs > 0
    counts = np.bincount(tokens, minlength=5)
    assert counts[~support].sum() == 0
    critical = {4: 18.47, 2: 13.82}[int(support.sum()) - 1]
    assert chi_square(counts[support], probs[support]) < critical


@pytest.mark.parametrize("top_p", [1.0, 0.999])
def test_frequencies_across_a_large_vocabulary(top_p: float) -> None:
    """The two-level inverse CDF (whole vocabulary) and the gathered path both pick by probability."""
    ids = np.array([3, 700, 2500, 2501, V - 1])
    row = np.full(V, -40.0, dtype=np.float32)
    row[ids] = [0.0, 1.0, 0.3, -0.4, 0.8]
    tokens = run(np.tile(row, (8000, 1)), [SamplingParams(top_p=top_p)] * 8000, sampler=Sampler([], seed=1)).token_ids
    assert np.isin(tokens, ids).all()
    probs = np.exp(row[ids] - row[ids].max())
    counts = np.array([(tokens == i).sum() for i in ids])
    assert chi_square(counts, probs / probs.sum()) < 18.47


def test_seeded_rows_ignore_batch_composition() -> None:
    """A seeded row samples the same tokens alone and amid greedy, unseeded and differently truncated rows."""
    rng = np.random.default_rng(4)
    targets = [SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=11),
               SamplingParams(top_p=0.95, seed=12), SamplingParams(temperature=1.2, min_p=0.02, seed=13),
               SamplingParams(seed=14)]
    others = [SamplingParams(temperature=0.0), SamplingParams(), SamplingParams(top_k=2000, top_p=0.5),
              SamplingParams(top_k=3), SamplingParams(top_p=0.999, seed=99)]
    steps = [peaked_logits(rng, len(targets)) for _ in range(6)]
    noise = [rng.standard_normal((len(others), V)).astype(np.float32) * 3 for _ in steps]

    def tokens(batch_of: int) -> list[list[int]]:
        gens = {i: np.random.default_rng(p.seed) for i, p in enumerate(targets)}
        out = []
        for x, flat in zip(steps, noise):
            if batch_of == 0:  # each target alone
                out.append([int(Sampler([EOS]).sample(x[i:i + 1], [p], [gens[i]], [[]], [[]]).token_ids[0])
                            for i, p in enumerate(targets)])
                continue
            order = np.random.default_rng(batch_of).permutation(len(targets) + len(others))
            rows = [("t", i) for i in range(len(targets))] + [("o", j) for j in range(len(others))]
            rows = [rows[o] for o in order]
            logits = np.stack([x[i] if kind == "t" else flat[i] for kind, i in rows])
            params = [targets[i] if kind == "t" else others[i] for kind, i in rows]
            gens_row = [gens[i] if kind == "t" else (np.random.default_rng(7) if others[i].seed else None)
                        for kind, i in rows]
            got = Sampler([EOS]).sample(logits, params, gens_row, [[]] * len(rows), [[]] * len(rows)).token_ids
            out.append([int(got[rows.index(("t", i))]) for i in range(len(targets))])
        return out

    alone = tokens(0)
    assert tokens(1) == alone
    assert tokens(2) == alone
    assert len({tuple(step) for step in alone}) > 1  # the rows really sampled


def test_penalties_change_the_right_logits() -> None:
    logits = np.array([[2.0, -1.0, 0.5, -0.5, 3.0, 1.0]] * 3, dtype=np.float32)
    before = logits.copy()
    params = [SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
              SamplingParams(),
              SamplingParams(repetition_penalty=0.5)]
    out = Sampler([EOS]).process_logits(logits, params, [[2, 2, 3], [2, 2, 3], [5]], [[0, 1], [0, 1], [4]])
    # repetition over prompt+output {0,1,2,3}: >0 divided, <=0 multiplied; then -0.5*count -0.25 on {2,3}
    np.testing.assert_allclose(out[0], [1.0, -2.0, 0.25 - 1.0 - 0.25, -1.0 - 0.5 - 0.25, 3.0, 1.0])
    np.testing.assert_array_equal(out[1], before[1])  # no penalties: untouched
    np.testing.assert_allclose(out[2], [2.0, -1.0, 0.5, -0.5, 6.0, 2.0])  # penalty < 1 rewards repeats
    np.testing.assert_array_equal(logits, before)  # the caller's logits are not modified


def test_repetition_penalty_steers_greedy() -> None:
    x = np.array([[3.0, 2.0, 0.0]], dtype=np.float32)
    greedy = SamplingParams(temperature=0.0)
    assert run(x, [greedy], outputs=[[0]]).token_ids[0] == 0
    assert run(x, [replace(greedy, repetition_penalty=2.0)], outputs=[[0]]).token_ids[0] == 1
    assert run(x, [replace(greedy, frequency_penalty=0.6)], outputs=[[0, 0]]).token_ids[0] == 1
    assert run(x, [replace(greedy, presence_penalty=1.5)], outputs=[[0]]).token_ids[0] == 1


def test_min_tokens_masks_eos_and_stop_tokens() -> None:
    x = np.zeros((1, 10), dtype=np.float32)
    x[0, EOS], x[0, 4], x[0, 1] = 5.0, 4.0, 3.0
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[4])
    assert run(x, [params], outputs=[[9]]).token_ids[0] == 1  # EOS and the stop token are masked
    assert run(x, [params], outputs=[[9, 9, 9]]).token_ids[0] == EOS  # min_tokens reached
    assert run(x, [replace(params, ignore_eos=True)], outputs=[[9]]).token_ids[0] == EOS  # EOS is no stop


def test_a_complete_grammar_wins_over_min_tokens() -> None:
    """Issue 24 defect 5: a row whose grammar allows only EOS (it is complete) samples EOS before min_tokens; with
    EOS masked too it took token 0, which its grammar forbids. A grammar that allows more keeps min_tokens."""
    x = np.zeros((2, 10), dtype=np.float32)
    x[:, 1], x[:, 5] = 3.0, 1.0
    params = [SamplingParams(temperature=0.0, min_tokens=4)] * 2
    only_eos, more = np.zeros((2, 10), np.uint8), np.zeros((2, 10), np.uint8)
    only_eos[:, EOS] = 1
    more[:, [EOS, 5]] = 1
    sampler = Sampler([EOS], seed=0)
    args = (x, params, [None, None], [[9], [9]], [[], []])
    assert sampler.sample(*args, allowed=(np.array([0]), only_eos[:1])).token_ids.tolist() == [EOS, 1]
    assert sampler.sample(*args, allowed=(np.array([0, 1]), more)).token_ids.tolist() == [5, 5]


def test_logprobs_are_raw_and_sorted() -> None:
    rng = np.random.default_rng(6)
    x = peaked_logits(rng, 4)
    x[3, [10, 20, 30]] = x[3].max() + 1  # a three-way tie for the best: ranked by token id
    params = [SamplingParams(), SamplingParams(logprobs=0),
              SamplingParams(logprobs=5, temperature=0.5, repetition_penalty=1.3), SamplingParams(logprobs=3)]
    out = run(x, params, seeds=[0, 1, 2, 3], outputs=[[], [], x[2].argsort()[-3:].tolist(), []])
    log_softmax = x.astype(np.float64) - np.log(np.exp(x - x.max(1, keepdims=True)).sum(1, keepdims=True)) \
        - x.max(1, keepdims=True)
    assert out.top_ids.shape == out.top_logprobs.shape == (4, 5)
    assert np.isnan(out.logprobs[0]) and (out.top_ids[0] == -1).all() and np.isnan(out.top_logprobs[0]).all()
    for r in (1, 2, 3):
        assert out.logprobs[r] == pytest.approx(log_softmax[r, out.token_ids[r]], abs=1e-4)
        expected_ids = np.lexsort((np.arange(V), -x[r]))[:5]
        np.testing.assert_array_equal(out.top_ids[r], expected_ids)
        np.testing.assert_allclose(out.top_logprobs[r], log_softmax[r, expected_ids], atol=1e-4)
        assert (np.diff(out.top_logprobs[r]) <= 0).all()
    np.testing.assert_array_equal(out.top_ids[3, :3], [10, 20, 30])
    flat = run(np.zeros((1, V), np.float32), [SamplingParams(logprobs=4)])  # all tied: the whole row is ranked
    np.testing.assert_array_equal(flat.top_ids[0], [0, 1, 2, 3])
    np.testing.assert_allclose(flat.top_logprobs[0], -np.log(V), rtol=1e-5)
    only_chosen = run(x[:2], [SamplingParams(logprobs=0)] * 2, seeds=[0, 1])
    assert only_chosen.top_ids is None and only_chosen.top_logprobs is None
    assert not np.isnan(only_chosen.logprobs).any()


def test_logprob_entries_are_built_from_the_arrays() -> None:
    """SamplerOutput.entries: one typed entry per row asked, plain Python values, the row's best k (none for 0 or
    when the batch computed none), a rank only where ranks were computed."""
    x = peaked_logits(np.random.default_rng(7), 3)
    tokens = x.argmin(axis=1).astype(np.int64)
    out = with_logprobs(x, tokens, [3, 1, 0], ranks=True)
    e = out.entries(1, [1])[0]
    assert isinstance(e, LogprobEntry) and type(e.token_id) is int and type(e.logprob) is float
    assert e.token_id == int(tokens[1]) and e.logprob == float(out.logprobs[1]) and e.rank == V
    assert e.top == ((int(out.top_ids[1, 0]), float(out.top_logprobs[1, 0])),)
    every = out.entries(3)
    assert [len(x.top) for x in every] == [3, 3, 3] and every[1].top[:1] == e.top
    assert out.entries(0, [2])[0].top == ()
    plain = with_logprobs(x, tokens, [0, None, 0])
    assert [(p.rank, p.top) for p in plain.entries(0, [0, 2])] == [(None, ()), (None, ())]


def test_batch_arguments_must_agree() -> None:
    with pytest.raises(ValueError, match="2 logit rows but 1 params"):
        Sampler([EOS]).sample(np.zeros((2, 4), np.float32), [SamplingParams()], [None], [[]], [[]])


def test_default_params_are_valid_and_stop_accepts_one_string() -> None:
    SamplingParams().validate()
    params = SamplingParams(stop="###", logprobs=20, top_k=-1, temperature=2, top_p=1, seed=-5)
    params.validate()
    assert params.stop == ["###"]
    assert SamplingParams().make_generator() is None
    draws = [params.make_generator(i).random() for i in (0, 1, 0)]
    assert draws[0] == draws[2] != draws[1]


@pytest.mark.parametrize("field, value, allowed", [
    ("n", 0, ">= 1"), ("max_tokens", 0, ">= 1"), ("min_tokens", -1, ">= 0"), ("min_tokens", 20, "max_tokens"),
    ("temperature", 2.5, "[0, 2]"), ("temperature", float("nan"), "[0, 2]"), ("temperature", "hot", "[0, 2]"),
    ("top_p", 0.0, "(0, 1]"), ("top_p", 1.5, "(0, 1]"), ("top_k", -2, "-1 or 0"), ("top_k", 2.5, "-1 or 0"),
    ("min_p", 1.5, "[0, 1]"), ("presence_penalty", 2.5, "[-2, 2]"), ("frequency_penalty", -3, "[-2, 2]"),
    ("repetition_penalty", 0.0, "> 0"), ("logprobs", 21, "[0, 20]"), ("logprobs", True, "[0, 20]"),
    ("seed", 2**64, "64-bit"), ("stop", [""], "non-empty"), ("stop_token_ids", [-1], ">= 0"),
    ("ignore_eos", "yes", "true or false"), ("logit_bias", {3: 150.0}, "[-100, 100]"),
])
def test_validation_names_the_parameter_and_range(field: str, value: object, allowed: str) -> None:
    with pytest.raises(SamplingParamsError) as err:
        replace(SamplingParams(), **{field: value}).validate()
    assert isinstance(err.value, OmforgeError)
    assert str(err.value).startswith(field) and allowed in str(err.value)
    assert err.value.param == field  # carried, not parsed back out of the message (issue 12 defect 8)
