"""Tiny random Qwen3-MoE (no top-k renormalization) and Mixtral (renormalized) HF directories made by transformers,
generated greedily through every path omforge has for them: the unfused export, the fused full graph with the
plain-op MoE, the paged step graph with plain ops, and the compiled bundle in the LLM engine (the kernel library's
lowering: its expert kernel once the library has it, passes/lower_ort.py ``MOE_KERNEL``), batched and one prompt at a
time: transformers' tokens every time."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from moe_setup import LAYERS, moe_export

import helpers
from helpers import compile_bundle, load_export, lowered
from omforge.compile.ort import build
from omforge.contract.manifest import load_manifest
from omforge.passes import lower_ort, manager, moe_kernel
from omforge.runtime.full_recompute import ExportedModel
from omforge.runtime.llm import LLM
from omforge.runtime.sampling_params import SamplingParams

NEW = 8  # greedy tokens per prompt
PROMPTS = [[int(t) for t in np.random.default_rng(n).integers(3, 256, n)] for n in (5, 13, 22)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
BLOCK = 4  # small KV blocks: every prompt crosses block boundaries


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def moe_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The checkpoint, its recipe, its export (in the stage cache compile_bundle reuses) and transformers' greedy
    tokens (eager attention) for PROMPTS."""
    from transformers import AutoModelForCausalLM

    made = moe_export(request.param, tmp_path_factory, BLOCK)
    hf = AutoModelForCausalLM.from_pretrained(made["hf_dir"], dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        tokens = [hf.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                              pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
    assert len({t for ts in tokens for t in ts}) > NEW  # not a degenerate model repeating one token
    return {**made, "tokens": tokens}


def greedy_full(model: ir.Model, prompt: list[int]) -> list[int]:
    """Greedy decoding by full recompute through a full-sequence graph (one ORT session)."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), options, providers=["CPUExecutionProvider"])
    ids = list(prompt)
    for _ in range(NEW):
        feeds = {"input_ids": np.array([ids], np.int64), "position_ids": np.arange(len(ids), dtype=np.int64)[None]}
        ids.append(int(session.run(None, feeds)[0][0, -1].argmax()))
    return ids[len(prompt):]


def greedy_paged(path: Path, layout, prompt: list[int]) -> list[int]:  # noqa: ANN001 - PagedLayout
    """Greedy decoding through a paged step graph: the prompt in one step, then one decode step per token."""
    return helpers.greedy_paged(path, layout, prompt, NEW, BLOCK)


def test_unfused_export_and_fused_plain_graph(moe_model: dict) -> None:
    """The export as it is (the dense reference graph), then fused (one MoE per layer) and lowered to plain ops."""
    exported = ExportedModel(moe_model["export"])
    assert exported.config.family == moe_model["family"] and exported.config.is_moe
    assert [exported.greedy(p, NEW, ignore_eos=True).token_ids for p in PROMPTS] == moe_model["tokens"]
    model = load_export(moe_model["export"])
    assert manager.run_fusions(model)["moe"] == LAYERS
    plain = lowered(model)
    assert sum(n.op_type == "TopK" for n in plain.graph) == LAYERS
    assert [greedy_full(plain, p) for p in PROMPTS] == moe_model["tokens"]


def test_paged_step_graph_with_plain_ops(moe_model: dict, tmp_path: Path) -> None:
    report = build(moe_model["export"], tmp_path / "step.onnx", block_size=BLOCK, kernel=False)
    assert report.fusion_counts["moe"] == LAYERS and report.op_histogram["TopK"] == LAYERS
    assert [greedy_paged(tmp_path / "step.onnx", report.layout, p) for p in PROMPTS] == moe_model["tokens"]


def test_engine_batched_equals_solo_and_transformers(moe_model: dict, tmp_path: Path) -> None:
    """``omforge compile`` of the HF directory and the LLM engine: every prompt at once (chunked prefill beside decodes:
    12 tokens a step), then each alone."""
    bundle = compile_bundle(moe_model["recipe"], tmp_path / "bundle", moe_model["cache"])
    manifest = load_manifest(bundle)
    assert manifest.model.config.family == moe_model["family"] and manifest.passes.fusion_counts["moe"] == LAYERS
    hist = manifest.passes.op_histogram
    kernel_moe = sum(n for op, n in hist.items() if op.startswith("omforge.kernels::MoE"))
    if lower_ort.MOE_KERNEL and "omforge.kernels::PagedAttention" in hist:  # the expert kernel, where it runs
        assert kernel_moe + hist.get("TopK", 0) == LAYERS, hist
    else:
        assert hist.get("TopK") == LAYERS and not kernel_moe, hist
    with LLM(bundle, max_num_batched_tokens=12) as llm:
        batched = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        solo = [llm.generate([p], GREEDY, use_tqdm=False)[0].token_ids for p in PROMPTS]
    assert batched == solo == moe_model["tokens"]


# --- the runtime around a MoE bundle (issue 62 item 4): prefix caching, speculation, LoRA, pooling -----------------

def test_prefix_cache_and_speculation_change_no_token(moe_model: dict, tmp_path: Path) -> None:
    """A prompt served again hits the prefix cache; n-gram speculation (drafts verified by the MoE step graph, several
    tokens a step) gives the plain engine's greedy tokens, and drafts were accepted."""
    bundle = compile_bundle(moe_model["recipe"], tmp_path / "bundle", moe_model["cache"])
    prompts = [p * 2 for p in PROMPTS[:2]]  # repeats: the n-gram drafter finds matches
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    with LLM(bundle) as plain:
        want = [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
        again = plain.generate(prompts[:1], params, use_tqdm=False)[0]
    assert again.token_ids == want[0] and again.num_cached_tokens > 0
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
            "min_acceptance": 0.0}
    with LLM(bundle, speculative_config=spec) as llm:
        got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.engine.stats
    assert got == want
    assert stats.spec_draft_tokens > 0 and stats.spec_accepted_tokens > 0


def test_lora_on_the_attention_projections_is_peft(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """``compile.lora`` on a MoE model targets the attention projections by default (the experts take no LoRA term):
    a PEFT adapter of q/k/v/o gives PEFT's greedy tokens through the engine, the base model's without it."""
    from lora_setup import make_peft_adapter
    from peft import PeftModel

    from omforge.contract.lora import ATTENTION_MODULES

    made = moe_export("qwen3_moe", tmp_path_factory, BLOCK)
    adapter = make_peft_adapter(made["hf_dir"], tmp_path / "adapter", seed=1, targets=ATTENTION_MODULES)
    recipe = helpers.write_recipe(tmp_path / "lora.yaml", {"name": "tiny-qwen3_moe", "source": "hf",
                                                           "path": str(made["hf_dir"]), "family": "qwen3_moe"},
                                  compile={"kv_block_size": BLOCK, "max_seq_len": 64,
                                           "lora": {"max_loras": 1, "max_rank": 8}})
    bundle = compile_bundle(recipe, tmp_path / "bundle", made["cache"])
    assert tuple(load_manifest(bundle).lora.target_modules) == ATTENTION_MODULES
    peft = PeftModel.from_pretrained(helpers.hf_reference(made["hf_dir"]), adapter).eval()
    with torch.no_grad():
        want = [peft.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                              pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
    with LLM(bundle, lora_modules={"a": str(adapter)}, max_loras=1) as llm:
        got = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora="a")]
        base = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert got == want and base != got


def test_lora_on_the_experts_is_one_line(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    from omforge.errors import OmforgeError

    made = moe_export("qwen3_moe", tmp_path_factory, BLOCK)
    recipe = helpers.write_recipe(tmp_path / "lora.yaml", {"name": "tiny-qwen3_moe", "source": "hf",
                                                           "path": str(made["hf_dir"]), "family": "qwen3_moe"},
                                  compile={"kv_block_size": BLOCK, "max_seq_len": 64,
                                           "lora": {"max_loras": 1, "max_rank": 8,
                                                    "target_modules": ["q_proj", "gate_proj", "down_proj"]}})
    with pytest.raises(OmforgeError, match="compile.lora.target_modules: gate_proj, down_proj: a mixture of "
                                           "experts' MLP is its experts, which take no LoRA term") as error:
        compile_bundle(recipe, tmp_path / "bundle", made["cache"])
    assert "\n" not in str(error.value)


def test_an_embed_bundle_is_transformers_last_token_pooling(tmp_path: Path,
                                                            tmp_path_factory: pytest.TempPathFactory) -> None:
    """``task: embed`` of a MoE model: the experts through the kernel library's op in the pooling step graph too,
    and the vectors are transformers' (Qwen3MoeModel) last hidden state, normalized."""
    from transformers import AutoModel

    made = moe_export("qwen3_moe", tmp_path_factory, BLOCK)
    recipe = helpers.write_recipe(tmp_path / "embed.yaml", {"name": "tiny-qwen3_moe", "source": "hf",
                                                            "path": str(made["hf_dir"]), "family": "qwen3_moe"},
                                  compile={"max_seq_len": 64}, task="embed")
    bundle = compile_bundle(recipe, tmp_path / "bundle", made["cache"])
    hist = load_manifest(bundle).passes.op_histogram
    if moe_kernel.kernel_runs("float32") is None:  # the library runs the expert op here
        assert hist.get("omforge.kernels::MoEF32") == LAYERS and "TopK" not in hist, hist
    model = AutoModel.from_pretrained(made["hf_dir"], dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        want = np.stack([torch.nn.functional.normalize(model(torch.tensor([p])).last_hidden_state[0, -1], dim=-1)
                         .numpy() for p in PROMPTS])
    with LLM(bundle) as llm:
        got = np.stack(llm.embed(PROMPTS))
    assert np.abs(got - want).max() < 1e-4
