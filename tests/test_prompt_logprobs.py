"""Prompt logprobs (``SamplingParams.prompt_logprobs``): the step returns a logits row for every token of a
prompt chunk that asks, and the engine records log P(prompt[t] | prompt[:t]) for t ≥ 1 (the first is None).
Checked against the unfused export run over the whole prompt at once, through chunked prefill, next to other
requests, and after the prompt is in the prefix cache (prompt logprobs are computed, never read from it)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from helpers import TINY_RECIPE, compile_bundle
from omforge import LLM, SamplingParams
from omforge.runtime.engine import LLMEngine


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("prompt-logprobs")
    return compile_bundle(TINY_RECIPE, root / "bundle", root / "cache")


def reference(bundle: Path, prompt: list[int]) -> np.ndarray:
    """log-softmax of the unfused export's logits over the whole prompt: row t predicts token t + 1."""
    export = Path(json.loads((bundle / "manifest.json").read_text())["export"]["dir"])
    session = ort.InferenceSession(str(export / "model.onnx"), providers=["CPUExecutionProvider"])
    ids = np.asarray([prompt], np.int64)
    logits = session.run(None, {"input_ids": ids, "position_ids": np.arange(len(prompt))[None]})[0][0]
    x = logits.astype(np.float64)
    return x - (np.log(np.exp(x - x.max(1, keepdims=True)).sum(1)) + x.max(1))[:, None]


PROMPTS = [[int(t) for t in np.random.default_rng(s).integers(3, 250, n)] for s, n in ((0, 37), (1, 90), (2, 5))]


@pytest.mark.parametrize("budget", [512, 16], ids=["one-chunk", "chunked"])
def test_prompt_logprobs_match_the_whole_prompt_forward(bundle: Path, budget: int) -> None:
    llm = LLM(bundle, max_num_batched_tokens=budget)
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3)
    plain = SamplingParams(max_tokens=4, temperature=0.0)  # batched beside them: unaffected, no prompt logprobs
    outs = llm.generate([*PROMPTS, PROMPTS[0]], [params] * len(PROMPTS) + [plain], use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ref = reference(bundle, prompt)
        pl = out.prompt_logprobs
        assert pl is not None and len(pl) == len(prompt) and pl[0] is None
        for t in range(1, len(prompt)):
            e = pl[t]
            assert e.token_id == prompt[t]
            assert abs(e.logprob - ref[t - 1, prompt[t]]) < 1e-4
            assert e.rank == int((ref[t - 1] > ref[t - 1, prompt[t]]).sum()) + 1
            best = np.argsort(-ref[t - 1], kind="stable")[:3]
            assert [i for i, _ in e.top] == best.tolist()
    assert outs[-1].prompt_logprobs is None
    assert outs[-1].token_ids[:2] == outs[0].token_ids  # greedy: the same continuation either way


def test_prompt_logprobs_are_not_lost_to_the_prefix_cache(bundle: Path) -> None:
    llm = LLM(bundle, enable_prefix_caching=True)
    prompt = PROMPTS[1]
    warm = llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert warm.num_cached_tokens == 0
    cached = llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert cached.num_cached_tokens > 0  # the prompt's blocks are in the cache …
    asked = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    assert asked.num_cached_tokens == 0 and len(asked.prompt_logprobs) == len(prompt)  # … and not used here
    ref = reference(bundle, prompt)
    np.testing.assert_allclose([e.logprob for e in asked.prompt_logprobs[1:]],
                               ref[np.arange(len(prompt) - 1), prompt[1:]], atol=1e-4)


def test_n_sequences_share_one_prompt_logprobs(bundle: Path) -> None:
    outs = LLM(bundle).generate([PROMPTS[0]], SamplingParams(n=3, max_tokens=3, seed=1, prompt_logprobs=0),
                                use_tqdm=False)
    assert len(outs) == 3 and all(o.prompt_logprobs == outs[0].prompt_logprobs for o in outs)
    assert len(outs[0].prompt_logprobs) == len(PROMPTS[0])


def test_each_output_carries_its_own_prompt_logprobs(bundle: Path) -> None:
    """The engine handed every output — each step's, each of the n sequences' — the request's live prompt-logprob
    list (as issue 24 defect 2 was for sampled logprobs): what changed the request's list, or one output's,
    changed them all. Each output now holds its own entries, and cannot edit them."""
    engine = LLMEngine(bundle)
    reqs = engine.add_request(PROMPTS[0], SamplingParams(n=2, max_tokens=3, seed=1, prompt_logprobs=1))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert len(outs) == 6 and all(len(o.prompt_logprobs) == len(PROMPTS[0]) for o in outs)
    want = list(outs[0].prompt_logprobs)
    reqs[0].prompt_logprobs.append(None)  # the request's list goes on (here: by hand)
    with pytest.raises(AttributeError):
        outs[0].prompt_logprobs.clear()  # type: ignore[union-attr]  # a consumer editing what it was given
    assert all(list(o.prompt_logprobs) == want for o in outs)
