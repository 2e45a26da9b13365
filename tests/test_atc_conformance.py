"""CANN's rules over what we hand ATC (compile/ascend/atc_conformance.py), the FAKE atc that enforces them
(tests/fake_atc.py), ``omforge inspect`` on an ascend bundle, and SmolLM2's ascend bundle end to end on the FAKE
pyACL. Each of issue 20's three defects has a test here or in test_acl_executor.py that fails on the code before it:
the fusion switch file with an ``omforge`` key, every pool listed in ``--input_shape`` (190 dims for SmolLM2), bare
output names. Nothing here has run on an NPU or against a real ATC."""

from __future__ import annotations

import hashlib
import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import fake_atc
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from fake_acl import FakeAcl
from helpers import SMOLLM2_RECIPE, TINY_RECIPE, compile_bundle
from omforge.compile.ascend.atc_conformance import RULES, check_command

STEP = {"input_ids": [1, "T"], "position_ids": [1, "T"], "block_tables": ["B", "M"], "query_index": ["B", "Q"],
        "token_index": ["T"], "logits_indices": ["L"]}


def step_like(path: Path, pools: int, opsets: list[tuple[str, int]] | None = None) -> Path:
    """A graph with the step inputs and ``pools`` static pool inputs ``[65536, 3, 64]`` (SmolLM2's per-layer pools
    before issue 20: 2 × 30)."""
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT64, d) for n, d in STEP.items()]
    inputs += [helper.make_tensor_value_info(f"pool.{i}", TensorProto.FLOAT, [65536, 3, 64]) for i in range(pools)]
    graph = helper.make_graph([helper.make_node("Cast", ["input_ids"], ["y"], to=TensorProto.INT64)], "g", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.INT64, [1, "T"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets or [("", 18)]])
    onnx.save(model, str(path))
    return path


def argv(model: str, shape: str, gears: str, *extra: str) -> list[str]:
    return ["atc", f"--model={model}", "--framework=5", "--output=om/step", "--soc_version=Ascend910B3",
            "--input_format=ND", f"--input_shape={shape}", f"--dynamic_dims={gears}", "--precision_mode=force_fp16",
            "--log=error", *extra]


STEP_SHAPE = "input_ids:1,-1;position_ids:1,-1;block_tables:-1,-1;query_index:-1,-1;token_index:-1;logits_indices:-1"
GEARS = "1,1,1,4,1,1,1,1;128,128,1,4,1,128,128,1"


def broken(results: list) -> dict[str, str]:
    return {r.rule: r.detail for r in results if not r.ok}


def test_only_the_dynamic_inputs_need_listing_and_pools_break_the_dim_cap(tmp_path: Path) -> None:
    """Defect 2: listing SmolLM2's 60 static pools makes 190 dims per gear (> 128, ACL_MAX_DIM_CNT); only the
    inputs with dynamic dims must be listed (hicann/ge CheckAndParseDynamicData)."""
    step_like(tmp_path / "m.onnx", pools=60)
    assert broken(check_command(argv("m.onnx", STEP_SHAPE, GEARS), tmp_path)) == {}
    pools = ";".join(f"pool.{i}:65536,3,64" for i in range(60))
    bad = broken(check_command(argv("m.onnx", f"{STEP_SHAPE};{pools}", GEARS), tmp_path))
    assert list(bad) == ["dims of the listed inputs <= 128"] and "190 dims" in next(iter(bad.values()))
    missing = broken(check_command(argv("m.onnx", STEP_SHAPE.replace(";logits_indices:-1", ""),
                                        "1,1,1,4,1,1,1;128,128,1,4,1,128,128"), tmp_path))
    assert "every input with a dynamic dim is listed, static sizes agree" in missing
    assert "logits_indices" in missing["every input with a dynamic dim is listed, static sizes agree"]


def test_fusion_switch_files_take_only_switch_and_priority(tmp_path: Path) -> None:
    """Defect 1: GE's fusion_config_parser.cc rejects any first-level key other than Switch / Priority."""
    step_like(tmp_path / "m.onnx", pools=0)
    old = {"Switch": {"GraphFusion": {"ALL": "on"}, "UBFusion": {"ALL": "on"}}, "omforge": {"fusions": {}}}
    (tmp_path / "old.cfg").write_text(json.dumps(old))
    (tmp_path / "ok.cfg").write_text(json.dumps({"Switch": {"GraphFusion": {"SomePass": "off"}}}))
    (tmp_path / "lines.cfg").write_text("SomePass:off\nOther:on\n")
    rule = "fusion switch file: only Switch / Priority"
    assert "['omforge']" in broken(check_command(argv("m.onnx", STEP_SHAPE, GEARS, "--fusion_switch_file=old.cfg"),
                                                 tmp_path))[rule]
    for ok in ("ok.cfg", "lines.cfg"):
        assert broken(check_command(argv("m.onnx", STEP_SHAPE, GEARS, f"--fusion_switch_file={ok}"), tmp_path)) == {}


@pytest.mark.parametrize(("change", "rule"), [
    (lambda a: [*a[:7], "--dynamic_dims=1,1,1,4,1,1,1,1", *a[8:]], "2..100 gears, one value per -1"),
    (lambda a: [*a[:7], "--dynamic_dims=" + ";".join(f"{i},{i},1,4,1,1,{i},1" for i in range(1, 102)), *a[8:]],
     "2..100 gears, one value per -1"),
    (lambda a: [*a[:7], "--dynamic_dims=1,1,1,4,1,1,1;2,2,2,4,2,1,2", *a[8:]], "2..100 gears, one value per -1"),
    (lambda a: [a[0], a[1], "--framework=1", *a[3:]], "--framework=5 for ONNX (none for the RefData builder)"),
    (lambda a: [*a[:3], "--output=om/step.om", *a[4:]], "--output is a prefix (the .om may gain _<os>_<cpu>)"),
    (lambda a: [*a, "--dynamic_batch_size=1,2"], "2..100 gears, one value per -1"),
    (lambda a: [*a[:5], "--input_format=NCHW", *a[6:]], "2..100 gears, one value per -1"),
    (lambda a: [*a[:8], "--precision_mode=fp16", *a[9:]], "--precision_mode is documented"),
])
def test_each_rule_refuses_what_atc_refuses(tmp_path: Path, change, rule: str) -> None:  # noqa: ANN001
    step_like(tmp_path / "m.onnx", pools=0)
    assert rule in broken(check_command(change(argv("m.onnx", STEP_SHAPE, GEARS)), tmp_path))


def test_the_onnx_parser_takes_one_opset_import_up_to_18(tmp_path: Path) -> None:
    step_like(tmp_path / "two.onnx", 0, [("", 18), ("com.microsoft", 1)])
    step_like(tmp_path / "new.onnx", 0, [("", 19)])
    assert "one opset_import" in broken(check_command(argv("two.onnx", STEP_SHAPE, GEARS), tmp_path))
    assert "default-domain opset <= 18" in broken(check_command(argv("new.onnx", STEP_SHAPE, GEARS), tmp_path))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("conformance")
    return compile_bundle(TINY_RECIPE, root / "asc", root / "cache", target="ascend")


def test_inspect_runs_the_rules_over_an_ascend_bundle(tiny: Path, tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "omforge", "inspect", str(tiny)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "ATC conformance of --output=om/step" in r.stdout and "FAIL" not in r.stdout
    assert r.stdout.count("\n    ok   ") == len(RULES) and "hicann/ge fusion_config_parser.cc" in r.stdout
    assert "device mem weights" in r.stdout and "load       acl.mdl.load_with_config" in r.stdout
    rows = r.stdout.split("CANN matrix rows the step graph relies on (")[1]  # item 8: the rows, each with its file
    assert "ai.onnx::" in rows and "::Gather" in rows and "::OmRmsNorm" in rows and "hicann/" in rows
    (tiny / "ascend" / "extra.cfg").write_text(json.dumps({"Switch": {}, "omforge": {}}))
    line = (tiny / "ascend" / "atc_commands.txt").read_text().strip()
    bundle = tmp_path / "edited"
    shutil.copytree(tiny, bundle)
    commands = bundle / "ascend" / "atc_commands.txt"
    commands.write_text(line + " --fusion_switch_file=extra.cfg\n")  # a hand-edited bundle, its manifest updated
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["files"]["ascend/atc_commands.txt"] = {"size": commands.stat().st_size,
                                                    "sha256": hashlib.sha256(commands.read_bytes()).hexdigest()}
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    r = subprocess.run([sys.executable, "-m", "omforge", "inspect", str(bundle), "--json"], capture_output=True,
                       text=True)
    assert r.returncode == 1, r.stderr
    data = json.loads(r.stdout)
    assert data["cann_matrix"]["rows"] and data["cann_matrix"]["outside"] == []
    failed = [x for x in data["atc_conformance"]["om/step"] if not x["ok"]]
    # the tiny bundle is in place (float16, 910B): its command is the RefData builder's, which maps no
    # --fusion_switch_file to an IR build option, so that rule fails beside the switch file's own
    assert [x["rule"] for x in failed] == ["every RefData builder flag is an IR build option",
                                           "fusion switch file: only Switch / Priority"]


def test_the_fake_atc_refuses_a_broken_command_and_names_the_om_as_atc_may(tiny: Path, tmp_path: Path) -> None:
    twin = tiny / "ascend" / "step.onnx"  # same interface as itself (the fake only needs a readable twin here)
    line = (tiny / "ascend" / "atc_commands.txt").read_text().strip()
    args = shlex.split(line)
    om = fake_atc.run(args, tiny / "ascend", twin)
    assert om.name == "step_linux_x86_64.om"
    om.unlink()
    with pytest.raises(fake_atc.FakeAtcError, match="dims of the listed inputs"):
        pool = "kv_cache:" + ",".join(str(d) for d in json.loads((tiny / "manifest.json").read_text())["abi"][
            "inputs"][-1]["shape"])
        fake_atc.run([a + (";" + pool) * 30 if a.startswith("--input_shape=") else a for a in args],
                     tiny / "ascend", twin)


def test_smollm2_ascend_bundle_conforms_and_matches_the_ort_engine_on_the_fakes(
        smollm2_cache: Path, smollm2_export: Path, smollm2_bundle: Path, tmp_path: Path) -> None:
    """Issue 20 acceptance: SmolLM2's ascend bundle (30 layers) passes every rule (13 gear dims in place: the 10 of
    the gather step plus slot_mapping and the two actual lengths; 190 before issue 20), loads on the FAKE pyACL
    (CANN-form names, the 128 cap) and generates the ORT engine's greedy tokens. Issue 60 acceptance: the bundle is
    the in-place one (float16 on Ascend910B3), its pools written through RefData on the fake."""
    from omforge import LLM, SamplingParams
    from omforge.compile.ascend.atc_conformance import check_bundle
    from omforge.compile.ascend.stages import lower_step_graph
    from omforge.recipe import load_recipe, retarget

    # a pool of 24 blocks, not the recipe's 1,024: every step copies every in-place pool through the FAKE pyACL
    # (60 of them), and the pool's size is no part of what this checks
    small_pool = tmp_path / "smollm2-small-pool.yaml"
    small_pool.write_text(SMOLLM2_RECIPE.read_text().replace("serve:\n", "serve:\n  num_kv_blocks: 24\n", 1))
    asc = compile_bundle(small_pool, tmp_path / "asc", smollm2_cache, target="ascend")
    results = check_bundle(asc)["om/step"]
    assert all(r.ok for r in results), [r.line() for r in results if not r.ok]
    manifest = json.loads((asc / "manifest.json").read_text())
    assert manifest["ascend"]["paged_attention"] == "inplace"
    assert sum(len(d) for _, d in manifest["ascend"]["input_shape"]) == 13
    recipe = retarget(load_recipe(small_pool), "ascend")
    lower_step_graph(smollm2_export, tmp_path, recipe, manifest["kv"]["block_size"], plain=True)
    fake_atc.build_bundle(asc, tmp_path / "step.onnx")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [[1, 9690, 314, 260, 2], list(np.random.default_rng(5).integers(100, 40000, 150))]
    fake = FakeAcl()
    on_acl = LLM(asc, acl_module=fake).generate([[int(t) for t in p] for p in prompts], params, use_tqdm=False)
    on_ort = LLM(smollm2_bundle).generate([[int(t) for t in p] for p in prompts], params, use_tqdm=False)
    assert [a.token_ids for a in on_acl] == [o.token_ids for o in on_ort]
    assert not [c for c in fake.calls if c.startswith("FAILED")] and not fake.lost_writes


KERNELS_RULE = "every op's kernel ships for --soc_version"


def _scatter_pa(path: Path) -> Path:
    """One OmScatterPaKvCache node (our plugin → GE ScatterPaKvCache), float16 pools, int32 slots."""
    f16 = [helper.make_tensor_value_info(n, TensorProto.FLOAT16, s) for n, s in
           (("key", [4, 1, 16]), ("key_cache", [8, 16, 1, 16]), ("value", [4, 1, 16]), ("value_cache", [8, 16, 1, 16]))]
    slots = helper.make_tensor_value_info("slot_mapping", TensorProto.INT32, [4])
    node = helper.make_node("OmScatterPaKvCache", ["key", "key_cache", "slot_mapping", "value", "value_cache"],
                            ["k_out", "v_out"], cache_mode="Norm")
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT16, None) for n in ("k_out", "v_out")]
    model = helper.make_model(helper.make_graph([node], "g", [*f16[:2], slots, *f16[2:]], outs),
                              opset_imports=[helper.make_opsetid("", 18)])
    onnx.save(model, str(path))
    return path


@pytest.mark.parametrize(("soc", "ships"), [("Ascend910B3", True), ("Ascend910_9392", True),
                                            ("Ascend310P3", False), ("Ascend310B1", False)])
def test_the_kernel_rule_refuses_an_op_whose_kernel_does_not_ship_for_the_soc(tmp_path: Path, soc: str,
                                                                             ships: bool) -> None:
    """ScatterPaKvCache's kernel ships for ascend910b / ascend910_93 only (passes/ascend/kernels.py KERNELS, its
    op_host def.cpp AddConfig lines): the same graph passes for 910B / 910_93 and is refused for 310P / 310B."""
    _scatter_pa(tmp_path / "m.onnx")
    cmd = ["atc", "--model=m.onnx", "--framework=5", "--output=om/step", f"--soc_version={soc}", "--log=error"]
    bad = broken(check_command(cmd, tmp_path))
    if ships:
        assert KERNELS_RULE not in bad
    else:
        assert "OmScatterPaKvCache → ScatterPaKvCache: no kernel ships for " + soc in bad[KERNELS_RULE]


def test_the_fake_atc_refuses_a_910b_bundle_built_for_a_soc_without_its_kernels(tiny: Path) -> None:
    """The tiny 910B bundle's own command passes; the same command with --soc_version=Ascend310B1 is refused by the
    FAKE atc: its RmsNorm / RotaryPositionEmbedding kernels do not ship for the 310B."""
    args = shlex.split((tiny / "ascend" / "atc_commands.txt").read_text().strip())
    assert "--soc_version=Ascend910B3" in args
    assert KERNELS_RULE not in broken(check_command(args, tiny / "ascend"))
    other = [("--soc_version=Ascend310B1" if a.startswith("--soc_version=") else a) for a in args]
    with pytest.raises(fake_atc.FakeAtcError, match="no kernel ships for Ascend310B1") as e:
        fake_atc.run(other, tiny / "ascend", tiny / "ascend" / "step.onnx")
    assert "RmsNorm" in str(e.value)
