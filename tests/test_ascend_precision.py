"""The ascend target's weight precisions (``compile.weights: float16`` and ``int8`` = W8A16; passes/float16.py,
passes/ascend/w8a16.py): the graph ATC receives, the ATC command, and the numbers — the plain-op twin of each
step graph runs on onnxruntime's float16 kernels through the FAKE pyACL (tests/fake_acl.py) beside the float32
ort bundle. W8A16 per SoC (reference ascend.md §5.1): Atlas A2/A3 per channel (the default) or per group, 310P,
310B and every other SoC refused when the recipe loads. Nothing here has run on an NPU; the plugin graph's node
is checked against the reference's input order, not against CANN."""

from __future__ import annotations

import json
from pathlib import Path

import fake_atc
import numpy as np
import onnx
import pytest

from fake_acl import FakeAcl
from helpers import TINY_RECIPE, compile_bundle
from omforge.contract import cdiv
from omforge.passes.ascend.w8a16 import OP, PER_GROUP_CANN_NOTE, quantize_kn
from omforge.recipe import RecipeError, load_recipe


def precision_recipe(root: Path, weights: str, name: str | None = None, **compile: object) -> Path:
    import yaml

    data = yaml.safe_load(TINY_RECIPE.read_text())
    data["compile"] = {**data.get("compile", {}), "target": "ascend", "weights": weights, **compile}
    path = root / f"tiny-{name or weights}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def plain_twin(bundle: Path, recipe: Path, out: Path) -> Path:
    from omforge.compile.ascend.stages import lower_step_graph

    manifest = json.loads((bundle / "manifest.json").read_text())
    out.mkdir(parents=True, exist_ok=True)
    lower_step_graph(Path(manifest["export"]["dir"]), out, load_recipe(recipe), manifest["kv"]["block_size"],
                     plain=True)
    return out / "step.onnx"


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """ort float32, ascend float16 and ascend int8 bundles of the tiny model (FAKE OMs on the plain twins): int8
    per channel (the default, on the default soc_version Ascend910B3) and per group of 32 (on an A3 SoC)."""
    root = tmp_path_factory.mktemp("ascend-precision")
    cache = root / "cache"
    out = {"ort": compile_bundle(TINY_RECIPE, root / "ort", cache)}
    for name, weights, extra in (("float16", "float16", {}), ("int8", "int8", {}),
                                 ("int8-g32", "int8", {"quantization": {"group_size": 32},
                                                       "soc_version": "Ascend910_9391"})):
        recipe = precision_recipe(root, weights, name, **extra)
        bundle = compile_bundle(recipe, root / name, cache, target="ascend")
        fake_atc.build_bundle(bundle, plain_twin(bundle, recipe, root / f"plain-{name}"))
        out[name] = bundle
    return out


PROMPTS = [[5, 9, 2, 77], list(range(3, 43)), [int(x) for x in np.random.default_rng(1).integers(3, 250, 100)]]


@pytest.mark.parametrize("weights", ["float16", "int8", "int8-g32"])
def test_fp16_graph_on_the_fake_acl_tracks_the_float32_model(bundles: dict[str, Path], weights: str) -> None:
    """Teacher-forced on the float32 model's greedy tokens, the float16 / W8A16 (per channel, per group) graph's
    log-probabilities of those tokens stay close, and the first greedy token agrees on every prompt."""
    from omforge import LLM, SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)
    ref = LLM(bundles["ort"]).generate(PROMPTS, greedy, use_tqdm=False)
    got = LLM(bundles[weights], acl_module=FakeAcl()).generate(PROMPTS, greedy, use_tqdm=False)
    for r, g in zip(ref, got):
        assert g.token_ids[0] == r.token_ids[0]
        same = next((i for i, (a, b) in enumerate(zip(r.token_ids, g.token_ids)) if a != b), len(r.token_ids))
        drift = np.abs(np.array([e.logprob for e in r.logprobs[:same]])
                       - np.array([e.logprob for e in g.logprobs[:same]]))
        assert drift.max() < (0.02 if weights == "float16" else 0.15), drift
    manifest = json.loads((bundles[weights] / "manifest.json").read_text())
    assert manifest["kv"]["dtype"] == "float16"
    assert manifest["ascend"]["precision_mode"] == "must_keep_origin_dtype"


def test_fp16_graph_keeps_float32_islands_and_float32_logits(bundles: dict[str, Path]) -> None:
    proto = onnx.load(str(bundles["float16"] / "ascend" / "step.onnx"), load_external_data=False)
    f16, f32 = onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT
    inputs = {v.name: v.type.tensor_type.elem_type for v in proto.graph.input}
    outputs = {v.name: v.type.tensor_type.elem_type for v in proto.graph.output}
    # 910B float16: the in-place mode (per-layer pools, no kv_new output)
    assert inputs["key_cache.0"] == inputs["value_cache.0"] == f16 and "kv_new" not in outputs
    assert outputs["logits"] == f32
    assert {i.data_type for i in proto.graph.initializer if i.data_type in (f16, f32)} == {f16, f32}
    big = [i for i in proto.graph.initializer if np.prod(i.dims) >= 64 * 64 and i.data_type != onnx.TensorProto.BOOL]
    # (FIA's compressed causal mask [2048, 2048] is bool)
    assert big and all(i.data_type == f16 for i in big)  # every weight matrix is float16
    producer = {o: n for n in proto.graph.node for o in n.output}

    def cast_to_f32(name: str) -> bool:
        node = producer.get(name)
        return node is not None and node.op_type == "Cast" and node.attribute[0].i == f32

    # float32 islands (onnxsim keeps their Casts): softmax, RMSNorm's x² statistics, the rotary angles
    # the bundle's norms and attention are plugin ops (FIA computes its softmax inside); the plain twin decomposes them
    plain = onnx.load(str(bundles["float16"].parent / "plain-float16" / "step.onnx"), load_external_data=False)
    producer.update({o: n for n in plain.graph.node for o in n.output})
    softmax = [n for n in plain.graph.node if n.op_type == "Softmax"]
    assert len(softmax) == 2 and all(cast_to_f32(n.input[0]) for n in softmax)
    means = {n.input[0] for n in plain.graph.node if n.op_type == "ReduceMean"}
    squares = [n for n in plain.graph.node if n.op_type == "Pow" and n.output[0] in means]  # not Pow(·, 0.5)
    assert len(squares) == 5 and all(cast_to_f32(n.input[0]) for n in squares)
    trig = [n for n in proto.graph.node if n.op_type in ("Cos", "Sin")]
    assert trig and all(n.op_type != "Cast" or n.attribute[0].i == f16 for n in proto.graph.node
                        if any(t.output[0] in n.input for t in trig))
    cmd = (bundles["float16"] / "ascend" / "atc_commands.txt").read_text()
    assert "--precision_mode=must_keep_origin_dtype" in cmd


@pytest.mark.parametrize(("name", "group"), [("int8", 0), ("int8-g32", 32)])
def test_w8a16_lowers_matmuls_to_weight_quant_batch_matmul(bundles: dict[str, Path], name: str, group: int) -> None:
    """Atlas A2/A3: ND int8 [k, n] weights; per channel (the default) float16 scales [1, n] with
    antiquant_group_size 0, per group [⌈k/g⌉, n] with g — and the manifest says which CANN takes per group."""
    proto = onnx.load(str(bundles[name] / "ascend" / "step.onnx"), load_external_data=False)
    nodes = [n for n in proto.graph.node if n.op_type == OP]
    init = {i.name: i for i in proto.graph.initializer}
    # tiny: 2 layers × (qkv, o, gate_up, down) + the lm_head (vocab 256 ≤ 65535)
    assert len(nodes) == 9 and not [n for n in proto.graph.node if n.op_type == "MatMul"
                                    and n.input[1] in init and init[n.input[1]].data_type == onnx.TensorProto.FLOAT16]
    for n in nodes:
        weight, scale = init[n.input[1]], init[n.input[2]]
        assert weight.data_type == onnx.TensorProto.INT8 and scale.data_type == onnx.TensorProto.FLOAT16
        groups = cdiv(weight.dims[0], group) if group else 1
        assert list(scale.dims) == [groups, weight.dims[1]]  # [⌈k/g⌉, n]; per channel [1, n]
        assert {a.name: a.i for a in n.attribute} == {"antiquant_group_size": group}
        assert list(n.input[3:]) in ([], ["", "", "", ""])
    assert len(proto.opset_import) == 1
    cmd = (bundles[name] / "ascend" / "atc_commands.txt").read_text()
    assert "--precision_mode=must_keep_origin_dtype" in cmd and (bundles[name] / "ascend" / "build.sh").is_file()
    weights = json.loads((bundles[name] / "manifest.json").read_text())["weights"]
    assert {q["group"] for q in weights["quantized"].values()} == {group}
    note = weights["w8a16"]
    assert note["antiquant"].startswith("per channel" if group == 0 else f"per group of {group}")
    if group:
        assert note["cann"] == PER_GROUP_CANN_NOTE and "[unverified]" in note["cann"]
    else:
        assert "every CANN" in note["cann"]


def test_quantize_kn_round_trips_within_half_a_step() -> None:
    w = np.random.default_rng(0).standard_normal((100, 48)).astype(np.float32)
    codes, scales = quantize_kn(w, 32)
    assert codes.dtype == np.int8 and scales.shape == (4, 48) and scales.dtype == np.float16
    back = codes.astype(np.float32) * np.repeat(scales.astype(np.float32), 32, axis=0)[:100]
    assert np.all(np.abs(back - w) <= 0.5 * np.repeat(scales.astype(np.float32), 32, axis=0)[:100] * 1.01 + 1e-3)


def test_quantize_kn_per_channel_is_one_scale_per_column() -> None:
    """group 0: scales [1, n] (aclnnWeightQuantBatchMatmulV2's per-channel shape), codes within half a step."""
    w = np.random.default_rng(0).standard_normal((100, 48)).astype(np.float32)
    codes, scales = quantize_kn(w, 0)
    assert codes.shape == (100, 48) and scales.shape == (1, 48) and scales.dtype == np.float16
    s32 = scales.astype(np.float32)
    assert np.allclose(s32[0], (np.abs(w).max(axis=0) / 127).astype(np.float16).astype(np.float32))
    assert np.all(np.abs(codes.astype(np.float32) * s32 - w) <= 0.5 * s32 * 1.01 + 1e-3)
    assert np.abs(codes).max() == 127


@pytest.mark.parametrize("soc", ["Ascend910B1", "Ascend910B4", "Ascend910_9391", "Ascend910_9372"])
def test_w8a16_accepted_on_atlas_a2_a3(tmp_path: Path, soc: str) -> None:
    recipe = load_recipe(precision_recipe(tmp_path, "int8", soc_version=soc))
    assert recipe.compile.quantization.group_size == 0  # per channel unless the recipe asks for groups
    grouped = load_recipe(precision_recipe(tmp_path, "int8", "g64", soc_version=soc, quantization={"group_size": 64}))
    assert grouped.compile.quantization.group_size == 64


@pytest.mark.parametrize(("soc", "message"), [
    ("Ascend310P3", r"compile\.weights: W8A16 is not built for soc_version Ascend310P3 \(Atlas 300I/310P\): .*"
                    r"FRACTAL_NZ int8 weights with transpose_weight true, per-channel scales and group size 0.*"
                    r"use weights: float16"),
    ("Ascend310P1", r"compile\.weights: .*Ascend310P1 .*does not build NZ weights"),
    ("Ascend310B1", r"compile\.weights: W8A16 is not built for soc_version Ascend310B1 \(Atlas 200I/500 A2\): "
                    r"WeightQuantBatchMatmulV2 is not supported there"),
    ("Ascend910A", r"compile\.weights: W8A16 is not built for soc_version Ascend910A: .*lists only Atlas A2/A3"),
    ("Ascend910ProB", r"compile\.weights: .*soc_version Ascend910ProB: .*lists only"),
    ("Ascend310", r"compile\.weights: .*soc_version Ascend310: "),
])
def test_w8a16_refused_per_soc_with_a_reason(tmp_path: Path, soc: str, message: str) -> None:
    """310P needs NZ weights we do not build, 310B has no such op, any other SoC is not in the op's list: one
    line naming the file, the key, the SoC and the reason — per channel or per group alike."""
    for name, extra in (("c", {}), ("g", {"quantization": {"group_size": 32}})):
        path = precision_recipe(tmp_path, "int8", name, soc_version=soc, **extra)
        with pytest.raises(RecipeError, match=message) as err:
            load_recipe(path)
        assert str(err.value).startswith(f"{path}: compile.weights: ") and "\n" not in str(err.value)


def test_float_on_a_310p_is_still_built(tmp_path: Path) -> None:
    assert load_recipe(precision_recipe(tmp_path, "float16", soc_version="Ascend310P3")).compile.weights == "float16"


def test_per_channel_group_is_refused_off_ascend_int8(tmp_path: Path) -> None:
    path = precision_recipe(tmp_path, "int8", target="ort", quantization={"group_size": 0})
    with pytest.raises(RecipeError, match=r"compile\.quantization: group_size 0 .* is for ascend int8 weights"):
        load_recipe(path)


@pytest.mark.parametrize(("weights", "extra", "message"), [
    ("int4", {}, "int4 weights on ascend"),
    ("float16", {"precision_mode": "allow_fp32_to_fp16"}, "must_keep_origin_dtype"),
    ("bfloat16", {}, "bfloat16 weights are built for the ort target"),
])
def test_ascend_precisions_refused_with_a_reason(tmp_path: Path, weights: str, extra: dict, message: str) -> None:
    with pytest.raises(RecipeError, match=message):
        load_recipe(precision_recipe(tmp_path, weights, **extra))


def test_float16_on_ort_is_refused(tmp_path: Path) -> None:
    path = precision_recipe(tmp_path, "float16", target="ort")
    with pytest.raises(RecipeError, match="float16 weights are built for the ascend target"):
        load_recipe(path)

