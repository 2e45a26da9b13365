"""Speculative decoding's pieces (runtime/spec_decode.py): the n-gram drafter, and verification — greedy keeps
exactly the target's argmax chain, and sampling with a point-mass draft leaves the output distribution equal to
the target's (a chi-square test at a fixed seed)."""

from __future__ import annotations

import numpy as np
import pytest

from omforge.runtime.spec_decode import NgramDrafter, SpeculativeConfig, SpeculativeConfigError, verify


def test_the_drafter_takes_the_longest_latest_match() -> None:
    d = NgramDrafter(2, 4)
    # "7 8 9" occurred twice; the suffix "7 8 9" (n = 3) matches, the latest occurrence is followed by 5 6
    seq = [1, 7, 8, 9, 2, 3, 7, 8, 9, 5, 6, 4, 7, 8, 9]
    assert d.propose(seq, 2) == [5, 6]
    assert d.propose(seq, 10) == [5, 6, 4, 7, 8, 9]  # runs on to the end of the sequence
    assert d.propose([1, 2, 3, 4, 5], 3) == []  # nothing repeats
    assert NgramDrafter(1, 1).propose([4, 1, 2, 4], 2) == [1, 2]
    assert d.propose([3], 2) == []


def test_speculative_config_is_vllms_spelling_and_checked() -> None:
    cfg = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5})
    assert (cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (3, 2, 5)
    for bad, msg in (({"method": "draft_model"}, "not built"), ({"num_speculative_tokens": 0}, r"\[1, 16\]"),
                     ({"prompt_lookup_min": 5, "prompt_lookup_max": 2}, "prompt_lookup_min"),
                     ({"lookahead": 2}, "unknown key")):
        with pytest.raises(SpeculativeConfigError, match=msg):
            SpeculativeConfig.from_dict(bad)


def test_greedy_verification_keeps_the_argmax_chain() -> None:
    rows = np.full((4, 6), -1.0)
    rows[0, 3], rows[1, 1], rows[2, 5], rows[3, 2] = 5, 5, 5, 5  # the target's argmax at each position
    assert verify(rows, [3, 1, 5], True, None) == [3, 1, 5, 2]  # all accepted, plus the bonus
    assert verify(rows, [3, 0, 5], True, None) == [3, 1]  # the first disagreement gives the target's token
    assert verify(rows[:1], [], True, None) == [3]  # no draft: a plain decode


@pytest.mark.parametrize("draft", [2, 4], ids=["likely-draft", "unlikely-draft"])
def test_sampling_verification_leaves_the_distribution_unchanged(draft: int) -> None:
    """Target p over 5 tokens; the draft proposes one fixed token. Over 60,000 trials the first emitted token
    must be distributed as p: chi-square statistic below the 99.9% quantile for 4 degrees of freedom (18.47),
    at a fixed seed. Accepted trials must also emit the bonus from the next row."""
    logits = np.log(np.array([0.1, 0.15, 0.4, 0.3, 0.05]))
    rows = np.stack([logits, np.log(np.array([0.2, 0.2, 0.2, 0.2, 0.2]))])
    rng = np.random.default_rng(1234)
    trials = 60_000
    first = np.empty(trials, np.int64)
    accepted = 0
    for t in range(trials):
        out = verify(rows, [draft], False, rng)
        first[t] = out[0]
        if out[0] == draft:
            accepted += 1
            assert len(out) == 2
    counts = np.bincount(first, minlength=5)
    expected = trials * np.exp(logits)
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 18.47, (counts, expected, chi2)
    assert abs(accepted / trials - np.exp(logits)[draft]) < 0.01  # acceptance rate = p(draft)


# --- in the engine and the server (SmolLM2) ----------------------------------------------------------------

PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain what a compiler does.",
    "List three fruits that are red.", "How many legs does a spider have?", "Give me a synonym for happy.",
    "What does a CPU cache do?", "Write one sentence about autumn.", "Why is the sky blue?",
    "Name two planets with rings.", "What is 12 times 12?", "Suggest a name for a black cat.",
    "How do plants make food?", "Translate 'good morning' into Spanish.", "What is a prime number?",
    "Describe a rainbow in ten words.", "Who wrote Romeo and Juliet?", "What is the boiling point of water?",
    "Copy this exactly: the quick brown fox jumps over the lazy dog, the quick brown fox jumps again.",
    "Repeat after me three times: omforge compiles and serves models.",
]
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
        "max_batch": 32, "min_acceptance": 0.0}


def chat(llm, text: str) -> list[int]:  # noqa: ANN001
    tok = llm.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)


def test_greedy_is_identical_with_speculation(smollm2_bundle) -> None:  # noqa: ANN001
    """20 prompts, batched, greedy: token for token the same with and without drafts — with EOS, stop strings,
    varied max_tokens and logprobs in the mix — while drafts were made and accepted; every block is free after."""
    from omforge import LLM, SamplingParams

    plain = LLM(smollm2_bundle, num_kv_blocks=256)
    spec = LLM(smollm2_bundle, num_kv_blocks=256, speculative_config=SPEC)
    prompts = [chat(plain, p) for p in PROMPTS]
    params = [SamplingParams(max_tokens=24 + 4 * (i % 5), temperature=0.0, logprobs=2 if i % 3 == 0 else None,
                             stop=[" the"] if i % 4 == 1 else []) for i in range(len(prompts))]
    want = plain.generate(prompts, params, use_tqdm=False)
    got = spec.generate(prompts, params, use_tqdm=False)
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids and g.text == w.text and g.finish_reason == w.finish_reason
        assert g.stop_reason == w.stop_reason
        if w.logprobs:
            assert [e.token_id for e in g.logprobs] == [e.token_id for e in w.logprobs]
            np.testing.assert_allclose([e.logprob for e in g.logprobs], [e.logprob for e in w.logprobs],
                                       atol=1e-4)
            assert [[t for t, _ in e.top] for e in g.logprobs] == [[t for t, _ in e.top] for e in w.logprobs]
    st = spec.engine.stats
    assert st.spec_draft_tokens > 0 and st.spec_accepted_tokens > 0 and st.steps < plain.engine.stats.steps
    assert spec.engine.kv.stats().num_used == 0
    spec.engine.kv.check_invariants()


def test_sampling_with_speculation_stays_seeded_and_within_limits(smollm2_bundle) -> None:  # noqa: ANN001
    from omforge import LLM, SamplingParams

    spec = LLM(smollm2_bundle, num_kv_blocks=128, speculative_config=SPEC)
    prompt = chat(spec, PROMPTS[18])
    params = SamplingParams(max_tokens=30, temperature=0.8, seed=5, ignore_eos=True)
    a = spec.generate([prompt], params, use_tqdm=False)[0]
    b = spec.generate([prompt], params, use_tqdm=False)[0]
    assert a.token_ids == b.token_ids and len(a.token_ids) == 30  # reproducible, max_tokens exact
    assert spec.engine.stats.spec_drafts > 0


def test_speculation_off_for_batches_above_max_batch(smollm2_bundle) -> None:  # noqa: ANN001
    from omforge import LLM, SamplingParams

    spec = LLM(smollm2_bundle, num_kv_blocks=128, speculative_config={**SPEC, "max_batch": 2})
    spec.generate([chat(spec, p) for p in PROMPTS[:4]], SamplingParams(max_tokens=8, temperature=0.0),
                  use_tqdm=False)
    assert spec.engine.stats.spec_drafts == 0  # 4 running > 2: nobody drafted


def test_server_with_speculation_answers_as_without(smollm2_bundle) -> None:  # noqa: ANN001
    import json

    from omforge import LLM, SamplingParams
    from server_process import ServerProcess

    srv = ServerProcess(smollm2_bundle, "--num-kv-blocks", "128", "--speculative-config", json.dumps(SPEC))
    try:
        client = srv.client()
        offline = LLM(smollm2_bundle, num_kv_blocks=64)
        wants = offline.generate([chat(offline, t) for t in PROMPTS], SamplingParams(max_tokens=32, temperature=0.0),
                                 use_tqdm=False)
        for text, want in zip(PROMPTS, wants):  # all 20, one at a time: every request may draft
            r = client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": text}],
                                               max_tokens=32, temperature=0.0)
            assert r.choices[0].message.content == want.text, text
        stream = client.chat.completions.create(model="smollm2-135m", max_tokens=32, temperature=0.0, stream=True,
                                                messages=[{"role": "user", "content": PROMPTS[18]}])
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert streamed == offline.generate([chat(offline, PROMPTS[18])], SamplingParams(max_tokens=32,
                                            temperature=0.0), use_tqdm=False)[0].text
        m = srv.metrics()
        assert m["omforge:spec_decode_num_draft_tokens_total"] >= m["omforge:spec_decode_num_accepted_tokens_total"] > 0
        assert m["omforge:spec_decode_num_accepted_tokens_per_pos_total{position=0}"] > 0
    finally:
        assert srv.stop() == 0, srv.log()
