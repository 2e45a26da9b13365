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
from omforge.passes import lower_ort, manager
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
