"""The engine: continuous batching equals running alone, prefix caching, preemption (swap and recompute),
admission errors, and a fuzz of arrivals, cancellations and preemptions with the invariants checked every step."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from helpers import TINY_RECIPE, compile_bundle, make_tiny_hf_dir, write_recipe
from omforge.runtime.engine import LLMEngine, RequestRejected
from omforge.runtime.llm import LLM
from omforge.runtime.sampling_params import SamplingParams
from omforge.runtime.structured import StructuredOutput

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tiny-engine")
    recipe = root / "tiny.yaml"  # small blocks so short prompts cross many block boundaries
    recipe.write_text(TINY_RECIPE.read_text().replace("compile:\n", "compile:\n  kv_block_size: 4\n"))
    return compile_bundle(recipe, root / "bundle", root / "cache")


@pytest.fixture(scope="module")
def text_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random llama with a real BPE tokenizer: text, stop strings and grammars."""
    root = tmp_path_factory.mktemp("tiny-text")
    make_tiny_hf_dir(root / "hf", "llama")
    recipe = write_recipe(root / "recipe.yaml", {"name": "tiny-text", "source": "hf", "path": "hf"},
                          compile={"max_seq_len": 256})
    return compile_bundle(recipe, root / "bundle", root / "cache")


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 40) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def alone(bundle: Path, prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
    return LLM(bundle, num_kv_blocks=64).generate([prompt], params, use_tqdm=False)[0].token_ids


def test_batched_equals_alone_tiny(tiny_bundle: Path) -> None:
    ps = prompts(12)
    llm = LLM(tiny_bundle, num_kv_blocks=256, max_num_batched_tokens=32)  # small budget: chunked prefills
    together = llm.generate(ps, GREEDY, use_tqdm=False)
    for p, out in zip(ps, together):
        assert out.token_ids == alone(tiny_bundle, p) and out.finish_reason == "length"
    assert llm.engine.kv.stats().num_used == 0
    llm.engine.kv.check_invariants()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_outputs(tiny_bundle: Path, mode: str) -> None:
    ps = prompts(8, seed=1, lo=10, hi=30)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    # 16 blocks of 4 tokens: far too few for 8 sequences of up to 50 tokens at once
    llm = LLM(tiny_bundle, num_kv_blocks=16, preemption_mode=mode, swap_space_gb=0.01)
    outs = llm.generate(ps, params, use_tqdm=False)
    assert llm.engine.stats.preemptions > 0
    for p, out in zip(ps, outs):
        assert out.token_ids == alone(tiny_bundle, p, params)
    assert llm.engine.kv.stats().num_used == 0
    llm.engine.kv.check_invariants()


def test_admission_rejects_what_can_never_run(tiny_bundle: Path) -> None:
    engine = LLMEngine(tiny_bundle, num_kv_blocks=8)
    with pytest.raises(RequestRejected, match="exceeds the model's context of 256 tokens"):
        engine.add_request([5] * 250, SamplingParams(max_tokens=10))
    with pytest.raises(RequestRejected, match="needs 10 KV blocks but the pool has 8"):
        engine.add_request([5] * 30, SamplingParams(max_tokens=10))
    with pytest.raises(RequestRejected, match="empty"):
        engine.add_request([], SamplingParams())
    assert not engine.has_unfinished()


def test_abort_frees_blocks_at_once(tiny_bundle: Path) -> None:
    engine = LLMEngine(tiny_bundle, num_kv_blocks=64)
    (req,) = engine.add_request(prompts(1)[0], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.kv.stats().num_used > 0
    engine.abort(req.request_id)
    assert engine.kv.stats().num_used == 0 and not engine.has_unfinished()
    engine.kv.check_invariants()


def test_fuzz_arrivals_cancellations_preemptions(tiny_bundle: Path) -> None:
    rnd = random.Random(7)
    for mode in ("recompute", "swap"):
        engine = LLMEngine(tiny_bundle, num_kv_blocks=24, max_num_seqs=6, max_num_batched_tokens=24,
                           preemption_mode=mode, swap_space_gb=0.005)
        live: list[str] = []
        for _ in range(150):
            if rnd.random() < 0.3:
                p = prompts(1, seed=rnd.randrange(10**6), lo=2, hi=30)[0]
                params = SamplingParams(temperature=rnd.choice([0.0, 0.8]), seed=rnd.randrange(100),
                                        max_tokens=rnd.randrange(1, 25), ignore_eos=True)
                live += [r.request_id for r in engine.add_request(p, params)]
            if live and rnd.random() < 0.08:
                engine.abort(live.pop(rnd.randrange(len(live))))
            for out in engine.step():
                if out.finished and out.request_id in live:
                    live.remove(out.request_id)
            engine.kv.check_invariants()
        while engine.has_unfinished():
            engine.step()
            engine.kv.check_invariants()
        assert engine.kv.stats().num_used == 0
        assert engine.stats.preemptions > 0, mode


def test_seeded_sampling_is_reproducible_in_any_batch(tiny_bundle: Path) -> None:
    ps = prompts(6, seed=3)
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=42, max_tokens=10, ignore_eos=True)
    batch = LLM(tiny_bundle, num_kv_blocks=128).generate(ps, params, use_tqdm=False)
    for p, out in zip(ps, batch):
        assert out.token_ids == alone(tiny_bundle, p, params)


# --- SmolLM2 acceptance -------------------------------------------------------------------------------------

LONG_TOPIC = ("The history of computing spans abacuses, mechanical calculators, the analytical engine, "
              "vacuum tubes, transistors, integrated circuits and the microprocessor. ")


def smol_prompts(llm: LLM) -> list[list[int]]:
    rng = random.Random(0)
    words = "red green blue ocean river mountain compiler kernel tensor model token cache block".split()
    texts = [" ".join(rng.choice(words) for _ in range(rng.randrange(3, 120))) for _ in range(31)]
    texts.append(LONG_TOPIC * 60)  # > 1,500 tokens: prefilled in chunks
    ids = [llm.tokenizer.encode(t) for t in texts]
    assert max(len(i) for i in ids) > 1500
    return ids


def test_smollm2_32_mixed_prompts_together_equal_alone(smollm2_bundle: Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm = LLM(smollm2_bundle)
    ps = smol_prompts(llm)
    together = llm.generate(ps, params, use_tqdm=False)
    assert llm.engine.stats.prefill_tokens >= sum(len(p) for p in ps)
    single = LLM(smollm2_bundle, max_num_seqs=1)
    for p, out in zip(ps, together):
        assert out.token_ids == single.generate([p], params, use_tqdm=False)[0].token_ids
    assert llm.engine.kv.stats().num_used == 0


def test_smollm2_prefix_caching(smollm2_bundle: Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    on = LLM(smollm2_bundle, enable_prefix_caching=True)
    prefix = on.tokenizer.encode(LONG_TOPIC * 40)[:512]
    ps = [prefix + on.tokenizer.encode(f" Question {i}: what came after the transistor?") for i in range(16)]
    outs_on = on.generate(ps, params, use_tqdm=False)
    st = on.engine.kv.stats()
    shared_blocks = 512 // on.engine.block_size
    assert sum(o.num_cached_tokens for o in outs_on) >= 0.9 * 15 * shared_blocks * on.engine.block_size
    assert st.hit_rate >= 0.9 * 15 / 16 * shared_blocks / (shared_blocks + 1)
    off = LLM(smollm2_bundle, enable_prefix_caching=False)
    outs_off = off.generate(ps, params, use_tqdm=False)
    assert [o.token_ids for o in outs_on] == [o.token_ids for o in outs_off]
    assert on.engine.stats.prefill_tokens < off.engine.stats.prefill_tokens - 14 * 512 * 0.9


def test_smollm2_text_stops_and_offline_api(smollm2_bundle: Path) -> None:
    from omforge import LLM as PublicLLM
    from omforge import SamplingParams as PublicParams

    llm = PublicLLM(smollm2_bundle)
    chat = llm.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    ids = llm.tokenizer.encode(chat, add_special_tokens=False)
    eos, stop, sampled = llm.generate([ids, ids, ids], [
        PublicParams(temperature=0.0, max_tokens=32),
        PublicParams(temperature=0.0, max_tokens=32, stop=["Paris"]),
        PublicParams(temperature=0.7, top_p=0.9, seed=1, max_tokens=16, logprobs=2)], use_tqdm=False)
    assert eos.finish_reason == "stop" and eos.stop_reason is None and "Paris" in eos.text
    assert "<|im_end|>" not in eos.text and eos.token_ids[-1] == 2
    assert stop.finish_reason == "stop" and stop.stop_reason == "Paris" and "Paris" not in stop.text
    assert stop.text == eos.text[:eos.text.index("Paris")]
    assert len(sampled.logprobs) == len(sampled.token_ids) and len(sampled.logprobs[0].top) == 2
    assert eos.ttft is not None and eos.ttft > 0 and len(eos.inter_token_latencies) == len(eos.token_ids) - 1


def test_swaps_of_a_step_that_schedules_nothing_are_performed(tiny_bundle: Path) -> None:
    """Issue 12 defect 1: without mixed steps, a step can preempt by swap and then schedule nothing; its swap-outs
    must still be copied to the host tier (they were dropped with the step, leaving the host blocks unwritten)."""
    import random

    rng = random.Random(296)  # a case the scheduler fuzz found: a swap-out in a step with nothing scheduled
    shapes = [(3, 2), (12, 7), (4, 4), (5, 10), (5, 11), (9, 10)]
    ps = [[rng.randrange(3, 250) for _ in range(n)] for n, _ in shapes]
    llm = LLM(tiny_bundle, num_kv_blocks=12, max_num_batched_tokens=16, preemption_mode="swap", swap_space_gb=0.01)
    engine, ex = llm.engine, llm.engine.executor
    # decodes and prefill chunks alternate, as on executors without mixed batches
    engine.scheduler.config = replace(engine.scheduler.config, mixed_batches=False)
    plans = []
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: plans.append(schedule()) or plans[-1]  # records the plans, changes nothing
    for i, (p, (_, m)) in enumerate(zip(ps, shapes)):
        engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True), request_id=str(i))
    checked = 0
    for _ in range(500):
        if not engine.has_unfinished():
            break
        engine.step()
        plan = plans[-1]
        if not plan.scheduled and plan.swap_out:
            for dev, host in plan.swap_out:
                assert ex.key_pools[0][dev].any() and np.array_equal(ex.host_keys[0][host], ex.key_pools[0][dev])
            checked += 1
    assert checked > 0


def test_n_sequences_share_one_prefill(tiny_bundle: Path) -> None:
    """Issue 12 defect 3: n = 4 sequences of a 40-token prompt compute the prompt once; the others fork its 10
    blocks (copy-on-write) and sample their first tokens from the same logits. Seeded sampling keeps each
    sequence's tokens what it was when they ran alone (sequence i draws from seed + i)."""
    prompt = prompts(1, seed=9, lo=40, hi=41)[0]
    params = SamplingParams(temperature=1.0, seed=11, n=4, max_tokens=6, ignore_eos=True)
    llm = LLM(tiny_bundle, num_kv_blocks=64)
    engine = llm.engine
    reqs = engine.add_request(prompt, params, request_id="r")
    first = engine.step()  # the leader's prefill: the 3 others join and sample in the same step
    assert engine.stats.prefill_tokens == 40 and len(first) == 4
    assert engine.kv.stats().num_used == 10 and len(engine.scheduler.running) == 4  # 10 blocks, shared 4 ways
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.token_ids
    assert engine.stats.prefill_tokens == 40 and engine.stats.prompt_tokens == 40
    for i, req in enumerate(reqs):  # each as if run alone with its own seed
        alone_params = SamplingParams(temperature=1.0, seed=11 + i, max_tokens=6, ignore_eos=True)
        assert outs[req.request_id] == alone(tiny_bundle, prompt, alone_params)
    assert engine.kv.stats().num_used == 0
    engine.kv.check_invariants()


def test_abort_of_a_leader_takes_every_follower(tiny_bundle: Path) -> None:
    """Issue 24 defect 4: aborting an n = 3 leader before its prefill aborts both followers (iterating the list
    each abort shrinks skipped ``r-2``, left WAITING in no queue and held by the engine forever)."""
    engine = LLMEngine(tiny_bundle, num_kv_blocks=64)
    reqs = engine.add_request(prompts(1)[0], SamplingParams(n=3, max_tokens=5, ignore_eos=True), request_id="r")
    assert engine.abort("r-0")
    assert [(r.request_id, r.finish_reason) for r in reqs] == [("r-0", "abort"), ("r-1", "abort"), ("r-2", "abort")]
    assert not engine.requests and not engine.has_unfinished() and not engine.step()
    engine.kv.check_invariants()


def test_each_output_keeps_its_own_logprobs(tiny_bundle: Path) -> None:
    """Issue 24 defect 2: an output carries the logprob entries of its tokens so far, not the request's live list
    (a server consumer a step behind sliced another token's entries)."""
    engine = LLMEngine(tiny_bundle, num_kv_blocks=64)
    engine.add_request(prompts(1)[0], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=1))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [len(o.logprobs) for o in outs] == [1, 2, 3, 4, 5]
    assert all([e.token_id for e in o.logprobs] == o.token_ids for o in outs)


def test_min_tokens_yields_to_a_complete_grammar(text_bundle: Path) -> None:
    """Issue 24 defect 5: once its grammar is complete a request ends with EOS even before min_tokens (with EOS
    masked, greedy took a token the grammar forbids and the request ended in a "grammar error")."""
    llm = LLM(text_bundle, num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=10,
                            structured=StructuredOutput("choice", ["yes", "no"]))
    (out,) = llm.generate(["hello world"], params, use_tqdm=False)
    assert (out.text, out.finish_reason, out.stop_reason) in (("yes", "stop", None), ("no", "stop", None))
    assert out.token_ids[-1] in llm.engine.config.eos_token_ids


def test_a_stop_string_on_the_last_allowed_token_is_a_stop(text_bundle: Path) -> None:
    """Issue 24 defect 6: a stop string completed by the token that reaches max_tokens ends the request with
    "stop" and the string (OpenAI, vLLM), not "length"."""
    llm = LLM(text_bundle, num_kv_blocks=64)
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine = llm.engine
    engine.add_request("hello world", free, request_id="free")
    texts = []  # the text after each token
    while engine.has_unfinished():
        texts += [o.text for o in engine.step()]
    k = next(k for k in range(len(texts) - 1, 0, -1) if len(texts[k]) > len(texts[k - 1])) + 1  # adds text
    whole, before = texts[k - 1], texts[k - 2]
    at = len(before) - 1 if before else 0
    while whole.find(whole[at:]) != at:  # the stop string first occurs at ``at``: the k-th token completes it
        at -= 1
    stop = whole[at:]
    (out,) = llm.generate(["hello world"], replace(free, max_tokens=k, stop=[stop]), use_tqdm=False)
    assert (out.finish_reason, out.stop_reason, out.text) == ("stop", stop, whole[:at])
    assert len(out.token_ids) == k


def test_drafts_are_not_counted_as_prefill(tiny_bundle: Path) -> None:
    """Issue 24 defect 6: speculative drafts are decode work; the prefill count is the prompt's tokens alone."""
    prompt = [5, 6, 7, 8, 9] * 6  # repeats: the n-gram drafter finds matches
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
            "min_acceptance": 0.0}
    llm = LLM(tiny_bundle, num_kv_blocks=64, speculative_config=spec)
    (out,) = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    st = llm.engine.stats
    assert st.spec_draft_tokens > 0 and len(out.token_ids) == 30
    assert st.prefill_tokens == len(prompt)
    # each decode step computes its last token and its drafts; the accepted drafts needed no step of their own
    assert st.decode_tokens == 29 - st.spec_accepted_tokens + st.spec_draft_tokens


def test_a_request_is_checked_once(tiny_bundle: Path) -> None:
    """issue 61: the intake checks a request once — offline (``add_request``: check, then add) and served (a
    worker thread checks, the engine thread adds the ``CheckedRequest`` without checking it again)."""
    import asyncio

    from omforge.serve.async_engine import AsyncEngine

    engine = LLMEngine(tiny_bundle, num_kv_blocks=64)
    engine.add_request(prompts(1)[0], replace(GREEDY, n=2))
    assert engine.intake.num_checks == 1
    while engine.has_unfinished():
        engine.step()

    async def serve() -> list[int]:
        served = AsyncEngine(engine, max_waiting_requests=4, max_queue_delay_s=0)
        served.start()
        try:
            checked = await asyncio.to_thread(served.check, prompts(1, seed=1)[0], GREEDY)
            group = served.submit([checked], "r")
            return [t for outs in [o async for o in served.outputs(group)] for out in outs for t in out.new_token_ids]
        finally:
            served.stop()

    tokens = asyncio.run(serve())
    assert engine.intake.num_checks == 2 and tokens == alone(tiny_bundle, prompts(1, seed=1)[0])
