"""Qwen3 dense (per-head q/k RMSNorm before rotary, no qkv bias, ``head_dim`` 32 ≠ hidden / heads = 16, tied
embeddings): a tiny random checkpoint written by transformers' ``Qwen3ForCausalLM`` against omforge's export, its
fusions, the paged step graphs (plain ops and the CPU kernel), batched engine generation, int8 KV, int8 / int4
weights, the GGUF path (llama.cpp's ``qwen3`` names) and the ascend lowering on the FAKE atc and pyACL."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch

import helpers
from helpers import (
    TINY_QWEN3_CONFIG,
    add_llama_hparams,
    assert_same_logits,
    compile_bundle,
    export_feeds,
    load_export,
    lowered,
    make_tiny_qwen3_dir,
    run_model,
    write_gguf_tensors,
    write_recipe,
)
from omforge.compile.ort import build
from omforge.export.onnx_export import cached_export, export_recipe
from omforge.recipe import load_recipe
from omforge.runtime.full_recompute import ExportedModel
from omforge.runtime.llm import LLM
from omforge.runtime.ort import kernels
from omforge.runtime.ort.ort_executor import OrtExecutor
from omforge.runtime.sampling_params import SamplingParams
from omforge.runtime.step import SeqWork, build_step

REPO = Path(__file__).resolve().parent.parent
TINY_QWEN3 = REPO / "tests" / "recipes" / "tiny-qwen3.yaml"
HF_CONFIG = {**TINY_QWEN3_CONFIG, "bos_token_id": 1, "eos_token_id": 2}
L = HF_CONFIG["num_hidden_layers"]
NEW = 16  # greedy tokens per prompt
PROMPTS = [[int(t) for t in np.random.default_rng(n).integers(3, 256, n)] for n in (5, 11, 23, 40)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
BLOCK = 4  # small KV blocks: every prompt crosses block boundaries


def write_gguf(hf_dir: Path, out: Path, quant: str = "F32") -> Path:
    """The same weights as a GGUF of llama.cpp's ``qwen3`` architecture, with its tensor names and metadata as
    convert_hf_to_gguf.py writes them (``attention.key_length`` = head_dim; q/k rows as they are, unpermuted);
    ``quant`` Q8_0 stores the layers' 2-D matrices in its blocks (norms and the embedding stay F32)."""
    import gguf
    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    w = gguf.GGUFWriter(out, "qwen3")
    add_llama_hparams(w, cfg, HF_CONFIG["rope_theta"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    bpe = json.loads((hf_dir / "tokenizer.json").read_text())["model"]  # the byte-level BPE, as llama.cpp's gpt2 kind
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(sorted(bpe["vocab"], key=bpe["vocab"].get))
    w.add_token_types([gguf.TokenType.NORMAL] * len(bpe["vocab"]))
    w.add_token_scores([0.0] * len(bpe["vocab"]))  # the tiny BPE has no merges (bytes and specials only)
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    tensors = []
    for name, tensor in sorted(load_file(hf_dir / "model.safetensors").items()):
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.weight", name)
        tensors.append((f"blk.{m[1]}.{layer[m[2]]}.weight" if m else top[name], tensor.astype(np.float32)))
    write_gguf_tensors(w, tensors, lambda name, arr: gguf.GGMLQuantizationType[quant] if quant != "F32" and
                       name.startswith("blk.") and arr.ndim == 2 else None)
    return out


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The checkpoint, its recipe, its export and transformers' greedy tokens (eager attention) for PROMPTS."""
    from transformers import Qwen3ForCausalLM

    root = tmp_path_factory.mktemp("qwen3")
    hf_dir = make_tiny_qwen3_dir(root / "hf", bos_token_id=1, eos_token_id=2)
    recipe = write_recipe(root / "qwen3.yaml", {"name": "tiny-qwen3-hf", "source": "hf", "path": str(hf_dir),
                                                "family": "qwen3"}, compile={"kv_block_size": BLOCK})
    export = cached_export(load_recipe(recipe), root / "cache" / "exports", quiet=True)  # compile_bundle reuses it
    hf = Qwen3ForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        tokens = [hf.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                              pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
    return {"root": root, "hf_dir": hf_dir, "recipe": recipe, "export": export, "hf": hf,
            "tokens": tokens, "cache": root / "cache"}


def greedy_full(model: ir.Model, prompt: list[int]) -> list[int]:
    """Greedy decoding by full recompute through a (fused) full-sequence graph."""
    ids = list(prompt)
    for _ in range(NEW):
        feeds = export_feeds(batch=1, seq=len(ids))
        feeds["input_ids"] = np.array([ids], np.int64)
        ids.append(int(run_model(model, feeds)[0][0, -1].argmax()))
    return ids[len(prompt):]


def greedy_paged(path: Path, layout, prompt: list[int]) -> list[int]:  # noqa: ANN001 - PagedLayout
    """Greedy decoding through a paged step graph: the prompt in one step, then one decode step per token."""
    return helpers.greedy_paged(path, layout, prompt, NEW, BLOCK)


def test_config_and_the_unfused_export_match_transformers(qwen3: dict) -> None:
    meta = json.loads((qwen3["export"] / "export.json").read_text())
    config = meta["config"]
    assert config["family"] == "qwen3" and config["head_dim"] == 32 and config["hidden_size"] == 64
    assert not config["qkv_bias"] and config["tie_word_embeddings"]
    exported = ExportedModel(qwen3["export"])
    feeds = export_feeds()
    with torch.no_grad():
        ref = qwen3["hf"](torch.from_numpy(feeds["input_ids"])).logits.numpy()
    drift = float(np.abs(exported.logits(feeds["input_ids"]) - ref).max())
    assert drift <= 1e-4, drift
    assert [exported.greedy(p, NEW, ignore_eos=True).token_ids for p in PROMPTS] == qwen3["tokens"]


def test_the_recipe_random_weights_are_a_qwen3(tmp_path: Path) -> None:
    """tests/recipes/tiny-qwen3.yaml's random weights, loaded into transformers' Qwen3ForCausalLM by name, give
    the logits of omforge's torch definition (the q/k norm weights included: strict loading)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from omforge.export.weights import load_checkpoint
    from omforge.models.llama import LlamaForCausalLM

    ckpt = load_checkpoint(load_recipe(TINY_QWEN3))
    cfg = ckpt.config
    assert (cfg.family, cfg.head_dim, cfg.hidden_size // cfg.num_attention_heads) == ("qwen3", 32, 16)
    state = {k: torch.from_numpy(v) for k, v in ckpt.tensors.items()}
    assert {k for k in state if "q_norm" in k or "k_norm" in k} == {
        f"model.layers.{i}.self_attn.{n}.weight" for i in range(cfg.num_hidden_layers) for n in ("q_norm", "k_norm")}
    ours = LlamaForCausalLM(cfg)
    ours.load_state_dict(state, strict=True)
    hf = Qwen3ForCausalLM(Qwen3Config(**{**HF_CONFIG, "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_norm_eps}))
    hf.load_state_dict(state, strict=False)  # transformers' tied lm_head is not in the state dict
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        drift = (ours(ids, torch.arange(ids.shape[1])[None]) - hf.eval()(ids).logits).abs().max().item()
    assert drift <= 1e-5, drift


def test_fusions_take_the_per_head_norms_and_keep_numerics(qwen3: dict) -> None:
    """The RMSNorm fusion matches each q/k norm over the last axis of [B, S, H, D] (2 per layer on top of the
    decoder's 2L + 1); rotary, attention and the QKV merge still match with the norm between them; fused greedy
    tokens are transformers'."""
    from omforge.passes.manager import run_fusions

    unfused, model = load_export(qwen3["export"]), load_export(qwen3["export"])
    counts = run_fusions(model)
    assert counts == {"rms_norm": 4 * L + 1, "add_rms_norm": 2 * L, "rotary": 2 * L, "qkv_merge": L, "moe": 0,
                      "gate_up_swiglu": L, "attention": L}
    per_head = [n for n in model.graph if n.op_type == "RMSNorm" and n.inputs[0].shape.rank() == 4]
    assert len(per_head) == 2 * L and all(n.inputs[1].const_value.shape == (32,) for n in per_head)
    assert all(n.outputs[0].uses()[0].node.op_type == "Transpose" for n in per_head)  # before the heads transpose
    assert_same_logits(unfused, model)
    fused = lowered(model)
    assert [greedy_full(fused, p) for p in PROMPTS[:2]] == qwen3["tokens"][:2]


@pytest.mark.parametrize("kernel", [False, pytest.param(True, marks=pytest.mark.skipif(
    not kernels.status().available, reason=f"kernel library: {kernels.status().reason}"))], ids=["plain", "kernel"])
def test_paged_step_graphs_generate_transformers_tokens(qwen3: dict, tmp_path: Path, kernel: bool) -> None:
    """The paged step graph, plain ops or omforge's kernel: the kernel graph keeps the q/k norms and reshapes their
    heads back to [1, T, H·D] for the kernel, which rotates them (no Transpose or RotaryEmbedding is left)."""
    path = tmp_path / "step.onnx"
    report = build(qwen3["export"], path, block_size=BLOCK, kernel=kernel)
    assert report.layout.head_dim == 32 and report.layout.kv_heads == 2
    hist = report.op_histogram
    assert hist.get("RMSNormalization") == 2 * L + 1
    if kernel:
        assert hist[f"{kernels.DOMAIN}::PagedAttention"] == L
        assert "RotaryEmbedding" not in hist, hist
        # no Transpose on the activations (the tied lm_head's transposed weight stays a constant's, on CPUs where
        # float32 weights are not packed for MatMulF32)
        moved = [n.name for n in ir.load(path).graph if n.op_type == "Transpose" and n.inputs[0].const_value is None
                 and not n.inputs[0].is_initializer()]
        assert not moved, moved
    assert [greedy_paged(path, report.layout, p) for p in PROMPTS] == qwen3["tokens"]


@pytest.mark.parametrize("kv_cache_dtype", ["float32", pytest.param("int8", marks=pytest.mark.skipif(
    not kernels.status().available, reason=f"kernel library: {kernels.status().reason}"))])
def test_bundle_batched_generation(qwen3: dict, tmp_path: Path, kv_cache_dtype: str) -> None:
    """``omforge compile`` of the HF directory and the engine on every prompt at once (chunked prefill beside
    decodes: 24 tokens a step): transformers' greedy tokens, with float32 and int8 KV pools."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(qwen3["recipe"].read_text().replace("compile:\n",
                                                          f"compile:\n  kv_cache_dtype: {kv_cache_dtype}\n"))
    bundle = compile_bundle(recipe, tmp_path / "bundle", qwen3["cache"])
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["model"]["config"]["family"] == "qwen3" and manifest["kv"]["dtype"] == kv_cache_dtype
    with LLM(bundle, max_num_batched_tokens=24) as llm:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == qwen3["tokens"]


@pytest.mark.parametrize(("weights", "bound"), [("int8", 0.02), ("int4", 0.2)])
def test_quantized_weights_stay_near_the_float_logits(qwen3: dict, tmp_path: Path, weights: str,
                                                       bound: float) -> None:
    """int8 / int4 weights (round to nearest, groups of 32) on the paged graph: the last position's logits of
    every prompt within ``bound`` of transformers' (logits std ≈ 0.5 here), the argmax kept for int8."""
    report = build(qwen3["export"], tmp_path / "q.onnx", block_size=BLOCK, weights=weights)
    assert report.weights.quantized, report.weights
    ex = OrtExecutor(tmp_path / "q.onnx", report.layout, num_blocks=64)
    tables = [list(range(16 * i, 16 * i + 16)) for i in range(len(PROMPTS))]
    logits = ex.run(build_step([SeqWork(p, 0, t) for p, t in zip(PROMPTS, tables)], BLOCK))
    with torch.no_grad():
        ref = np.stack([qwen3["hf"](torch.tensor([p])).logits[0, -1].numpy() for p in PROMPTS])
    drift = float(np.abs(logits - ref).max())
    assert 0 < drift <= bound, drift
    if weights == "int8":
        assert (logits.argmax(-1) == ref.argmax(-1)).all()


def test_gguf_of_the_same_weights_is_the_hf_model(qwen3: dict, tmp_path: Path) -> None:
    """llama.cpp's ``qwen3`` GGUF (attn_q_norm / attn_k_norm, key_length = head_dim, rows unpermuted) loads to
    the HF directory's config and tensors and generates its tokens."""
    from omforge.export.weights import load_checkpoint

    gguf_file = write_gguf(qwen3["hf_dir"], tmp_path / "tiny-qwen3.gguf")
    recipe = write_recipe(tmp_path / "g.yaml", {"name": "tiny-qwen3-gguf", "source": "gguf",
                                                "path": str(gguf_file), "family": "qwen3"})
    from_gguf, from_hf = load_checkpoint(load_recipe(recipe)), load_checkpoint(load_recipe(qwen3["recipe"]))
    assert from_gguf.config.head_dim == 32 and from_gguf.config.qk_norm
    assert from_gguf.config == from_hf.config.__class__(**{**from_hf.config.__dict__,
                                                           "rms_norm_eps": from_gguf.config.rms_norm_eps})
    assert set(from_gguf.tensors) == set(from_hf.tensors)
    assert all(np.array_equal(from_gguf.tensors[k], from_hf.tensors[k]) for k in from_hf.tensors)
    export_recipe(load_recipe(recipe), tmp_path / "export", quiet=True)
    exported = ExportedModel(tmp_path / "export")
    assert [exported.greedy(p, NEW, ignore_eos=True).token_ids for p in PROMPTS] == qwen3["tokens"]


def test_q8_0_gguf_keeps_its_blocks_unpermuted(qwen3: dict, tmp_path: Path) -> None:
    """A Q8_0 qwen3 GGUF: the projections' blocks are kept for int8 weights with their rows in HF order (qwen3 is
    not permuted), dequantized within Q8_0's rounding of the HF tensors; the q/k norms are read exactly."""
    from safetensors.numpy import load_file

    from omforge.export.weights import load_gguf

    ckpt = load_gguf(write_gguf(qwen3["hf_dir"], tmp_path / "q8.gguf", quant="Q8_0"))
    hf = load_file(qwen3["hf_dir"] / "model.safetensors")
    for name in ("self_attn.q_proj", "self_attn.k_proj", "mlp.down_proj"):
        key = f"model.layers.1.{name}.weight"
        kind, rows, k = ckpt.blocks[key]
        assert kind == "Q8_0" and rows.shape[0] == hf[key].shape[0] and k == hf[key].shape[1]
        scale = np.abs(hf[key]).reshape(hf[key].shape[0], -1, 32).max(-1, keepdims=True) / 127
        err = np.abs(ckpt.tensors[key] - hf[key]).reshape(scale.shape[0], -1, 32)
        assert (err <= scale * 0.6).all(), key  # half a step, and the float16 scale's rounding
    for key in ("model.layers.0.self_attn.q_norm.weight", "model.layers.1.self_attn.k_norm.weight"):
        assert key not in ckpt.blocks and np.array_equal(ckpt.tensors[key], hf[key])


def test_diff_per_fusion_reports_the_q_k_norms(qwen3: dict) -> None:
    """``omforge diff EXPORT --per-fusion``: the rms_norm row counts the per-head norms and its drift passes;
    provenance shows regions scoped to ``self_attn.q_norm`` / ``k_norm``."""
    r = subprocess.run([sys.executable, "-m", "omforge", "diff", str(qwen3["export"]), "--per-fusion", "--json"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads(r.stdout)
    rows = {row["fusion"]: row for row in d["per_fusion"]}
    assert rows["rms_norm"]["matches"] == 4 * L + 1 and rows["rms_norm"]["passed"]
    assert rows["rms_norm"]["max_abs"] < 1e-4 and rows["all"]["passed"]
    regions = next(f for f in d["provenance"]["fusions"] if f["name"] == "rms_norm")["regions"]
    scopes = {scope for region in regions for _, _, scope in region["replaced"]}
    assert {f"model.layers.{i}.self_attn.{n}" for i in range(L) for n in ("q_norm", "k_norm")} <= scopes


def test_ascend_lowering_conforms_and_generates_the_ort_tokens_on_the_fakes(qwen3: dict, tmp_path: Path) -> None:
    """Ascend (Atlas A2): the q/k norms become CANN RmsNorm nodes (OmRmsNorm, the model's epsilon) over
    [B, S, H, D] with gamma [head_dim]; the bundle passes every ATC rule and stays inside the CANN matrix; on the
    FAKE atc and pyACL (float32 weights) it generates transformers' tokens. On 310B (no RmsNorm kernel) plain ops."""
    import fake_atc

    from fake_acl import FakeAcl
    from omforge.compile.ascend.atc_conformance import check_bundle
    from omforge.compile.ascend.cann_matrix import bundle_rows
    from omforge.compile.ascend.stages import lower_step_graph
    from omforge.recipe import retarget

    recipe = tmp_path / "asc.yaml"
    recipe.write_text(qwen3["recipe"].read_text().replace("compile:\n", "compile:\n  weights: float32\n"))
    asc = compile_bundle(recipe, tmp_path / "asc", qwen3["cache"], target="ascend")
    assert all(r.ok for r in check_bundle(asc)["om/step"])
    rows, outside = bundle_rows(asc)
    assert outside == [] and "OmRmsNorm" in {row.op_type for row in rows}
    step = onnx.load(str(asc / "ascend" / "step.onnx"), load_external_data=False)
    assert sum(n.op_type == "OmRmsNorm" for n in step.graph.node) == 2 * L + 1
    manifest = json.loads((asc / "manifest.json").read_text())
    lower_step_graph(qwen3["export"], tmp_path, retarget(load_recipe(recipe), "ascend"),
                     manifest["kv"]["block_size"], plain=True)
    fake_atc.build_bundle(asc, tmp_path / "step.onnx")
    fake = FakeAcl()
    outs = LLM(asc, acl_module=fake).generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == qwen3["tokens"]
    assert not [c for c in fake.calls if c.startswith("FAILED")]

    recipe.write_text(recipe.read_text().replace("compile:\n", "compile:\n  soc_version: Ascend310B1\n"))
    plain = compile_bundle(recipe, tmp_path / "asc-310b", qwen3["cache"], target="ascend")
    ops = {n.op_type for n in onnx.load(str(plain / "ascend" / "step.onnx"), load_external_data=False).graph.node}
    assert "OmRmsNorm" not in ops and "ReduceMean" in ops
    assert bundle_rows(plain)[1] == []


def test_shipped_qwen3_recipes() -> None:
    """models/qwen3-0.6b-random.yaml is Qwen3-0.6B's real config (models/qwen3.yaml: test_recipe.py, which
    checks it asks for its model.path to be edited)."""
    from omforge.export.weights import _config_from_recipe, expected_names

    recipe = load_recipe(REPO / "models" / "qwen3-0.6b-random.yaml")
    cfg = _config_from_recipe(recipe)
    assert (cfg.family, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (
        "qwen3", 1024, 16, 8, 128)
    assert (cfg.num_hidden_layers, cfg.intermediate_size, cfg.vocab_size, cfg.tie_word_embeddings) == (
        28, 3072, 151936, True)
    assert cfg.qk_norm and not cfg.qkv_bias and "model.layers.27.self_attn.k_norm.weight" in expected_names(cfg)
