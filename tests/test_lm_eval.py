"""A third-party evaluation harness against `omforge serve`: lm-evaluation-harness's ``local-completions`` model
runs a loglikelihood (multiple choice) task and a generation task on small JSONL files shipped in tests/data
(no hub download), and its per-request results equal what the engine computes offline — the loglikelihoods
from its own prompt logprobs, the generations from its own greedy decoding."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from server_process import ServerProcess

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval[api] is in the test extra")

DATA = Path(__file__).parent / "data" / "lm_eval"
TASKS = {
    "omforge_capitals": f"""task: omforge_capitals
dataset_path: json
dataset_kwargs: {{data_files: {{test: "{DATA / 'capitals.jsonl'}"}}}}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{gold}}}}"
target_delimiter: ""
metric_list: [{{metric: acc, aggregation: mean, higher_is_better: true}}]
""",
    "omforge_short_answers": f"""task: omforge_short_answers
dataset_path: json
dataset_kwargs: {{data_files: {{test: "{DATA / 'arithmetic.jsonl'}"}}}}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
generation_kwargs: {{until: ["\\n"], max_gen_toks: 12, do_sample: false, temperature: 0.0}}
metric_list: [{{metric: exact_match, aggregation: mean, higher_is_better: true}}]
""",
}


@pytest.fixture(scope="module")
def harness_run(smollm2_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("lm-eval")
    for name, text in TASKS.items():
        (root / f"{name}.yaml").write_text(text)
    tokenizer_dir = root / "tokenizer"
    tokenizer_dir.mkdir()
    shutil.copy(smollm2_bundle / "tokenizer.json", tokenizer_dir / "tokenizer.json")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    srv = ServerProcess(smollm2_bundle, "--num-kv-blocks", "64")
    try:
        results = simple_evaluate(
            model="local-completions",
            model_args=f"model=smollm2-135m,base_url={srv.base_url}/completions,tokenizer={tokenizer_dir},"
                       "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1,tokenized_requests=True",
            tasks=list(TASKS), task_manager=TaskManager(include_path=str(root)), log_samples=True,
            random_seed=0, numpy_random_seed=0, torch_random_seed=0)
    finally:
        assert srv.stop() == 0, srv.log()
    return results


def test_loglikelihoods_equal_the_engines_prompt_logprobs(harness_run: dict, smollm2_bundle: Path) -> None:
    from omforge import LLM, SamplingParams

    llm = LLM(smollm2_bundle, num_kv_blocks=64)
    tok = llm.tokenizer
    samples = harness_run["samples"]["omforge_capitals"]
    assert len(samples) == 8
    correct = []
    for s in samples:
        doc, got = s["doc"], [r[0][0] for r in s["resps"]]  # one (loglikelihood, is_greedy) per choice
        ctx = tok.encode(doc["question"], add_special_tokens=False)
        want = []
        for choice in doc["choices"]:
            cont = tok.encode(choice, add_special_tokens=False)
            out = llm.generate([ctx + cont], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
            want.append(sum(e.logprob for e in out.prompt_logprobs[len(ctx):]))
        np.testing.assert_allclose(got, want, atol=1e-4)
        correct.append(int(np.argmax(want)) == doc["gold"])
    assert harness_run["results"]["omforge_capitals"]["acc,none"] == pytest.approx(np.mean(correct))


def test_generations_equal_the_engines_greedy_text(harness_run: dict, smollm2_bundle: Path) -> None:
    from omforge import LLM, SamplingParams

    llm = LLM(smollm2_bundle, num_kv_blocks=64)
    samples = harness_run["samples"]["omforge_short_answers"]
    assert len(samples) == 4
    matches = []
    for s in samples:
        doc = s["doc"]
        want = llm.generate([doc["question"]], SamplingParams(max_tokens=12, temperature=0.0, stop=["\n"]),
                            use_tqdm=False)[0].text
        assert s["resps"][0][0] == want
        matches.append(want.strip() == doc["answer"].strip())
    assert harness_run["results"]["omforge_short_answers"]["exact_match,none"] == pytest.approx(np.mean(matches))
