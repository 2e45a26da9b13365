"""Multi-LoRA, the graph side (docs/lora.md, issue 49): ``compile.lora`` gives the step graph adapter pools and a
per-token slot; tokens of the base model (slot 0) and of two adapters in one step each get the logits of
transformers on the weights merged for their adapter (``W + scale·B·A``); without ``compile.lora`` nothing changes.
The ascend lowering's LoRA terms are plain ops with a row in the CANN matrix."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest

from helpers import compile_bundle, hf_reference, make_tiny_hf_dir, write_recipe
from omforge.contract import cdiv
from omforge.contract.lora import SLOTS_INPUT, TARGET_MODULES, pool_a, pool_b
from omforge.contract.manifest import LoraSection, load_manifest
from omforge.runtime.ort import kernels
from omforge.runtime.ort.ort_executor import OrtExecutor
from omforge.runtime.step import SeqWork

MAX_LORAS, MAX_RANK = 3, 4
PROMPTS = ([5, 17, 42, 99, 3, 250, 7], [11, 12, 13, 14, 15], [200, 1, 64, 128, 9, 33])
# adapter slot → (rank, targets): a full-rank one on every module and a smaller one on three
ADAPTERS = {1: (4, TARGET_MODULES), 2: (2, ("q_proj", "v_proj", "down_proj"))}
_MODULE_OF = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
              "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lora")
    make_tiny_hf_dir(root / "hf", "llama")
    return root


def _compile(root: Path, name: str, compile_section: dict, plain: bool = False) -> Path:
    """The tiny llama compiled for ort with ``compile_section``; ``plain``: with the kernel library disabled
    (OMFORGE_KERNELS=0), so every op takes its plain-op lowering."""
    recipe = write_recipe(root / f"{name}.yaml", {"name": "tiny-lora", "source": "hf", "path": "hf"},
                          compile={"max_seq_len": 64, "max_batch_size": 4, "max_num_tokens": 64, **compile_section})
    if not plain:
        return compile_bundle(recipe, root / name, root / "cache")
    old = os.environ.get("OMFORGE_KERNELS")
    os.environ["OMFORGE_KERNELS"] = "0"
    kernels.status.cache_clear()
    try:
        return compile_bundle(recipe, root / name, root / "cache")
    finally:
        if old is None:
            os.environ.pop("OMFORGE_KERNELS")
        else:
            os.environ["OMFORGE_KERNELS"] = old
        kernels.status.cache_clear()


def _adapter(cfg, rank: int, targets: tuple[str, ...], seed: int) -> dict[tuple[int, str], tuple]:  # noqa: ANN001
    """``{(layer, target): (A [r, in], scale·B [out, r])}``, random, big enough to move the logits."""
    rng = np.random.default_rng(seed)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    out = {"q_proj": cfg.num_attention_heads * head_dim, "k_proj": cfg.num_key_value_heads * head_dim,
           "v_proj": cfg.num_key_value_heads * head_dim, "o_proj": cfg.hidden_size,
           "gate_proj": cfg.intermediate_size, "up_proj": cfg.intermediate_size, "down_proj": cfg.hidden_size}
    inp = {t: cfg.intermediate_size if t == "down_proj" else cfg.hidden_size for t in TARGET_MODULES}
    return {(layer, t): (rng.standard_normal((rank, inp[t])).astype(np.float32) * 0.2,
                         rng.standard_normal((out[t], rank)).astype(np.float32) * 0.2)
            for layer in range(cfg.num_hidden_layers) for t in targets}


def _write_slot(pools: dict[str, np.ndarray], spec: LoraSection, slot: int, adapter: dict) -> None:
    """docs/lora.md's packing: part p of a projection in rank rows p·R … of A and columns p·R … of B (rows
    start … stop), zeros elsewhere."""
    r_max = spec.max_rank
    for proj in spec.projections:
        a, b = pools[pool_a(proj.layer, proj.name)], pools[pool_b(proj.layer, proj.name)]
        a[slot], b[slot] = 0, 0
        for p, part in enumerate(proj.parts):
            if (proj.layer, part.target) not in adapter:
                continue
            lora_a, lora_b = adapter[proj.layer, part.target]
            r = lora_a.shape[0]
            a[slot, p * r_max:p * r_max + r] = lora_a
            b[slot, part.start:part.stop, p * r_max:p * r_max + r] = lora_b


def _merged(base, adapter: dict):  # noqa: ANN001, ANN202 - transformers model
    import torch

    model = copy.deepcopy(base)
    with torch.no_grad():
        for (layer, target), (a, b) in adapter.items():
            module = getattr(getattr(model.model.layers[layer], _MODULE_OF[target]), target)
            module.weight += torch.from_numpy(b @ a)
    return model


def _reference(model, prompt: list[int]) -> np.ndarray:  # noqa: ANN001
    import torch

    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].numpy()


@pytest.fixture(scope="module")
def adapters(root: Path) -> dict[int, dict]:
    """slot → its random adapter."""
    cfg = hf_reference(root / "hf").config
    return {slot: _adapter(cfg, rank, targets, seed=slot) for slot, (rank, targets) in ADAPTERS.items()}


@pytest.fixture(scope="module")
def references(root: Path, adapters: dict) -> dict[int, list[np.ndarray]]:
    """slot → the transformers logits of each prompt (slot 0: the base model, exactly as saved)."""
    base = hf_reference(root / "hf")
    models = {0: base, **{slot: _merged(base, adapter) for slot, adapter in adapters.items()}}
    return {slot: [_reference(m, p) for p in PROMPTS] for slot, m in models.items()}


def _mixed_step(bundle: Path, adapters: dict) -> tuple[list[np.ndarray], OrtExecutor]:
    """Both adapters written into slots 1 and 2 of the executor's pools, then ONE step with prompt 0 on the base
    model, prompt 1 on adapter 1, prompt 2 on adapter 2: every position's logits of each."""
    m = load_manifest(bundle)
    assert m.lora is not None
    ex = OrtExecutor.for_bundle(bundle, m, num_blocks=16)
    for slot, adapter in adapters.items():
        _write_slot(ex.lora_pools, m.lora, slot, adapter)
    bs = m.kv.block_size
    work, block = [], 0
    for slot, prompt in enumerate(PROMPTS):
        blocks = list(range(block, block + cdiv(len(prompt), bs)))
        block += len(blocks)
        work.append(SeqWork(prompt, 0, blocks, all_logits=True, lora_slot=slot))
    logits = ex.execute(work)
    rows = np.cumsum([0, *(len(p) for p in PROMPTS)])
    return [logits[rows[i]:rows[i + 1]] for i in range(len(PROMPTS))], ex


VARIANTS = {
    "fused": ({}, False, 1e-4),
    "unfused": ({"fusions": {"qkv_merge": False, "gate_up_swiglu": False}}, False, 1e-4),
    "plain": ({}, True, 1e-4),
    "int8": ({"weights": "int8"}, False, 0.03),  # int8 weights: ~0.016 from transformers here, the adapters ~0.5
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_mixed_adapters_match_merged_weights(root: Path, adapters: dict, references: dict, variant: str) -> None:
    section, plain, tol = VARIANTS[variant]
    bundle = _compile(root, variant, {**section, "lora": {"max_loras": MAX_LORAS, "max_rank": MAX_RANK}}, plain)
    got, ex = _mixed_step(bundle, adapters)
    m = load_manifest(bundle)
    for slot, logits in enumerate(got):
        ref = references[slot][slot]
        diff = float(np.abs(logits - ref).max())
        assert diff <= tol, f"{variant}: slot {slot}: max |Δlogits| {diff:.3g} > {tol}"
        if slot:  # the adapter moves the logits far more than the tolerance: its term is really there
            assert float(np.abs(ref - references[0][slot]).max()) > 10 * tol
    assert set(ex.lora_pools) == {n for p in m.lora.projections for n in (pool_a(p.layer, p.name),
                                                                            pool_b(p.layer, p.name))}
    assert not any(pool[0].any() for pool in ex.lora_pools.values())  # slot 0 stays the base model
    ops = m.passes.op_histogram
    lora_ops = {k: v for k, v in ops.items() if k.endswith("LoraAdd")}
    if plain or kernels.status().lora is None:
        assert not lora_ops, ops
    else:
        assert lora_ops == {"omforge.kernels::LoraAdd": len(m.lora.projections)}


def test_manifest_section(root: Path) -> None:
    """The section lists each LoRA'd projection in layer order with its parts (fused: qkv = [q | k | v], gate_up =
    [gate | up]); the pools are ABI inputs of the documented shapes; the section round-trips."""
    bundle = _compile(root, "fused", {"lora": {"max_loras": MAX_LORAS, "max_rank": MAX_RANK}})
    m = load_manifest(bundle)
    spec = m.lora
    assert spec is not None and spec.num_slots == MAX_LORAS + 1 and spec.target_modules == TARGET_MODULES
    assert [(p.layer, p.name) for p in spec.projections] == [(n, name) for n in range(2)
                                                             for name in ("qkv", "o", "gate_up", "down")]
    qkv = spec.projections[0]
    assert (qkv.in_features, qkv.out_features) == (64, 128)
    assert [(p.target, p.start, p.stop) for p in qkv.parts] == [("q_proj", 0, 64), ("k_proj", 64, 96),
                                                                ("v_proj", 96, 128)]
    assert [(p.target, p.start, p.stop) for p in spec.projections[2].parts] == [("gate_proj", 0, 128),
                                                                                ("up_proj", 128, 256)]
    inputs = {e.name: e for e in m.abi.inputs}
    assert inputs[SLOTS_INPUT].dtype == "int64" and list(inputs[SLOTS_INPUT].shape) == [1, "num_tokens"]
    assert list(inputs[pool_a(0, "qkv")].shape) == [MAX_LORAS + 1, 3 * MAX_RANK, 64]
    assert list(inputs[pool_b(1, "down")].shape) == [MAX_LORAS + 1, 64, MAX_RANK]
    assert inputs[pool_b(1, "down")].dtype == "float"  # float32, as the ABI names it (onnx-ir)
    assert LoraSection.from_dict(spec.to_dict(), "lora") == spec
    from omforge.compile.bundle import describe  # omforge inspect: one line of the section, pools of layer 0 only

    text = describe(m)
    assert (f"  lora       {MAX_LORAS} adapter slots (+ the base model's), rank {MAX_RANK}, targets "
            f"{', '.join(TARGET_MODULES)}; 8 projections: qkv, o, gate_up, down") in text.splitlines()
    assert "lora_a.0.qkv" in text and "lora_a.1.qkv" not in text


def test_target_subset(root: Path) -> None:
    """Only the targeted modules get a part: q and v of the fused qkv (k's columns get no term), no MLP pool."""
    bundle = _compile(root, "qv", {"lora": {"max_loras": 1, "max_rank": 8, "target_modules": ["q_proj", "v_proj"]}})
    spec = load_manifest(bundle).lora
    assert [(p.layer, p.name) for p in spec.projections] == [(0, "qkv"), (1, "qkv")]
    assert [(p.target, p.start, p.stop) for p in spec.projections[0].parts] == [("q_proj", 0, 64),
                                                                                ("v_proj", 96, 128)]
    assert {e.name for e in load_manifest(bundle).abi.inputs if e.name.startswith("lora_")} == {
        SLOTS_INPUT, *(f(n, "qkv") for n in range(2) for f in (pool_a, pool_b))}


def test_without_lora_nothing_changes(root: Path) -> None:
    """No compile.lora: no LoRA input, no LoRA node, no manifest section, no pools in the executor."""
    bundle = _compile(root, "base", {})
    m = load_manifest(bundle)
    assert m.lora is None and '"lora":' not in (bundle / "manifest.json").read_text()
    assert not [e.name for e in m.abi.inputs if e.name.startswith("lora")]
    model = ir.load(bundle / m.graphs.step)
    assert not [n for n in model.graph if "Lora" in n.op_type]
    assert OrtExecutor.for_bundle(bundle, m, num_blocks=4).lora_pools == {}


def _projection_graph(bias: bool) -> ir.Model:
    """x [1, T, 8] → layer 0's q projection (8 → 6, with a bias Add when ``bias``, as Qwen2's) → Relu → output."""
    from onnx import helper

    from helpers import make_model

    rng = np.random.default_rng(0)
    w = "model.layers.0.self_attn.q_proj.weight.T"
    nodes = [helper.make_node("MatMul", ["x", w], ["q"])]
    inits = {w: rng.standard_normal((8, 6)).astype(np.float32)}
    if bias:
        nodes.append(helper.make_node("Add", ["q", "model.layers.0.self_attn.q_proj.bias"], ["qb"]))
        inits["model.layers.0.self_attn.q_proj.bias"] = rng.standard_normal(6).astype(np.float32)
    nodes.append(helper.make_node("Relu", ["qb" if bias else "q"], ["y"]))
    proto = make_model(nodes, {"x": np.zeros((1, 5, 8), np.float32)}, ["y"], inits, shapes={"x": [1, "T", 8]})
    return ir.from_proto(proto)


@pytest.mark.parametrize("bias", [False, True])
def test_term_after_the_bias(bias: bool) -> None:
    """LoraAdd reads the projection's output after its bias Add and is what the rest reads; the plain lowering
    computes ``y + B[slot]·(A[slot]·x)`` per token."""
    from helpers import run_model
    from omforge.passes import lora

    model = _projection_graph(bias)
    section = lora.insert_lora(model, max_loras=2, max_rank=3, target_modules=TARGET_MODULES)
    assert [(p.layer, p.name, p.in_features, p.out_features) for p in section.projections] == [(0, "q", 8, 6)]
    (node,) = [n for n in model.graph if n.op_type == "LoraAdd"]
    assert node.inputs[0].producer().op_type == ("Add" if bias else "MatMul")
    assert [u.node.op_type for u in node.outputs[0].uses()] == ["Relu"]
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((1, 5, 8)).astype(np.float32),
             pool_a(0, "q"): rng.standard_normal((3, 3, 8)).astype(np.float32),
             pool_b(0, "q"): rng.standard_normal((3, 6, 3)).astype(np.float32),
             SLOTS_INPUT: np.array([[0, 2, 1, 2, 0]], np.int64)}
    feeds[pool_a(0, "q")][0] = feeds[pool_b(0, "q")][0] = 0
    base = run_model(_projection_graph(bias), {"x": feeds["x"]})[0]
    assert lora.lower_plain(model.graph) == 1
    got = run_model(model, feeds)[0]
    w = model.graph.initializers["model.layers.0.self_attn.q_proj.weight.T"].const_value.numpy()
    y = feeds["x"][0] @ w
    if bias:
        y = y + model.graph.initializers["model.layers.0.self_attn.q_proj.bias"].const_value.numpy()
    slots = feeds[SLOTS_INPUT][0]
    term = np.stack([feeds[pool_b(0, "q")][s] @ (feeds[pool_a(0, "q")][s] @ x) for s, x in zip(slots, feeds["x"][0])])
    np.testing.assert_allclose(got[0], np.maximum(y + term, 0), atol=1e-5)
    np.testing.assert_array_equal(got[0][slots == 0], base[0][slots == 0])  # slot 0: the base model exactly


def test_missing_target_is_one_line() -> None:
    """A targeted module that no layer has is refused in one line naming the recipe key (through the pipeline too,
    whose pass manager would otherwise wrap it)."""
    from omforge.errors import OmforgeError
    from omforge.passes.options import LoraOptions
    from omforge.passes.pipeline import Pipeline

    expected = ("compile.lora.target_modules: o_proj, down_proj found in no layer of the graph (no projection MatMul "
                "with that weight); drop it from the list")
    with pytest.raises(OmforgeError) as err:
        Pipeline("ort", lora=LoraOptions(1, 4, ("q_proj", "o_proj", "down_proj"))).run(_projection_graph(False))
    assert str(err.value) == expected and isinstance(err.value, ir.passes.PostconditionError)


@pytest.mark.parametrize("weights", ["float16", "int8"])
def test_ascend_lowering_is_plain_ops_atc_accepts(root: Path, weights: str) -> None:
    """The ascend step graph of a LoRA recipe (float16 graph; int8: W8A16 too): the terms are default-domain plain
    ops (Gather by int64 slots, batched MatMul, Reshape, Add) that every CANN conformance rule accepts, the pools
    are inputs of one dtype (the graph's float16) with static shapes, lora_slots int64 over the gear dim
    num_tokens; the ACL executor takes the bundle (tests/test_acl_lora.py runs it), asking only for its OM."""
    from omforge.compile.ascend.atc_conformance import check_bundle
    from omforge.compile.ascend.cann_matrix import violations
    from omforge.compile.ascend.step_usage import file_uses
    from omforge.runtime.ascend.acl_executor import OmModelsMissing
    from omforge.runtime.ascend.acl_executor import check_bundle as acl_check_bundle

    recipe = write_recipe(root / f"ascend-{weights}.yaml", {"name": "tiny-lora", "source": "hf", "path": "hf"},
                          compile={"target": "ascend", "weights": weights, "max_seq_len": 256, "max_batch_size": 4,
                                   "max_num_tokens": 256, "lora": {"max_loras": 2, "max_rank": 4}})
    bundle = compile_bundle(recipe, root / f"ascend-{weights}", root / "cache")
    m = load_manifest(bundle)
    assert m.lora is not None and len(m.lora.projections) == 8
    step = bundle / "ascend" / "step.onnx"
    model = ir.load(step)
    assert {n.domain for n in model.graph} <= {"", "ai.onnx"} and set(model.opset_imports) == {""}
    assert not [n for n in model.graph if "Lora" in n.op_type]
    gathers = [n for n in model.graph if n.op_type == "Gather" and n.inputs[0].name.startswith("lora_")]
    assert len(gathers) == 2 * len(m.lora.projections)
    assert all(n.inputs[1].dtype == ir.DataType.INT64 for n in gathers)
    pools = {v.name: v for v in model.graph.inputs if v.name.startswith(("lora_a.", "lora_b."))}
    assert len(pools) == 2 * len(m.lora.projections)
    assert {v.dtype for v in pools.values()} == {ir.DataType.FLOAT16}
    assert all(all(isinstance(d, int) for d in v.shape) for v in pools.values())
    slots = next(v for v in model.graph.inputs if v.name == SLOTS_INPUT)
    assert slots.dtype == ir.DataType.INT64 and [str(d) for d in slots.shape] == ["1", "num_tokens"]
    assert violations(file_uses(step)) == []
    failed = [r.line() for results in check_bundle(bundle).values() for r in results if not r.ok]
    assert not failed, failed
    with pytest.raises(OmModelsMissing, match="the OM model was not built"):
        acl_check_bundle(bundle, m)
