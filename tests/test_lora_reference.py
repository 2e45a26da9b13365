"""Multi-LoRA against the reference: SmolLM2-135M with three random PEFT adapters of real ranks (issue 49 item 4).

Greedy tokens of a request with adapter X equal transformers + PEFT with X merged (``merge_and_unload``), alone and
in a batch that mixes the base model and all three adapters over a bundle with two adapter slots (so one adapter
waits for a slot and is swapped in); the prefix cache is on, and the base model answers the same prompts first
(two adapters never share KV, nor an adapter and the base). An int4 bundle (the GGUF's own Q4 blocks, float32
activations: the reference's weights exactly) gives the reference's tokens too.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from helpers import SMOLLM2_RECIPE, compile_bundle
from omforge.runtime.llm import LLM
from omforge.runtime.sampling_params import SamplingParams

ADAPTERS = {  # name → PEFT LoraConfig arguments
    "alpha": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                           "up_proj", "down_proj"]},
    "beta": {"r": 16, "lora_alpha": 8, "use_rslora": True, "target_modules": ["q_proj", "v_proj"]},
    "gamma": {"r": 4, "lora_alpha": 4, "target_modules": ["o_proj", "gate_proj", "up_proj", "down_proj"]},
}
B_SCALE = {"alpha": 0.05, "beta": 0.3, "gamma": 0.1}  # random B, shrunk: the adapted model still writes text
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea."]
NEW_TOKENS = 20


def _lora_recipe(tmp: Path, weights: str = "float32") -> Path:
    quant = "  quantization:\n    activations: float32\n" if weights == "int4" else ""
    text = SMOLLM2_RECIPE.read_text().replace(
        "compile:\n", f"compile:\n  weights: {weights}\n{quant}  lora:\n    max_loras: 2\n    max_rank: 16\n", 1)
    path = tmp / f"smollm2-lora-{weights}.yaml"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def adapters(smollm2_hf, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:  # noqa: ANN001
    """Each adapter saved as a PEFT directory, with the reference's greedy tokens of every prompt (merged)."""
    from peft import LoraConfig, get_peft_model

    hf, tok = smollm2_hf
    root = tmp_path_factory.mktemp("lora-adapters")
    out = {}
    for seed, (name, args) in enumerate(ADAPTERS.items()):
        torch.manual_seed(100 + seed)
        model = get_peft_model(copy.deepcopy(hf), LoraConfig(init_lora_weights=False, **args))
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "lora_B" in pname:
                    p.mul_(B_SCALE[name])
        model.save_pretrained(root / name)
        merged = model.merge_and_unload().eval()
        out[name] = {"path": root / name, "tokens": [_greedy(merged, tok, p) for p in PROMPTS]}
        del merged, model
    out[None] = {"path": None, "tokens": [_greedy(hf, tok, p) for p in PROMPTS]}
    return out


def _prompt_ids(tok, prompt: str) -> list[int]:  # noqa: ANN001
    return list(tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=True,
                                        add_generation_prompt=True, return_dict=True)["input_ids"])


def _greedy(model, tok, prompt: str) -> list[int]:  # noqa: ANN001
    ids = _prompt_ids(tok, prompt)
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=2,
                             pad_token_id=2)
    return ref[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def lora_bundle(smollm2_cache: Path, smollm2_export: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("smollm2-lora")
    return compile_bundle(_lora_recipe(tmp), tmp / "bundle", smollm2_cache)


def _run(llm: LLM, tok, jobs: list[tuple[str | None, str]]) -> list[list[int]]:  # noqa: ANN001
    """Greedy tokens of every (adapter, prompt) job, all added before the first step (one mixed batch)."""
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    ids = [llm.engine.add_request(_prompt_ids(tok, p), params, lora=name)[0].request_id for name, p in jobs]
    done = {}
    for _ in range(10_000):
        if not llm.engine.has_unfinished():
            break
        for out in llm.engine.step():
            if out.finished:
                done[out.request_id] = out
    return [list(done[i].token_ids) for i in ids]


def test_each_adapter_alone_and_mixed_matches_peft(lora_bundle: Path, adapters: dict, smollm2_hf) -> None:  # noqa: ANN001
    _, tok = smollm2_hf
    modules = {name: str(a["path"]) for name, a in adapters.items() if name is not None}
    with LLM(lora_bundle, lora_modules=modules) as llm:
        assert llm.engine.lora is not None and llm.engine.lora.names() == tuple(modules)
        for name in [None, *modules]:  # one at a time: the base first, so its prompt blocks are cached
            for prompt, want in zip(PROMPTS, adapters[name]["tokens"]):
                got = _run(llm, tok, [(name, prompt)])[0]
                assert got == want, f"adapter {name}, {prompt!r}: {tok.decode(got)!r} vs {tok.decode(want)!r}"
        for name in modules:  # the adapters change the answers: the check above is not the base's
            assert adapters[name]["tokens"] != adapters[None]["tokens"], name
        loads = llm.engine.lora.loads
        jobs = [(name, p) for p in PROMPTS for name in [None, *modules]]
        got = _run(llm, tok, jobs)  # base + three adapters at once over two slots
        for (name, prompt), tokens in zip(jobs, got):
            assert tokens == adapters[name]["tokens"][PROMPTS.index(prompt)], f"mixed batch: {name}, {prompt!r}"
        assert llm.engine.lora.loads > loads  # three adapters over two slots: one was swapped in again


def test_int4_bundle_matches_peft(smollm2_cache: Path, smollm2_export: Path, adapters: dict,
                                  smollm2_hf, tmp_path: Path) -> None:  # noqa: ANN001
    """int4 weights taken from the GGUF's own Q4 blocks (the reference's weights, unchanged) with float32
    activations: the adapters' greedy tokens are PEFT's too, the LoRA term added to MatMulQ's output."""
    _, tok = smollm2_hf
    bundle = compile_bundle(_lora_recipe(tmp_path, "int4"), tmp_path / "bundle", smollm2_cache)
    modules = {name: str(adapters[name]["path"]) for name in ("alpha", "gamma")}
    with LLM(bundle, lora_modules=modules) as llm:
        assert llm.engine.manifest.weights.precision == "int4"
        jobs = [(name, p) for p in PROMPTS for name in (None, *modules)]
        for (name, prompt), tokens in zip(jobs, _run(llm, tok, jobs)):
            assert tokens == adapters[name]["tokens"][PROMPTS.index(prompt)], f"int4: {name}, {prompt!r}"


def test_served_with_three_adapters_answers_the_openai_client(lora_bundle: Path, adapters: dict,
                                                              smollm2_hf) -> None:  # noqa: ANN001
    """The acceptance of issue 49: ``omforge serve`` with the three PEFT adapters on the SmolLM2 bundle answers the
    official ``openai`` client for each adapter and the base model, all four at once, with the reference's text."""
    from concurrent.futures import ThreadPoolExecutor

    from server_process import ServerProcess

    _, tok = smollm2_hf
    names = [n for n in adapters if n is not None]
    server = ServerProcess(lora_bundle, "--lora-modules", *(f"{n}={adapters[n]['path']}" for n in names))
    try:
        client = server.client()
        base = client.models.list().data[0].id
        assert [m.id for m in client.models.list().data] == [base, *names]
        ids = _prompt_ids(tok, PROMPTS[1])

        def ask(model: str) -> str:
            out = client.completions.create(model=model, prompt=ids, max_tokens=NEW_TOKENS, temperature=0.0)
            assert out.model == model
            return out.choices[0].text

        with ThreadPoolExecutor(4) as pool:
            texts = dict(zip([base, *names], pool.map(ask, [base, *names])))
        for name in [None, *names]:
            want = [t for t in adapters[name]["tokens"][1] if t != 2]  # the server stops at EOS, the text without it
            assert texts[name or base] == tok.decode(want), name
    finally:
        server.stop()
