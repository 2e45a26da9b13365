"""The unfused export: logits match transformers on tiny configs of every family; the graph has the promised shape."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from helpers import TINY_HF_CONFIGS, TINY_RECIPE, hf_reference, make_tiny_hf_dir, write_recipe
from omforge.export.onnx_export import export_recipe
from omforge.recipe import load_recipe

TOL = 1e-4
# Ops a fusion pass would introduce: none may appear in the unfused export.
FUSED_OPS = {"Attention", "RMSNormalization", "RotaryEmbedding", "LayerNormalization", "SimplifiedLayerNormalization",
             "SkipSimplifiedLayerNormalization", "GroupQueryAttention", "MultiHeadAttention", "Gelu", "FastGelu"}


def run_onnx(export_dir: Path, ids: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(export_dir / "model.onnx"), providers=["CPUExecutionProvider"])
    pos = np.ascontiguousarray(np.broadcast_to(np.arange(ids.shape[1], dtype=np.int64), ids.shape))
    return session.run(None, {"input_ids": ids, "position_ids": pos})[0]


@pytest.fixture(scope="module", params=sorted(TINY_HF_CONFIGS))
def tiny_family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    root = tmp_path_factory.mktemp(request.param)
    hf_dir = make_tiny_hf_dir(root / "hf", request.param)
    recipe = write_recipe(root / "recipe.yaml", {"name": f"tiny-{request.param}", "source": "hf", "path": "hf"})
    meta = export_recipe(load_recipe(recipe), root / "export", quiet=True)
    return request.param, hf_dir, root / "export", meta


def test_logits_match_transformers(tiny_family) -> None:  # noqa: ANN001
    variant, hf_dir, export_dir, _ = tiny_family
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 256, size=(2, 80), dtype=np.int64)  # positions past the llama3 scaling bands
    with torch.no_grad():
        ref = hf_reference(hf_dir)(torch.from_numpy(ids)).logits.numpy()
    out = run_onnx(export_dir, ids)
    assert out.shape == ref.shape
    diff = float(np.abs(out - ref).max())
    assert diff <= TOL, f"{variant}: max abs diff {diff:.3g} > {TOL}"


def test_dynamic_batch_and_sequence(tiny_family) -> None:  # noqa: ANN001
    """One graph serves any batch and length; each row equals that row run alone (no cross-batch leakage)."""
    _, _, export_dir, _ = tiny_family
    rng = np.random.default_rng(2)
    batch = rng.integers(0, 256, size=(3, 17), dtype=np.int64)
    together = run_onnx(export_dir, batch)
    for row in range(3):
        alone = run_onnx(export_dir, batch[row:row + 1])
        np.testing.assert_allclose(together[row], alone[0], atol=1e-5)
    # causal: the logits of a prefix do not depend on what follows it
    np.testing.assert_allclose(run_onnx(export_dir, batch[:1, :5])[0], together[0, :5], atol=1e-5)


def test_graph_contract(tiny_family) -> None:  # noqa: ANN001
    variant, _, export_dir, meta = tiny_family
    model = onnx.load(str(export_dir / "model.onnx"), load_external_data=False)
    onnx.checker.check_model(str(export_dir / "model.onnx"), full_check=True)
    assert [(o.domain, o.version) for o in model.opset_import] == [("", 18)]  # one import, ATC-compatible
    ops = {n.op_type for n in model.graph.node}
    assert not ops & FUSED_OPS, f"fused ops in the unfused export: {ops & FUSED_OPS}"
    assert all(n.domain in ("", "ai.onnx") for n in model.graph.node)
    inputs = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    assert inputs == {"input_ids": ["batch", "seq"], "position_ids": ["batch", "seq"]}
    out = model.graph.output[0]
    assert out.name == "logits"
    assert [d.dim_param or d.dim_value for d in out.type.tensor_type.shape.dim] == ["batch", "seq", 256]
    # weights live in the external data file, not in the protobuf
    big = [t for t in model.graph.initializer if np.prod(t.dims) > 1024]
    assert big and all(t.data_location == onnx.TensorProto.EXTERNAL for t in big)
    assert (export_dir / "model.onnx.data").stat().st_size > 4 * sum(64 * 128 for _ in range(6))
    # linear weights are named after their parameters
    names = {t.name for t in model.graph.initializer}
    assert "model.layers.1.mlp.down_proj.weight.T" in names
    assert meta["nodes_per_layer"] > 20 and meta["config"]["family"] == ("qwen2" if variant == "qwen2" else
                                                                         "mistral" if variant == "mistral" else "llama")


def test_tied_embedding_stored_once(tiny_family) -> None:  # noqa: ANN001
    variant, _, export_dir, meta = tiny_family
    model = onnx.load(str(export_dir / "model.onnx"), load_external_data=False)
    vocab_sized = [t.name for t in model.graph.initializer if 256 in t.dims and 64 in t.dims]
    if meta["config"]["tie_word_embeddings"]:
        assert vocab_sized == ["model.embed_tokens.weight"]
    else:
        assert sorted(vocab_sized) == ["lm_head.weight.T", "model.embed_tokens.weight"]


def test_config_read_from_hf(tiny_family) -> None:  # noqa: ANN001
    variant, _, _, meta = tiny_family
    cfg = meta["config"]
    assert cfg["qkv_bias"] == (variant == "qwen2")
    assert cfg["num_key_value_heads"] == 2 and cfg["head_dim"] == 16
    if variant == "llama3":
        assert cfg["rope_scaling"]["rope_type"] == "llama3" and cfg["rope_theta"] == 500000.0
    if variant == "mistral":
        assert cfg["sliding_window"] == 24


def test_random_source_matches_transformers(tmp_path: Path) -> None:
    """The ``random`` weight source (fixed seed) loaded into transformers gives the same logits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from omforge.export.weights import load_checkpoint

    recipe = load_recipe(TINY_RECIPE)
    meta = export_recipe(recipe, tmp_path, quiet=True)
    ckpt = load_checkpoint(recipe)
    cfg = meta["config"]
    hf = LlamaForCausalLM(LlamaConfig(
        vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"], num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"], rms_norm_eps=cfg["rms_norm_eps"],
        rope_theta=cfg["rope_theta"], tie_word_embeddings=True, attn_implementation="eager"))
    missing, unexpected = hf.load_state_dict({k: torch.from_numpy(v) for k, v in ckpt.tensors.items()}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    hf.tie_weights()
    ids = np.random.default_rng(3).integers(0, 256, size=(1, 40), dtype=np.int64)
    with torch.no_grad():
        ref = hf.eval()(torch.from_numpy(ids)).logits.numpy()
    assert float(np.abs(run_onnx(tmp_path, ids) - ref).max()) <= TOL


def test_export_streams_each_weight_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Traced without weights, the export reads every weight matrix from its source exactly once (while saving)
    — never the whole checkpoint at once — and the saved graph names them as before (``<param>.T``)."""
    from collections import Counter

    from omforge.export import weights

    reads: Counter[str] = Counter()
    original = weights.TensorMap.__getitem__

    def counting(self: weights.TensorMap, name: str) -> np.ndarray:
        reads[name] += 1
        return original(self, name)

    monkeypatch.setattr(weights.TensorMap, "__getitem__", counting)
    export_recipe(load_recipe(TINY_RECIPE), tmp_path / "export", quiet=True)
    matrices = [n for n in reads if not n.endswith("norm.weight")]
    assert len(matrices) == 2 * 7 + 1 and all(reads[n] == 1 for n in matrices), reads  # 7 per layer + embedding
    proto = onnx.load(str(tmp_path / "export" / "model.onnx"), load_external_data=False)
    names = {i.name for i in proto.graph.initializer}
    assert "model.layers.1.mlp.down_proj.weight.T" in names and "model.embed_tokens.weight" in names


def test_random_weights_are_seeded_per_tensor() -> None:
    """Any tensor of a random checkpoint is made alone, in any order, with the same values (what lets an 8B
    random model stream); a different seed changes them."""
    from omforge.export.weights import _config_from_recipe, random_checkpoint

    config = _config_from_recipe(load_recipe(TINY_RECIPE))
    a, b = random_checkpoint(config, 0).tensors, random_checkpoint(config, 0).tensors
    names = list(a)
    for name in reversed(names):
        np.testing.assert_array_equal(b[name], a[name])
    assert not np.array_equal(random_checkpoint(config, 1).tensors[names[0]], a[names[0]])
    assert "model.norm.weight" in a and "nope" not in a
