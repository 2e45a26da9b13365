"""Test helpers: tiny Hugging Face checkpoints made with transformers, a small real BPE tokenizer, recipes."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
import onnxruntime as ort
import yaml

if TYPE_CHECKING:
    import onnx_ir as ir

REPO = Path(__file__).resolve().parent.parent
SMOLLM2_RECIPE = REPO / "models" / "smollm2-135m.yaml"
TINY_RECIPE = REPO / "tests" / "recipes" / "tiny-llama.yaml"

# Tiny configs, one per family variant the acceptance names. Values keep every code path live:
# GQA (4 heads / 2 KV heads), untied and tied embeddings, q/k/v bias, llama3 rope scaling whose
# bands fall inside the tested positions, a sliding window (Mistral) shorter than the tested sequences.
TINY_HF_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(model_type="llama", tie_word_embeddings=False, rope_theta=10000.0),
    "llama3": dict(model_type="llama", tie_word_embeddings=True, rope_theta=500000.0,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=True, rope_theta=1000000.0),
    "mistral": dict(model_type="mistral", tie_word_embeddings=False, rope_theta=10000.0, sliding_window=24),
}


def make_tiny_tokenizer(path: Path) -> Path:
    """Train a real byte-level BPE tokenizer (vocab 256) on a few sentences and save tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=256, special_tokens=["<|endoftext|>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["the quick brown fox jumps over the lazy dog", "hello world, this is omforge",
              "a compiler and server for large language models"] * 20
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(path))
    return path


def make_tiny_hf_dir(path: Path, variant: str, seed: int = 0, shard: bool = False) -> Path:
    """A Hugging Face directory (config.json + safetensors + tokenizer.json) for a tiny random model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(TINY_HF_CONFIGS[variant])
    model_type = spec.pop("model_type")
    cfg = AutoConfig.for_model(model_type, vocab_size=256, hidden_size=64, intermediate_size=128,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
                               **spec)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # norms start at 1.0; perturb them so a dropped norm weight shows in the logits
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True, max_shard_size="100KB" if shard else "5GB")
    make_tiny_tokenizer(path / "tokenizer.json")
    return path


TINY_QWEN3_CONFIG = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                         rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=True)
"""A tiny Qwen3: GQA 4/2 heads, head_dim 32 != 64 / 4 (the one thing Llama's shapes never test), tied embeddings."""


def make_tiny_qwen3_dir(path: Path, seed: int = 0, **config: Any) -> Path:
    """config.json + model.safetensors (+ the tests' tokenizer.json) of a random ``Qwen3ForCausalLM`` of
    :data:`TINY_QWEN3_CONFIG` with ``config`` over it; norm weights perturbed from 1.0, so a q/k norm that is
    dropped or misplaced shows in the logits."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**{**TINY_QWEN3_CONFIG, **config})).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    make_tiny_tokenizer(path / "tokenizer.json")
    return path


def write_recipe(path: Path, model: dict[str, Any], **sections: Any) -> Path:
    path.write_text(yaml.safe_dump({"model": model, **sections}))
    return path


def hf_reference(path: Path):  # noqa: ANN201 - transformers model
    """The transformers reference for a directory, eager attention (the same matmul/softmax order as ours)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


# --- Small graphs for the fusion tests: build with onnx.helper, fuse, lower, run both sides ---------------

FUSED_TOL = 1e-5
"""Max abs difference allowed between a graph and its fused-then-lowered self."""


def make_model(nodes: list, inputs: dict[str, np.ndarray], outputs: list[str],
               initializers: dict[str, np.ndarray] | None = None, shapes: dict[str, list] | None = None,
               opset: int = 18) -> onnx.ModelProto:
    """A model whose graph inputs take their dtype and shape from the sample ``inputs`` (also the feeds), or
    their shape from ``shapes`` (symbolic dims as names, as in an export); shapes of everything else come from
    ONNX shape inference, as they do in an export."""
    from onnx import helper, numpy_helper

    shapes = shapes or {}
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), shapes.get(k, v.shape))
         for k, v in inputs.items()],
        [helper.make_tensor_value_info(name, onnx.TensorProto.UNDEFINED, None) for name in outputs],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in (initializers or {}).items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    return onnx.shape_inference.infer_shapes(model)


def apply_rules(model: ir.Model, rules: Any) -> int:
    """Apply a rewrite rule set (or a ``(model) -> count`` pass) in place; returns the count."""
    from onnxscript.rewriter import pattern

    if isinstance(rules, pattern.RewriteRule):
        rules = pattern.RewriteRuleSet([rules])
    return rules.apply_to_model(model) if isinstance(rules, pattern.RewriteRuleSet) else rules(model)


def run_model(model: onnx.ModelProto | ir.Model, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    import onnx_ir as ir

    proto = ir.to_proto(model) if isinstance(model, ir.Model) else model
    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors only: unused initializers left by a rewrite are no news
    if any(op.domain == "omforge.kernels" for op in proto.opset_import):
        from omforge.runtime.ort import kernels

        kernels.register(options)
    session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def lowered(model: ir.Model) -> ir.Model:
    """A lowered copy of a fused model (the fused one is left as it is, for attribute checks)."""
    import onnx_ir as ir

    from omforge.passes import lower_ort

    copy = ir.from_proto(ir.to_proto(model))
    lower_ort.lower(copy)
    return copy


def fused_ops(model: ir.Model, op_type: str | None = None) -> list[ir.Node]:
    """The neutral ``omforge`` nodes of ``model`` (of one type when given)."""
    return [n for n in model.graph if n.domain == "omforge" and op_type in (None, n.op_type)]


def assert_fuses(proto: onnx.ModelProto, rules: Any, feeds: dict[str, np.ndarray], count: int,
                 op_type: str) -> ir.Model:
    """``rules`` match ``count`` times and leave ``count`` ``omforge.<op_type>`` nodes; fused and lowered, the
    graph computes what it did before (≤ :data:`FUSED_TOL`). Returns the fused (unlowered) model."""
    import onnx_ir as ir

    model = ir.from_proto(proto)
    assert apply_rules(model, rules) == count
    assert len(fused_ops(model, op_type)) == count
    before, after = run_model(proto, feeds), run_model(lowered(model), feeds)
    assert len(before) == len(after)
    for b, a in zip(before, after):
        assert b.shape == a.shape
        assert float(np.abs(b - a).max()) <= FUSED_TOL
    return model


def assert_no_match(proto: onnx.ModelProto, rules: Any) -> None:
    """``rules`` match nothing and leave the graph exactly as it was."""
    import onnx_ir as ir

    model = ir.from_proto(proto)
    before = ir.to_proto(model).SerializeToString()
    assert apply_rules(model, rules) == 0
    assert ir.to_proto(model).SerializeToString() == before


# --- Real exports for the fusion tests (the session fixture ``tiny_exports`` makes one per family) ----------

NUM_LAYERS = 2
"""Layers in every tiny HF config (``make_tiny_hf_dir``)."""


def export_tiny(root: Path, variant: str) -> Path:
    """Make the tiny HF checkpoint of ``variant`` under ``root`` and export it; returns the export directory."""
    from omforge.export.onnx_export import export_recipe
    from omforge.recipe import load_recipe

    make_tiny_hf_dir(root / "hf", variant)
    recipe = write_recipe(root / "recipe.yaml", {"name": f"tiny-{variant}", "source": "hf", "path": "hf"})
    export_recipe(load_recipe(recipe), root / "export", quiet=True)
    return root / "export"


def load_export(export_dir: Path) -> ir.Model:
    """The export's graph with its weights in memory (so it serializes whole, for ORT sessions from bytes)."""
    import onnx_ir as ir

    return ir.from_proto(onnx.load(str(export_dir / "model.onnx"), load_external_data=True))


def export_feeds(seed: int = 0, batch: int = 2, seq: int = 19) -> dict[str, np.ndarray]:
    ids = np.random.default_rng(seed).integers(0, 256, size=(batch, seq), dtype=np.int64)
    pos = np.ascontiguousarray(np.broadcast_to(np.arange(seq, dtype=np.int64), ids.shape))
    return {"input_ids": ids, "position_ids": pos}


def assert_same_logits(unfused: ir.Model, fused: ir.Model, feeds: dict[str, np.ndarray] | None = None) -> None:
    """The fused model, lowered to ORT, gives the unfused model's logits (≤ :data:`FUSED_TOL`)."""
    feeds = feeds or export_feeds()
    ref, out = run_model(unfused, feeds)[0], run_model(lowered(fused), feeds)[0]
    assert out.shape == ref.shape
    diff = float(np.abs(out - ref).max())
    assert diff <= FUSED_TOL, f"max abs diff {diff:.3g} > {FUSED_TOL}"


def compile_bundle(recipe: Path, out: Path, cache: Path, target: str | None = None) -> Path:
    """``omforge compile`` of ``recipe`` (for ``target``, default the recipe's) into ``out`` with the stage cache at
    ``cache`` (the process's ``OMFORGE_CACHE_DIR`` is restored afterwards, so module- and session-scoped fixtures
    can use it). For ascend without ``atc`` the bundle is complete up to the OM step, as compile leaves it."""
    import os

    from omforge.compile.ascend.atc import AtcMissing
    from omforge.compile.compiler import compile_recipe
    from omforge.recipe import load_recipe

    old = os.environ.get("OMFORGE_CACHE_DIR")
    os.environ["OMFORGE_CACHE_DIR"] = str(cache)
    try:
        compile_recipe(load_recipe(recipe), out, target=target, quiet=True)
    except AtcMissing:
        pass
    finally:
        if old is None:
            os.environ.pop("OMFORGE_CACHE_DIR")
        else:
            os.environ["OMFORGE_CACHE_DIR"] = old
    return out


def lowering_dict(opset: int = 18) -> dict:
    """AscendLowering.to_dict()'s custom_ops for every op type with a plugin, as :func:`lower_ascend.lower` records
    them (PFA needs our plugin at opset 17/18 only)."""
    from omforge.passes.ascend.lower import SPECS, CustomOp

    attributes = {
        "OmRmsNorm": {"epsilon": [1e-5]}, "OmAddRmsNorm": {"epsilon": [1e-5]}, "SwiGlu": {"dim": [-1]},
        "OmRotaryPositionEmbedding": {"mode": [0]}, "OmScatterPaKvCache": {"cache_mode": ["Norm"]},
        "NPUPromptFlashAttention": {"input_layout": ["BNSD"], "num_heads": [9], "num_key_value_heads": [3],
                                    "scale_value": [0.125], "pre_tokens": [2**31 - 1], "next_tokens": [0],
                                    "sparse_mode": [0], "inner_precise": [0]},
        "OmFusedInferAttentionScore": {"num_heads": [9], "num_key_value_heads": [3], "scale": [0.125],
                                       "input_layout": ["BSH"], "sparse_mode": [3], "block_size": [128],
                                       "inner_precise": [0]},
    }
    ops = {}
    for op_type, attrs in attributes.items():
        spec = SPECS[op_type]
        ops[op_type] = dataclasses.asdict(CustomOp(
            op_type, f"ai.onnx::{opset}::{op_type}", spec.ge_type, 1, attrs, own_plugin=opset not in spec.cann_opsets,
            own_kernel=spec.own_kernel, inputs=spec.inputs, outputs=spec.outputs))
    return {"opset": opset, "custom_ops": ops}


def greedy_paged(path: Path, layout, prompt: list[int], new: int, block: int) -> list[int]:  # noqa: ANN001
    """Greedy decoding of ``new`` tokens through a paged step graph (``layout``: its PagedLayout) with KV blocks of
    ``block`` tokens: the prompt in one step, then one decode step per token, over a scattered block table."""
    from omforge.contract import cdiv
    from omforge.runtime.ort.ort_executor import OrtExecutor
    from omforge.runtime.step import SeqWork, build_step

    ex = OrtExecutor(path, layout, num_blocks=32)
    table = list(range(31, 31 - cdiv(len(prompt) + new, block), -1))  # scattered, out of order
    ids = list(prompt)
    logits = ex.run(build_step([SeqWork(ids, 0, table)], block))
    for _ in range(new):
        ids.append(int(logits[0].argmax()))
        logits = ex.run(build_step([SeqWork(ids[-1:], len(ids) - 1, table)], block))
    return ids[len(prompt):]


# --- GGUF files as llama.cpp's converter writes them (the GGUF loader tests) ----------------------------------------

def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to q_proj / k_proj rows of the ``llama`` architecture (conversion/llama.py
    ``LlamaModel.permute``)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def add_llama_hparams(w: Any, cfg: dict[str, Any], rope_theta: float) -> None:
    """The hyperparameters every llama-family GGUF of the tests carries, from an HF ``config.json`` (``w``: a
    ``gguf.GGUFWriter``): blocks, context, widths, heads, rope base, RMS epsilon."""
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(rope_theta)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])


def write_gguf_tensors(w: Any, tensors: Any, qtype_of: Any = lambda name, arr: None) -> None:
    """Add ``(name, float32 array)`` pairs to the ``gguf.GGUFWriter`` ``w`` — each in the GGML type ``qtype_of(name,
    array)`` names, quantized by ``gguf``'s own quantizer (None: as it is) — and write and close the file."""
    import gguf

    for name, arr in tensors:
        qtype = qtype_of(name, arr)
        if qtype is None:
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
