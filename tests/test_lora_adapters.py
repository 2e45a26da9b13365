"""LoRA adapters on the serving side (runtime/lora, docs/lora.md): PEFT directories and llama.cpp GGUF LoRA files read
into ``(A, scale · B)`` pairs that equal PEFT's own merge, the check against a bundle's LoRA section, the slot pool
layout, and the slot table (pinning, least-recently-used replacement). PEFT on a tiny random Llama is the reference."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from helpers import make_tiny_hf_dir
from omforge.contract.lora import PROJECTIONS, TARGET_MODULES, pool_a, pool_b
from omforge.contract.manifest import LoraPart, LoraProjection, LoraSection, ModelConfig
from omforge.runtime.lora import (
    LoraAdapter,
    LoraError,
    LoraInUse,
    LoraRegistry,
    UnknownLora,
    load_adapter,
    validate,
    write_slot,
)
from omforge.runtime.lora.adapter import make_adapter

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 64, 128, 2, 4, 2, 16  # helpers.make_tiny_hf_dir's sizes
CONFIG = ModelConfig(family="llama", vocab_size=256, hidden_size=HIDDEN, intermediate_size=INTER,
                     num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                     head_dim=HEAD_DIM)
WIDTHS = {"q_proj": (HIDDEN, HEADS * HEAD_DIM), "k_proj": (HIDDEN, KV_HEADS * HEAD_DIM),
          "v_proj": (HIDDEN, KV_HEADS * HEAD_DIM), "o_proj": (HEADS * HEAD_DIM, HIDDEN),
          "gate_proj": (HIDDEN, INTER), "up_proj": (HIDDEN, INTER), "down_proj": (INTER, HIDDEN)}
"""Target module → (in_features, out_features) of the tiny model."""


def lora_section(max_loras: int = 3, max_rank: int = 8, targets: tuple[str, ...] = TARGET_MODULES,
                 fused: bool = True) -> LoraSection:
    """The tiny model's LoRA section as the insertion pass would write it (docs/lora.md): fused qkv and gate_up
    projections (or one per module), parts in column order, only the targeted modules in ``parts``."""
    names = ("qkv", "o", "gate_up", "down") if fused else ("q", "k", "v", "o", "gate", "up", "down")
    projections = []
    for layer in range(LAYERS):
        for name in names:
            modules = PROJECTIONS[name]
            parts, start = [], 0
            for m in modules:
                width = WIDTHS[m][1]
                if m in targets:
                    parts.append(LoraPart(target=m, start=start, stop=start + width))
                start += width
            if parts:
                projections.append(LoraProjection(layer=layer, name=name, in_features=WIDTHS[modules[0]][0],
                                                  out_features=start, parts=tuple(parts)))
    return LoraSection(max_loras=max_loras, max_rank=max_rank, target_modules=targets,
                       projections=tuple(projections))


def zero_pools(spec: LoraSection) -> dict[str, np.ndarray]:
    pools = {}
    for p in spec.projections:
        width = len(p.parts) * spec.max_rank
        pools[pool_a(p.layer, p.name)] = np.zeros((spec.num_slots, width, p.in_features), np.float32)
        pools[pool_b(p.layer, p.name)] = np.zeros((spec.num_slots, p.out_features, width), np.float32)
    return pools


def random_adapter(name: str, seed: int, rank: int = 4, targets: tuple[str, ...] = TARGET_MODULES,
                   layers: range = range(LAYERS)) -> LoraAdapter:
    rng = np.random.default_rng(seed)
    return make_adapter(name, Path(f"/nowhere/{name}"), {
        (layer, t): (rng.standard_normal((rank, WIDTHS[t][0])), rng.standard_normal((WIDTHS[t][1], rank)))
        for layer in layers for t in targets})


# --- PEFT: the reference ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_hf_dir(tmp_path_factory.mktemp("lora") / "base", "llama")


PEFT_CASES = {
    "r4-all": dict(r=4, lora_alpha=8, target_modules=list(TARGET_MODULES)),
    "r8-rslora-qv": dict(r=8, lora_alpha=16, use_rslora=True, target_modules=["q_proj", "v_proj"]),
    "r4-patterns": dict(r=4, lora_alpha=16, target_modules="all-linear",
                        rank_pattern={"k_proj": 8, "model.layers.1.mlp.down_proj": 2},
                        alpha_pattern={"o_proj": 3.0, r"layers\.0\.self_attn\.q_proj": 32.0}),
    "r8-regex": dict(r=8, lora_alpha=4, target_modules=r".*\.layers\.1\..*\.(k_proj|gate_proj)"),
    "r4-layer0": dict(r=4, lora_alpha=4, target_modules=["v_proj", "up_proj"], layers_to_transform=[0]),
}


def make_peft(base_dir: Path, out: Path, seed: int = 0, **lora: object) -> tuple[dict, dict]:
    """Save a PEFT adapter with random A and B (``init_lora_weights=False``) to ``out``; the base model's weights and
    PEFT's merged ones (``merge_and_unload``), as numpy."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    base = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **lora))
    peft_model.save_pretrained(out)
    merged = {k: v.detach().numpy() for k, v in peft_model.merge_and_unload().state_dict().items()}
    return base, merged


@pytest.fixture(scope="module")
def peft_adapters(base_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict, dict]]:
    root = tmp_path_factory.mktemp("peft")
    return {case: (root / case, *make_peft(base_dir, root / case, seed=i, **kw))
            for i, (case, kw) in enumerate(PEFT_CASES.items())}


def hf_key(layer: int, target: str) -> str:
    return f"model.layers.{layer}.{'self_attn' if target[0] in 'qkvo' else 'mlp'}.{target}.weight"


@pytest.mark.parametrize("case", PEFT_CASES)
def test_peft_adapter_equals_peft_merge(case: str, peft_adapters: dict) -> None:
    path, base, merged = peft_adapters[case]
    adapter = load_adapter(case, path)
    changed = {(layer, t) for layer in range(LAYERS) for t in TARGET_MODULES
               if not np.array_equal(base[hf_key(layer, t)], merged[hf_key(layer, t)])}
    assert changed and set(adapter.weights) == changed  # exactly the modules PEFT merged
    assert adapter.target_modules == tuple(t for t in TARGET_MODULES if any(t == m for _, m in changed))
    for (layer, t), (a, b) in adapter.weights.items():
        assert a.dtype == b.dtype == np.float32 and a.shape == (b.shape[1], WIDTHS[t][0])
        np.testing.assert_allclose(base[hf_key(layer, t)] + b @ a, merged[hf_key(layer, t)], rtol=0, atol=2e-6,
                                   err_msg=f"{case}: layer {layer} {t}")
    assert adapter.rank == max(a.shape[0] for a, _ in adapter.weights.values())
    validate(adapter, lora_section(), CONFIG)


def test_peft_patterns_and_layers_are_honoured(peft_adapters: dict) -> None:
    patterns = load_adapter("p", peft_adapters["r4-patterns"][0])
    assert patterns.weights[(0, "k_proj")][0].shape[0] == 8 and patterns.weights[(1, "down_proj")][0].shape[0] == 2
    assert patterns.weights[(0, "down_proj")][0].shape[0] == 4 and patterns.rank == 8
    regex = load_adapter("l", peft_adapters["r8-regex"][0])
    assert set(regex.weights) == {(1, "k_proj"), (1, "gate_proj")}
    layer0 = load_adapter("l", peft_adapters["r4-layer0"][0])
    assert set(layer0.weights) == {(0, "v_proj"), (0, "up_proj")}


def test_digest_is_the_weights(peft_adapters: dict) -> None:
    path = peft_adapters["r4-all"][0]
    one, two = load_adapter("one", path), load_adapter("two", path)
    assert one.digest == two.digest and len(one.digest) == 32
    assert one.digest != load_adapter("x", peft_adapters["r4-patterns"][0]).digest


def edited(src: Path, dst: Path, **changes: object) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("changes, message", [
    (dict(use_dora=True), "adapter 'bad': adapter_config.json use_dora is true; DoRA adapters are not supported"),
    (dict(bias="all"), "adapter 'bad': adapter_config.json bias is 'all'; adapters with trained biases"),
    (dict(lora_bias=True), "adapter_config.json lora_bias is True"),
    (dict(modules_to_save=["lm_head"]), "adapter_config.json modules_to_save is ['lm_head']; fully trained"),
    (dict(target_modules=["q_proj", "embed_tokens"]), "target_modules has embed_tokens; LoRA is served on q_proj"),
    (dict(peft_type="PREFIX_TUNING"), "peft_type is 'PREFIX_TUNING'; only LORA adapters are served"),
    (dict(r=8), "lora_A is [4, 64] and lora_B [64, 4]; adapter_config.json says r = 8"),
    (dict(layers_to_transform=[0]), "outside adapter_config.json layers_to_transform [0]"),
])
def test_peft_refusals(changes: dict, message: str, peft_adapters: dict, tmp_path: Path) -> None:
    path = edited(peft_adapters["r4-all"][0], tmp_path / "bad", **changes)
    with pytest.raises(LoraError) as e:
        load_adapter("bad", path)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_peft_refuses_files(peft_adapters: dict, tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    src = peft_adapters["r4-all"][0]
    with pytest.raises(LoraError, match=r"adapter 'a': .*/nope does not exist"):
        load_adapter("a", tmp_path / "nope")
    (tmp_path / "w.bin").write_bytes(b"x")
    with pytest.raises(LoraError, match="neither a PEFT adapter directory nor a .gguf LoRA file"):
        load_adapter("a", tmp_path / "w.bin")
    pickled = edited(src, tmp_path / "pickled")
    (pickled / "adapter_model.safetensors").rename(pickled / "adapter_model.bin")
    with pytest.raises(LoraError, match="has adapter_model.bin only; only safetensors adapters are loaded"):
        load_adapter("a", pickled)
    no_config = edited(src, tmp_path / "no_config")
    (no_config / "adapter_config.json").unlink()
    with pytest.raises(LoraError, match="adapter_config.json is missing"):
        load_adapter("a", no_config)
    embed = edited(src, tmp_path / "embed")
    save_file({"base_model.model.model.embed_tokens.lora_embedding_A": np.ones((4, 256), np.float32)},
              str(embed / "adapter_model.safetensors"))
    with pytest.raises(LoraError, match="has 'base_model.model.model.embed_tokens.lora_embedding_A'; LoRA is served"):
        load_adapter("a", embed)


def test_bfloat16_peft_weights(peft_adapters: dict, tmp_path: Path) -> None:
    """Adapters trained in bf16 are saved as BF16 (no numpy dtype): read as the float32 they widen to."""
    from safetensors.numpy import load_file

    src = peft_adapters["r4-all"][0]
    dst = edited(src, tmp_path / "bf16")
    tensors = load_file(str(src / "adapter_model.safetensors"))
    top = {k: (v.view(np.uint32) >> 16).astype(np.uint16) for k, v in tensors.items()}  # truncated to bf16
    header = {k: {"dtype": "BF16", "shape": list(v.shape)} for k, v in top.items()}
    blob, offset = b"", 0
    for k, v in top.items():
        header[k]["data_offsets"] = [offset, offset + v.nbytes]
        blob, offset = blob + v.tobytes(), offset + v.nbytes
    text = json.dumps(header).encode()
    (dst / "adapter_model.safetensors").write_bytes(len(text).to_bytes(8, "little") + text + blob)
    ref, bf16 = load_adapter("f32", src), load_adapter("bf16", dst)
    for key, (a, b) in bf16.weights.items():
        np.testing.assert_allclose(a, ref.weights[key][0], rtol=2 ** -7)
        np.testing.assert_allclose(b, ref.weights[key][1], rtol=2 ** -7)
        assert not np.array_equal(a, ref.weights[key][0])


# --- llama.cpp GGUF LoRA -------------------------------------------------------------------------------------------

GGUF_NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
              "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


def llama_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py ``LlamaModel.permute``."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def write_gguf_lora(adapter_dir: Path, out: Path, arch: str = "llama", dtype: type = np.float32) -> Path:
    """What llama.cpp's convert_lora_to_gguf.py writes for a PEFT adapter of a Llama base model (ggml-org/llama.cpp,
    convert_lora_to_gguf.py ``LoraModel``): ``general.type = adapter`` (``add_type``), ``adapter.type = lora``,
    ``adapter.lora.alpha`` (float32), and per weight ``blk.N.<name>.weight.lora_a`` / ``.lora_b`` (torch layout,
    ``[r, in]`` / ``[out, r]``), after the base converter's ``modify_tensors``: ``LlamaModel.permute`` of q_proj /
    k_proj, which ``LoraTorchTensor`` applies to ``lora_b``'s rows."""
    import gguf
    from safetensors.numpy import load_file

    lparams = json.loads((adapter_dir / "adapter_config.json").read_text())
    tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
    writer = gguf.GGUFWriter(out, arch)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(lparams["lora_alpha"]))
    for key in sorted(k for k in tensors if ".lora_A." in k):
        a, b = tensors[key], tensors[key.replace(".lora_A.", ".lora_B.")]
        parts = key.replace("base_model.model.", "").split(".")  # model.layers.N.self_attn.q_proj.lora_A.weight
        layer, module = int(parts[2]), parts[4]
        if arch == "llama" and module == "q_proj":
            b = llama_permute(b, HEADS, HEADS)
        if arch == "llama" and module == "k_proj":
            b = llama_permute(b, HEADS, KV_HEADS)
        name = f"blk.{layer}.{GGUF_NAMES[module]}.weight"
        writer.add_tensor(f"{name}.lora_a", np.ascontiguousarray(a, dtype=dtype))
        writer.add_tensor(f"{name}.lora_b", np.ascontiguousarray(b, dtype=dtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.mark.parametrize("case", ["r4-all", "r4-rank-pattern"])
def test_gguf_lora_equals_peft(case: str, peft_adapters: dict, base_dir: Path, tmp_path: Path) -> None:
    if case == "r4-rank-pattern":  # llama.cpp carries one alpha: scale alpha / r per tensor, as PEFT's without
        path = tmp_path / "peft"   # alpha_pattern
        make_peft(base_dir, path, seed=7, r=4, lora_alpha=12, target_modules=["q_proj", "k_proj", "down_proj"],
                  rank_pattern={"k_proj": 8})
    else:
        path = peft_adapters[case][0]
    ref = load_adapter("ref", path)
    f32 = load_adapter("g", write_gguf_lora(path, tmp_path / "a.gguf"), config=CONFIG)
    assert set(f32.weights) == set(ref.weights) and f32.rank == ref.rank
    for key, (a, b) in f32.weights.items():
        np.testing.assert_array_equal(a, ref.weights[key][0])
        np.testing.assert_array_equal(b, ref.weights[key][1], err_msg=str(key))
    assert f32.digest == ref.digest  # the same weights, whatever the file format
    f16 = load_adapter("h", write_gguf_lora(path, tmp_path / "h.gguf", dtype=np.float16), config=CONFIG)
    for key, (a, b) in f16.weights.items():
        np.testing.assert_allclose(a, ref.weights[key][0], rtol=1e-3, atol=1e-4)
        np.testing.assert_allclose(b, ref.weights[key][1], rtol=1e-3, atol=1e-4)


def test_gguf_permutation_is_undone_only_for_llama(peft_adapters: dict, tmp_path: Path) -> None:
    import gguf

    path = peft_adapters["r4-all"][0]
    ref = load_adapter("ref", path)
    file = write_gguf_lora(path, tmp_path / "a.gguf")
    stored = next(t for t in gguf.GGUFReader(file).tensors if t.name == "blk.0.attn_q.weight.lora_b")
    assert not np.allclose(np.asarray(stored.data) * np.float32(8 / 4), ref.weights[(0, "q_proj")][1])  # permuted
    with pytest.raises(LoraError, match="lora_b rows are permuted per head by llama.cpp; reading it needs the base"):
        load_adapter("g", file)
    qwen2 = ModelConfig(**{**CONFIG.__dict__, "family": "qwen2"})
    with pytest.raises(LoraError, match="general.architecture 'llama' does not match the base model's family 'qwen2'"):
        load_adapter("g", file, config=qwen2)
    unpermuted = load_adapter("q", write_gguf_lora(path, tmp_path / "q.gguf", arch="qwen2"), config=qwen2)
    for key, (_, b) in unpermuted.weights.items():
        np.testing.assert_array_equal(b, ref.weights[key][1])


def test_gguf_refusals(tmp_path: Path) -> None:
    import gguf

    base = tmp_path / "base.gguf"
    writer = gguf.GGUFWriter(base, "llama")
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_tensor("blk.0.attn_q.weight", np.ones((64, 64), np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    with pytest.raises(LoraError, match="general.type is 'model', not 'adapter'"):
        load_adapter("m", base, config=CONFIG)
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf")
    with pytest.raises(LoraError, match=r"adapter 'j': .*junk.gguf is not a readable GGUF file"):
        load_adapter("j", tmp_path / "junk.gguf")
    embd = tmp_path / "embd.gguf"
    writer = gguf.GGUFWriter(embd, "llama")
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_tensor("token_embd.weight.lora_a", np.ones((4, 256), np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    with pytest.raises(LoraError, match="tensor 'token_embd.weight.lora_a'; LoRA is served on q_proj"):
        load_adapter("e", embd, config=CONFIG)


# --- validate ------------------------------------------------------------------------------------------------------

def test_validate_errors() -> None:
    spec = lora_section(max_rank=8)
    validate(random_adapter("ok", 0, rank=8), spec, CONFIG)
    with pytest.raises(LoraError) as e:
        validate(random_adapter("sql", 0, rank=16), spec, CONFIG)
    assert str(e.value) == "adapter 'sql': r = 16 exceeds the bundle's max_rank 8 (compile.lora.max_rank)"
    with pytest.raises(LoraError) as e:
        validate(random_adapter("x", 0, targets=("q_proj", "up_proj")), lora_section(targets=("q_proj", "v_proj")),
                 CONFIG)
    assert str(e.value) == ("adapter 'x': targets up_proj, which the bundle was not compiled for "
                            "(compile.lora.target_modules: q_proj, v_proj)")
    with pytest.raises(LoraError, match=r"adapter 'deep': layers.2.mlp.down_proj: the base model has 2 layers"):
        validate(random_adapter("deep", 0, targets=("down_proj",), layers=range(3)), spec, CONFIG)
    rng = np.random.default_rng(0)
    wrong_b = make_adapter("x", Path("/x"), {(1, "q_proj"): (rng.standard_normal((8, 64)),
                                                             rng.standard_normal((48, 8)))})
    with pytest.raises(LoraError) as e:
        validate(wrong_b, spec, CONFIG)
    assert str(e.value) == ("adapter 'x': layers.1.self_attn.q_proj lora_B is [48, 8], the base model's q_proj has "
                            "64 outputs (wrong base model?)")
    wrong_a = make_adapter("y", Path("/y"), {(0, "down_proj"): (rng.standard_normal((4, 64)),
                                                                rng.standard_normal((64, 4)))})
    with pytest.raises(LoraError, match=r"layers.0.mlp.down_proj lora_A is \[4, 64\], the base model's down_proj has "
                                        r"128 inputs"):
        validate(wrong_a, spec, CONFIG)


# --- the slot pools ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fused", [True, False])
def test_write_slot_layout(fused: bool) -> None:
    spec = lora_section(max_loras=3, max_rank=8, targets=("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj"),
                        fused=fused)
    pools = zero_pools(spec)
    adapter = random_adapter("a", 1, rank=4, targets=("q_proj", "v_proj", "up_proj"))
    write_slot(pools, spec, 2, adapter)
    big_r, x = spec.max_rank, np.random.default_rng(2).standard_normal(64).astype(np.float32)
    for proj in spec.projections:
        a_pool, b_pool = pools[pool_a(proj.layer, proj.name)], pools[pool_b(proj.layer, proj.name)]
        assert not a_pool[[0, 1, 3]].any() and not b_pool[[0, 1, 3]].any()  # only slot 2 written
        expect_a, expect_b = np.zeros_like(a_pool[2]), np.zeros_like(b_pool[2])
        term = np.zeros(proj.out_features, np.float32)
        for p, part in enumerate(proj.parts):
            if (proj.layer, part.target) in adapter.weights:
                a, b = adapter.weights[(proj.layer, part.target)]
                expect_a[p * big_r:p * big_r + 4] = a
                expect_b[part.start:part.stop, p * big_r:p * big_r + 4] = b
                term[part.start:part.stop] = b @ (a @ x[:proj.in_features])
        np.testing.assert_array_equal(a_pool[2], expect_a)
        np.testing.assert_array_equal(b_pool[2], expect_b)
        # the graph's term: B[slot] · (A[slot] · x) puts each module's delta in its own columns, nothing elsewhere
        np.testing.assert_allclose(b_pool[2] @ (a_pool[2] @ x[:proj.in_features]), term, rtol=1e-5, atol=1e-5)
    smaller = random_adapter("b", 3, rank=2, targets=("o_proj",))
    write_slot(pools, spec, 2, smaller)  # the rest of the slot is cleared first
    for proj in spec.projections:
        a_pool = pools[pool_a(proj.layer, proj.name)]
        assert a_pool[2].any() == (proj.name == "o"), proj.name
    write_slot(pools, spec, 2, None)
    assert not any(p.any() for p in pools.values())
    for slot in (0, 4):
        with pytest.raises(LoraError, match=rf"LoRA slot {slot}: adapters live in slots 1 … 3"):
            write_slot(pools, spec, slot, adapter)


def acquire(slots: LoraRegistry, pools: dict[str, np.ndarray], rid: str, name: str) -> int | None:
    """Pin ``name`` for ``rid`` and carry out the load it needs (what the scheduler's plan and run_plan do)."""
    pinned = slots.acquire(rid, name)
    if pinned is None:
        return None
    if pinned.load is not None:
        pinned.load.apply(pools)
    return pinned.slot


def test_slots_acquire_release_lru() -> None:
    spec = lora_section(max_loras=3)
    pools = zero_pools(spec)
    slots = LoraRegistry(spec, CONFIG, max_loras=2)
    for i, name in enumerate("abc"):
        slots.register(random_adapter(name, i))
    assert slots.names() == ("a", "b", "c") and slots.get("b").name == "b"
    q0 = pool_a(0, "qkv")
    assert acquire(slots, pools, "r1", "a") == 1 and acquire(slots, pools, "r2", "b") == 2
    assert acquire(slots, pools, "r3", "a") == 1
    assert slots.pinned("a") == 2 and slots.loads == 2
    np.testing.assert_array_equal(pools[q0][1, :4], slots.get("a").weights[(0, "q_proj")][0])
    assert slots.acquire("r4", "c") is None and slots.slot_of("c") is None  # every slot pinned by others
    slots.release("r1")
    assert slots.acquire("r4", "c") is None  # a still pinned once
    slots.release("r3")
    assert acquire(slots, pools, "r4", "c") == 1 and slots.evictions == 1 and slots.slot_of("a") is None
    np.testing.assert_array_equal(pools[q0][1, :4], slots.get("c").weights[(0, "q_proj")][0])
    assert not pools[q0][3].any()  # the bundle's third slot is beyond --max-loras 2: never used
    slots.release("r2"), slots.release("r4")
    pinned = slots.acquire("r5", "b")
    assert pinned is not None and pinned.slot == 2 and pinned.load is None  # resident: no load
    slots.release("r5")
    assert slots.loads == 3
    assert acquire(slots, pools, "r6", "a") == 1  # c (acquired before the last acquire of b) is the least recently used
    assert slots.slot_of("c") is None and slots.slot_of("b") == 2 and slots.evictions == 2
    assert not pools[q0][0].any()  # slot 0 never written


def test_slots_register_unregister_errors() -> None:
    spec = lora_section(max_loras=2, max_rank=8)
    pools = zero_pools(spec)
    with pytest.raises(LoraError, match="--max-loras 3: the bundle has 2 adapter slots"):
        LoraRegistry(spec, CONFIG, max_loras=3)
    slots = LoraRegistry(spec, CONFIG)
    slots.register(random_adapter("a", 0))
    with pytest.raises(LoraError, match="adapter 'a' is already loaded"):
        slots.register(random_adapter("a", 1))
    with pytest.raises(LoraError, match="r = 16 exceeds the bundle's max_rank 8"):
        slots.register(random_adapter("big", 0, rank=16))
    with pytest.raises(UnknownLora, match=r"the LoRA adapter 'zz' is not loaded \(loaded: a\)"):
        slots.use("zz", 1)
    slots.release("nobody")  # idempotent: no pin, nothing to drop
    slot = acquire(slots, pools, "r1", "a")
    with pytest.raises(LoraInUse) as e:
        slots.unregister("a")
    assert str(e.value) == "the LoRA adapter 'a' is in use by 1 sequence(s); unload it once they end"
    slots.release("r1")
    slots.use("a", 2)
    with pytest.raises(LoraInUse, match="in use by 2 sequence"):
        slots.unregister("a")
    slots.done("a", 2)
    assert pools[pool_b(1, "down")][slot].any()
    slots.unregister("a")
    assert slots.names() == () and slots.slot_of("a") is None  # the slot is free (its weights stay until reused)
