"""``omforge.MoE`` on the ascend target (issue 62 item 3; passes/ascend/moe.py): CANN's MoE op chain on Atlas A2 / A3,
the plain MoE where a kernel of the chain does not ship (310P, 310B), both within the CANN conformance matrix, and
the tiny random Qwen3-MoE recipe (tests/recipes/tiny-qwen3-moe.yaml) through the FAKE atc and the FAKE pyACL giving
the ORT engine's greedy tokens. The FAKE pyACL runs the plain-op twin, whose MoE is each chain op's documented
formula in ONNX ops: it checks the wiring between the ops (row order, index maps, group list), not CANN's kernels.
Nothing here ran on an NPU or through a real ATC."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from moe_setup import moe_reference
from onnx import TensorProto, helper, numpy_helper

from omforge.compile.ascend import atc_forms, atc_plugins, cann_matrix
from omforge.compile.ascend.step_usage import uses
from omforge.passes.ascend import kernels as ascend_kernels
from omforge.passes.ascend import lower as lower_ascend
from omforge.passes.ascend import moe as ascend_moe
from omforge.passes.float16 import CastToFloat16

TESTS = Path(__file__).resolve().parent
RECIPE = TESTS / "recipes" / "tiny-qwen3-moe.yaml"
E, H, F, K, T = 8, 16, 12, 2, 9
CHAIN = ["OmMoeGatingTopKSoftmax", "OmMoeInitRouting", "OmMoeComputeExpertTokens", "Cast", "OmGroupedMatmul",
         "SwiGlu", "OmGroupedMatmul", "OmMoeFinalizeRoutingV2"]
"""The chain's nodes in graph order (the Cast: the int32 expert counts to GroupedMatmul's int64 group list)."""
MOE_OPS = {"OmMoeGatingTopKSoftmax", "OmMoeInitRouting", "OmMoeComputeExpertTokens", "OmGroupedMatmul",
           "OmMoeFinalizeRoutingV2"}


def _weights(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return ((rng.standard_normal((E, H, 2 * F)) * 0.3).astype(np.float32),
            (rng.standard_normal((E, F, H)) * 0.3).astype(np.float32))


def moe_model(normalize: int, top_k: int = K) -> ir.Model:
    """One hand-built ``omforge.MoE`` node: x [1, T, H], router logits [1, T, E] in, y out (the fused form
    passes/moe.py makes of the export)."""
    gate_up, down = _weights()
    node = helper.make_node("MoE", ["x", "logits", "gate_up", "down"], ["y"], domain="omforge", top_k=top_k,
                            normalize=normalize)
    graph = helper.make_graph(
        [node], "moe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "T", H]),
                        helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, "T", E])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "T", H])],
        [numpy_helper.from_array(gate_up, "gate_up"), numpy_helper.from_array(down, "down")])
    return ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                                  helper.make_opsetid("omforge", 1)]))


def feeds(seed: int = 1) -> dict[str, np.ndarray]:
    """Random inputs with ties the routing must break as torch.topk does (the lower expert index first): token 0
    has three equal largest logits (k = 2 takes experts 1 and 4), token 1 two equal at the k-th place."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((1, T, H)).astype(np.float32)
    logits = rng.standard_normal((1, T, E)).astype(np.float32)
    logits[0, 0, [1, 4, 6]] = 3.0
    logits[0, 1, 2], logits[0, 1, [5, 7]] = 4.0, 2.5
    return {"x": x, "logits": logits}


def run(model: ir.Model, inputs: dict[str, np.ndarray]) -> np.ndarray:
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, inputs)[0]


def atc_uses(model: ir.Model) -> set:
    """What ATC's parser would read of the lowered graph (Constants in the ``value`` form, as the compile writes)."""
    proto = ir.to_proto(model)
    atc_forms.constants_as_value(proto.graph)
    return uses(proto)


@pytest.mark.parametrize("soc", ["Ascend910B3", "Ascend910_9392"])
def test_the_chain_where_every_kernel_ships(soc: str) -> None:
    """Atlas A2 / A3: the MoE becomes CANN's op chain, in vllm-ascend's order, every op ours to map (no ONNX plugin
    of CANN's in a release source), GroupedMatmul and FinalizeRouting with each input at its GE IR index."""
    model = moe_model(normalize=1)
    result = lower_ascend.lower(model, soc_version=soc)
    assert result.kernel_fallbacks == {} and result.lowered == {"MoE": 1}
    chain = [n for n in model.graph if n.op_type in (*MOE_OPS, "SwiGlu") or
             n.op_type == "Cast" and n.inputs[0].producer().op_type == "OmMoeComputeExpertTokens"]
    assert [n.op_type for n in chain] == CHAIN
    assert MOE_OPS <= set(result.own_plugins) and result.own_kernels == []
    gating, init, tokens, _, gmm1, _, gmm2, final = chain
    assert gating.attributes["k"].value == K and init.attributes["active_num"].value == ascend_moe.ACTIVE_NUM
    assert tokens.attributes["num_experts"].value == E and final.attributes["drop_pad_mode"].value == 0
    for gmm, weight in ((gmm1, "gate_up"), (gmm2, "down")):
        names = [v.name if v is not None else "" for v in gmm.inputs]
        assert names[1] == weight and names[2:7] == [""] * 5 and len(names) == 8  # group_list at IR index 7
        assert gmm.inputs[7] is chain[3].outputs[0]
        assert {a: gmm.attributes[a].value for a in ("split_item", "group_type", "group_list_type")} == \
            {"split_item": 2, "group_type": 0, "group_list_type": 0}
    assert [v is None for v in final.inputs] == [False, False, True, True, True, False]  # scales at IR index 5
    assert final.inputs[1] is init.outputs[1] and gmm1.inputs[0] is init.outputs[0]
    assert init.inputs[1] is gating.outputs[2] and init.inputs[2] is gating.outputs[1]  # row_idx, expert_idx


@pytest.mark.parametrize("soc", ["Ascend310P3", "Ascend310B1"])
def test_the_plain_moe_where_a_kernel_does_not_ship(soc: str) -> None:
    """310P / 310B: no MoE kernel of the chain ships (kernels.py MOE_KERNELS): plain ops, with the reason recorded,
    and no TopK or ScatterElements (their CANN forms are not usable there: passes/ascend/moe.py)."""
    model = moe_model(normalize=0)
    result = lower_ascend.lower(model, soc_version=soc)
    assert result.kernel_fallbacks["MoE"].startswith("MoeGatingTopKSoftmax: no kernel ships for " + soc)
    ops = {n.op_type for n in model.graph}
    assert not ops & MOE_OPS and not ops & {"TopK", "ScatterElements", "Div", "Softmax"}
    assert {"Equal", "ReduceMax", "MatMul"} <= ops


@pytest.mark.parametrize("soc", ["Ascend910B3", "Ascend310P3", "Ascend310B1"])
@pytest.mark.parametrize("float16", [False, True], ids=["float32", "float16"])
def test_every_op_attribute_form_and_dtype_has_a_row(soc: str, float16: bool) -> None:
    """The chain and the plain MoE, float32 and float16 (the float16 pass after the lowering, as the compile runs
    it), hold nothing outside the CANN matrix, and every kernel they need ships for the SoC."""
    model = moe_model(normalize=1)
    lower_ascend.lower(model, soc_version=soc)
    if float16:
        CastToFloat16()(model)
    found = atc_uses(model)
    assert cann_matrix.violations(found) == []
    used = {op for row in cann_matrix.rows_for(found) for op in cann_matrix.ge_ops(row)}
    assert [op for op in used if op in ascend_kernels.KERNELS and not ascend_kernels.ships(op, soc)] == []
    assert ("MoeInitRouting" in used) == (soc == "Ascend910B3")


@pytest.mark.parametrize("normalize", [0, 1])
@pytest.mark.parametrize("soc", ["Ascend910B3", "Ascend310B1"])
def test_the_twin_and_the_plain_moe_compute_the_contract(normalize: int, soc: str) -> None:
    """``plain=True`` (the chain's twin on 910B, the plain MoE on 310B) against the float64 reference of the neutral
    op, ties included; and in float16 within float16's rounding."""
    gate_up, down = _weights()
    inputs = feeds()
    want = moe_reference(inputs["x"], inputs["logits"], gate_up, down, K, bool(normalize))
    model = moe_model(normalize)
    lower_ascend.lower(model, soc_version=soc, plain=True)
    assert not {n.op_type for n in model.graph} & (MOE_OPS | {"SwiGlu"})  # every op standard ONNX
    got = run(model, inputs)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)
    half = moe_model(normalize)
    lower_ascend.lower(half, soc_version=soc, plain=True)
    CastToFloat16()(half)
    got16 = run(half, {k: v.astype(np.float16) for k, v in inputs.items()})
    assert got16.dtype == np.float16
    np.testing.assert_allclose(got16.astype(np.float32), want, rtol=0, atol=2e-2)


def test_the_twin_fails_when_the_wiring_is_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    """The twin checks the wiring, it does not copy the reference: MoeGatingTopKSoftmax's row index in row order
    (``t·k + j``) instead of its documented column order (``j·T + t``) gives other outputs."""
    gate_up, down = _weights()
    inputs = feeds()
    want = moe_reference(inputs["x"], inputs["logits"], gate_up, down, K, True)
    real = ascend_moe.twin_gating

    def row_order(op, logits, **kwargs):  # noqa: ANN001, ANN202
        w, ids, _ = real(op, logits, **kwargs)
        return w, ids, op.Reshape(op.Range(op.Constant(value_int=0), op.Size(ids), op.Constant(value_int=1)),
                                  op.Shape(ids))

    monkeypatch.setattr(ascend_moe, "twin_gating", row_order)
    model = moe_model(normalize=1)
    lower_ascend.lower(model, soc_version="Ascend910B3", plain=True)
    assert float(np.abs(run(model, inputs) - want).max()) > 1e-2


def test_the_moe_plugins_parse_their_attributes(tmp_path: Path) -> None:
    """The lowering's own plugins for the chain render, compile against the stub CANN headers and (with a real
    nlohmann/json) copy each attribute to the GE op."""
    model = moe_model(normalize=1)
    lowering = lower_ascend.lower(model, soc_version="Ascend910B3").to_dict()
    lowering = json.loads(json.dumps(lowering))  # as the cached stage stores it
    project = atc_plugins.render_plugins(lowering, tmp_path / "plugins")
    assert project is not None
    names = {p.name for p in project.files}
    assert {"om_grouped_matmul_onnx_plugin.cc", "om_moe_init_routing_onnx_plugin.cc",
            "om_moe_finalize_routing_v2_onnx_plugin.cc"} <= names
    gmm = (tmp_path / "plugins" / "om_grouped_matmul_onnx_plugin.cc").read_text()
    assert 'REGISTER_CUSTOM_OP("GroupedMatmul")' in gmm and '"ai.onnx::18::OmGroupedMatmul"' in gmm
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ is not installed: rendered, not compiled")
    stubs = TESTS / "stubs"
    unity = tmp_path / "unity.h"
    unity.write_text("".join(f'#include "{p}"\n' for p in project.files if p.suffix == ".cc"))
    harness = tmp_path / "harness"
    built = subprocess.run([gxx, "-std=c++17", "-Wall", "-Wextra", "-Werror", "-I", str(stubs), "-I",
                            str(project.dir), f"-DOMFORGE_PLUGINS_UNITY=\"{unity}\"", str(stubs / "plugin_harness.cc"),
                            "-o", str(harness)], capture_output=True, text=True, check=False)
    if built.returncode != 0 and "nlohmann/json.hpp" in built.stderr:
        pytest.skip("needs a real nlohmann/json.hpp to run the parse functions")
    assert built.returncode == 0, built.stderr
    cases = {"OmMoeGatingTopKSoftmax": {"k": K}, "OmMoeInitRouting": {"active_num": ascend_moe.ACTIVE_NUM},
             "OmMoeComputeExpertTokens": {"num_experts": E}, "OmMoeFinalizeRoutingV2": {"drop_pad_mode": 0},
             "OmGroupedMatmul": {"split_item": 2, "group_type": 0, "group_list_type": 0}}
    for op_type, attrs in cases.items():
        text = json.dumps({"attribute": [{"name": n, "i": v, "type": 2} for n, v in attrs.items()]})
        out = subprocess.run([str(harness), f"ai.onnx::18::{op_type}", text], capture_output=True, text=True,
                             check=True).stdout.splitlines()
        assert "status 0" in out, (op_type, out)
        assert {ln.split(" ", 2)[1]: ln.split(" ", 2)[2] for ln in out if ln.startswith("int ")} == \
            {n: str(v) for n, v in attrs.items()}


# --- the tiny random Qwen3-MoE recipe, compiled -------------------------------------------------------------------

PROMPTS = [[int(t) for t in np.random.default_rng(n).integers(3, 256, n)] for n in (5, 17, 40)]
NEW = 12


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The recipe for ort (the reference engine) and for ascend on Atlas A2 (the chain) and 310B (the plain MoE),
    float32 weights (the FAKE pyACL's twin then computes what the ORT bundle does), one export for all."""
    from helpers import compile_bundle
    from omforge import LLM
    from omforge.runtime.sampling_params import SamplingParams

    root = tmp_path_factory.mktemp("moe-ascend")
    cache = root / "cache"
    out: dict = {"root": root, "cache": cache}
    out["ort"] = compile_bundle(RECIPE, root / "ort", cache, target="ort")
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    with LLM(out["ort"]) as llm:
        out["tokens"] = [o.token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    out["greedy"] = greedy
    for soc in ("Ascend910B3", "Ascend310B1"):
        recipe = root / f"{soc}.yaml"
        recipe.write_text(RECIPE.read_text().replace(
            "compile:\n", f"compile:\n  target: ascend\n  weights: float32\n  soc_version: {soc}\n"))
        out[soc] = compile_bundle(recipe, root / soc, cache, target="ascend")
        out[f"recipe-{soc}"] = recipe
    return out


def _generate_on_the_fakes(compiled: dict, soc: str) -> tuple[list[list[int]], Counter]:
    import fake_atc

    from fake_acl import FakeAcl
    from omforge import LLM
    from omforge.contract.manifest import load_manifest
    from omforge.recipe import load_recipe, retarget
    from omforge.verify import plain_twin

    asc = compiled[soc]
    manifest = load_manifest(asc, verify=False)
    twin = plain_twin(Path(manifest.export.dir), retarget(load_recipe(compiled[f"recipe-{soc}"]), "ascend"), manifest,
                      compiled["root"] / f"twin-{soc}")
    fake_atc.build_bundle(asc, twin)
    fake = FakeAcl()
    with LLM(asc, acl_module=fake) as llm:
        tokens = [o.token_ids for o in llm.generate(PROMPTS, compiled["greedy"], use_tqdm=False)]
    assert not [c for c in fake.calls if c.startswith("FAILED")]
    twin_ops = Counter(n.op_type for n in onnx.load(str(twin), load_external_data=False).graph.node)
    return tokens, twin_ops


@pytest.mark.parametrize("soc", ["Ascend910B3", "Ascend310B1"])
def test_the_recipe_passes_the_fake_atc_and_generates_the_ort_tokens(compiled: dict, soc: str) -> None:
    """The bundle's step graph holds the chain (Atlas A2: once per layer) or the plain MoE (310B), passes every ATC
    rule of compile/ascend/atc_conformance.py — every op, attribute form and dtype in the CANN matrix, every kernel
    shipping for the SoC — and through the FAKE atc and pyACL gives the ORT engine's greedy tokens."""
    from omforge.compile.ascend.atc_conformance import check_bundle

    asc = compiled[soc]
    assert [r.line() for r in check_bundle(asc)["om/step"] if not r.ok] == []
    rows, outside = cann_matrix.bundle_rows(asc)
    assert outside == []
    step = Counter(n.op_type for n in onnx.load(str(asc / "ascend" / "step.onnx"), load_external_data=False).graph.node)
    layers = 2
    if soc == "Ascend910B3":
        assert {op: step[op] for op in MOE_OPS} == {op: layers * (2 if op == "OmGroupedMatmul" else 1)
                                                    for op in MOE_OPS}
        assert {"OmMoeGatingTopKSoftmax", "OmGroupedMatmul"} <= {row.op_type for row in rows}
    else:
        assert not MOE_OPS & set(step) and "TopK" not in step
    tokens, twin = _generate_on_the_fakes(compiled, soc)
    assert tokens == compiled["tokens"]
    if soc == "Ascend910B3":  # the twin ran each chain op's formula (TopK: MoeGatingTopKSoftmax and the sort)
        assert twin["TopK"] == 2 * layers and twin["ScatterElements"] == layers
