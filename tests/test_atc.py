"""The ATC step (omforge.compile.ascend.atc): command lines against golden files, gear checks,
build.sh, and running ``atc`` — with a FAKE ``atc`` in one test only. The plugins: test_atc_plugins.py.

No CANN here: goldens were reviewed by hand against reference/ascend.md §1.1–1.5. Regenerate them with
``OMFORGE_UPDATE_GOLDEN=1`` and review the diff again.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from helpers import lowering_dict
from omforge.compile import bucket_plan as bucket_planner
from omforge.compile.ascend import atc, atc_plugins, build_script, refdata_build
from omforge.compile.ascend.atc import AtcError, AtcMissing, AtcModelSpec
from omforge.compile.ascend.atc_conformance import check_command
from omforge.contract.ascend import KV_POOL
from omforge.contract.buckets import STEP_DIMS, om_gears
from omforge.recipe import CompileSection

TESTS = Path(__file__).resolve().parent
GOLDEN = TESTS / "golden" / "atc"
STUBS = TESTS / "stubs"
UPDATE = os.environ.get("OMFORGE_UPDATE_GOLDEN") == "1"
GXX = shutil.which("g++")
REAL_JSON = next((d for d in (Path("/usr/include"), Path("/usr/local/include"))
                  if (d / "nlohmann" / "json.hpp").is_file()), None)
FAILED = 0xFFFFFFFF  # domi::FAILED


STEP_INPUTS: dict[str, list[int | str]] = {
    "input_ids": [1, "num_tokens"], "position_ids": [1, "num_tokens"], "block_tables": ["num_seqs", "max_blocks"],
    "query_index": ["num_seqs", "max_query_len"], "token_index": ["num_tokens"], "logits_indices": ["num_logits"]}
"""The ascend step graph's inputs with a dynamic dim, in graph order (passes/paged_kv.py ABI lowered for ascend:
no slot_mapping; the one pool ``kv_cache`` has a static shape and is not listed)."""


def om_spec(compile: CompileSection, block_size: int = 128) -> AtcModelSpec:
    """The one OM of a bundle: both profiles' gears (compile/bucket_plan.py) over the step dims."""
    plan = bucket_planner.plan(compile, target="ascend", block_size=block_size)
    return AtcModelSpec("step", Path("step.onnx"), STEP_INPUTS, list(om_gears(plan)), list(STEP_DIMS))


# name -> (compile section, [the OM's spec]): SmolLM2-135M, Llama-3-8B, Qwen2-0.5B shapes of compile sections
VARIANTS: dict[str, tuple[CompileSection, list[AtcModelSpec]]] = {}
for _name, _compile in {
    "smollm2-910b3": CompileSection(target="ascend", soc_version="Ascend910B3", weights="float32",
                                    precision_mode="allow_fp32_to_fp16"),
    "llama3-910b4": CompileSection(target="ascend", soc_version="Ascend910B4", weights="float32",
                                   precision_mode="force_fp32",
                                   max_seq_len=8192, max_num_tokens=4096, max_batch_size=32),
    "qwen2-310p3": CompileSection(target="ascend", soc_version="Ascend310P3", precision_mode="must_keep_origin_dtype",
                                  max_seq_len=1024, max_batch_size=8, fusions={"attention": False}),
}.items():
    VARIANTS[_name] = (_compile, [om_spec(_compile)])


def check_golden(path: Path, text: str) -> None:
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.is_file(), f"missing golden {path}; run with OMFORGE_UPDATE_GOLDEN=1 and review it"
    assert text == path.read_text(), f"{path.name} differs from the golden (OMFORGE_UPDATE_GOLDEN=1 to regenerate)"




# --- command lines ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_command_lines_match_golden(variant: str) -> None:
    compile, specs = VARIANTS[variant]
    commands = [atc.atc_command(spec, compile, Path("om")) for spec in specs]
    lines = [atc.render_command(c) for c in commands]
    check_golden(GOLDEN / f"{variant}.txt", "\n".join(lines) + "\n")

    for spec, argv, line in zip(specs, commands, lines, strict=True):
        assert shlex.split(line) == argv  # the shell line runs exactly this argv
        flags = [a.split("=", 1)[0] for a in argv[1:]]
        assert argv[0] == "atc" and flags == [
            "--model", "--framework", "--output", "--soc_version", "--input_format", "--input_shape",
            "--dynamic_dims", "--precision_mode", "--log"]  # no fusion switch file: nothing of CANN's is off
        args = dict(a.split("=", 1) for a in argv[1:])
        assert args["--framework"] == "5" and args["--input_format"] == "ND" and args["--log"] == "error"
        assert args["--soc_version"] == compile.soc_version and args["--precision_mode"] == compile.precision_mode
        assert args["--output"] == f"om/{spec.name}" and atc.output_prefix(argv) == Path(f"om/{spec.name}")
        assert "--out_nodes" not in flags  # the graph's own outputs are the model's (module docstring)
        # one value per -1, every gear; a dim shared by several inputs repeats its gear value (§1.3)
        minus_ones = args["--input_shape"].count("-1")
        gears = [g.split(",") for g in args["--dynamic_dims"].split(";")]
        assert len(gears) == len(spec.gears) and {len(g) for g in gears} == {minus_ones}
        names = [part.split(":")[0] for part in args["--input_shape"].split(";")]
        assert names == list(spec.input_shapes)  # graph input order
        # the gears' dims lists are built from the listed inputs, static dims included: at most 128 (§3.4)
        assert sum(len(d) for d in spec.input_shapes.values()) <= 128


def test_render_command_quotes_like_the_atc_docs() -> None:
    argv = ["atc", "--model=my model.onnx", "--input_shape=a:1,-1;b:-1", "--output=out/x", "--weird=$HOME",
            "plain", "two words", "--empty="]
    line = atc.render_command(argv)
    assert line == ("""atc --model="my model.onnx" --input_shape="a:1,-1;b:-1" --output=out/x --weird='$HOME' plain """
                    """'two words' --empty=""")
    assert shlex.split(line) == argv


def test_soc_version_is_checked() -> None:
    compile, specs = VARIANTS["smollm2-910b3"]
    with pytest.raises(AtcError, match="compile.soc_version: '910B3'"):
        atc.atc_command(specs[0], compile.model_copy(update={"soc_version": "910B3"}), Path("om"))


# --- gears ------------------------------------------------------------------------------------------------------


def spec_with(**changes: object) -> AtcModelSpec:
    base = dict(name="decode", onnx_path=Path("step.onnx"),
                input_shapes={"input_ids": [1, "batch"], "block_tables": ["batch", "max_blocks"]},
                gears=[(1, 8), (8, 8)], dim_order=["batch", "max_blocks"])
    return AtcModelSpec(**{**base, **changes})  # type: ignore[arg-type]


@pytest.mark.parametrize(("changes", "message"), [
    ({"gears": [(1, 8)]}, r"1 gear\(s\); ATC's --dynamic_dims takes 2 to 100"),
    ({"gears": [(b, 8) for b in range(1, 102)]}, r"101 gear\(s\); ATC's --dynamic_dims takes 2 to 100"),
    ({"gears": [(1, 8), (8,)]}, r"gear 1 \(8,\) has 1 value\(s\); each gear gives one value per dynamic dim "
                                r"\('batch', 'max_blocks'\) \(2 values\)"),
    ({"gears": [(1, 8, 1), (8, 8, 1)]}, r"gear 0 \(1, 8, 1\) has 3 value"),
    ({"gears": [(1, 8), (0, 8)]}, r"gear 1 \(0, 8\): every value must be a positive integer"),
    ({"gears": [(1, 8), (1, 8)]}, "duplicate gears"),
    ({"input_shapes": {"input_ids": [1, "tokens"]}}, r"input 'input_ids' has dim 'tokens', which is not in dim_order"),
    ({"input_shapes": {"input_ids": [1, "batch"]}}, r"dynamic dim\(s\) \['max_blocks'\] are in dim_order but no input"),
    ({"input_shapes": {"input ids": [1, "batch"], "b": ["max_blocks"]}}, "input name 'input ids'"),
    ({"input_shapes": {"a;b": [1, "batch"], "b": ["max_blocks"]}}, "input name 'a;b'"),
    ({"input_shapes": {"a": [0, "batch"], "b": ["max_blocks"]}}, "a static dim is a positive integer"),
    ({"name": "../x"}, "ATC model name '../x'"),
])
def test_gear_validation(changes: dict, message: str) -> None:
    with pytest.raises(AtcError, match=message):
        spec_with(**changes)


def test_gear_values_fill_every_minus_one_in_input_then_dim_order() -> None:
    spec = spec_with(input_shapes={"input_ids": [1, "batch"], "block_tables": ["batch", "max_blocks"],
                                   "key_cache.0": [4096, 2, 16]}, gears=[(1, 4), (8, 16), (32, 16)])
    assert spec.input_shape_arg() == "input_ids:1,-1;block_tables:-1,-1;key_cache.0:4096,2,16"
    assert spec.dynamic_dims_arg() == "1,1,4;8,8,16;32,32,16"
    assert spec_with(gears=[(b, 8) for b in range(1, 101)]).dynamic_dims_arg().count(";") == 99  # 100 gears: fine


# --- build.sh ---------------------------------------------------------------------------------------------------


def test_build_script_matches_golden(tmp_path: Path) -> None:
    compile, specs = VARIANTS["smollm2-910b3"]
    commands = [atc.atc_command(spec, compile, Path("om")) for spec in specs]
    plugins = atc_plugins.render_plugins(lowering_dict(), tmp_path / "plugins")
    script = build_script.render_build_script(commands, tmp_path / "build.sh", plugins)
    check_golden(GOLDEN / "smollm2-910b3.build.sh", script.read_text())
    assert os.access(script, os.X_OK)
    subprocess.run(["bash", "-n", str(script)], check=True)
    plain = build_script.render_build_script(commands, tmp_path / "plain" / "build.sh")
    text = plain.read_text()
    subprocess.run(["bash", "-n", str(plain)], check=True)
    assert "plugins/" not in text and "ASCEND_CUSTOM_OPP_PATH" not in text
    assert "\n  " + " \\\n  ".join(atc._quote(a) for a in commands[0]) + "\n" in text


# --- running atc ------------------------------------------------------------------------------------------------

FAKE_ATC = """#!/bin/sh
# FAKE atc for tests/test_atc.py only, NOT CANN's ATC: it records its arguments, then writes
# <--output>_linux_x86_64.om (the suffix ATC adds for dynamic-shape parts, hicann/ge model_helper.cc) and a
# fusion_result.json like ATC does; FAKE_ATC_FAIL makes it fail like ATC, FAKE_ATC_NO_OM exit 0 without an .om.
printf '%s\\n' "$@" '--end--' >> "$FAKE_ATC_RECORD"
if [ -n "${FAKE_ATC_FAIL:-}" ]; then echo 'ATC start working now, please wait for a moment.'; \
echo 'E16005: fake failure for the test' >&2; exit 1; fi
for arg in "$@"; do case "$arg" in --output=*) out="${arg#--output=}" ;; esac; done
echo '{"graph_fusion": {}}' > fusion_result.json
if [ -z "${FAKE_ATC_NO_OM:-}" ]; then printf 'fake om\\n' > "${out}_linux_x86_64.om"; fi
echo 'ATC run success, welcome to the next use.'
"""


def test_run_atc_with_a_fake_atc_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ONE test with a FAKE atc on PATH: the argv reaches atc unchanged, logs and fusion results are kept,
    the .om is checked; a failing atc gives AtcError naming its log; build.sh runs the same commands."""
    fake_dir = tmp_path / "fake-bin"
    fake_dir.mkdir()
    (fake_dir / "atc").write_text(FAKE_ATC)
    (fake_dir / "atc").chmod(0o755)
    record = tmp_path / "fake-atc-argv.txt"
    monkeypatch.setenv("PATH", f"{fake_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_ATC_RECORD", str(record))
    monkeypatch.delenv("ASCEND_TOOLKIT_HOME", raising=False)

    bundle = tmp_path / "bundle"
    bundle.mkdir()
    compile, specs = VARIANTS["qwen2-310p3"]
    commands = [atc.atc_command(spec, compile, Path("om")) for spec in specs]
    om = bundle / "om" / "step_linux_x86_64.om"
    oms = atc.run_atc(commands, bundle / "logs", cwd=bundle)
    assert oms == [om]  # found by its --output prefix, suffix and all
    calls = record.read_text().split("--end--\n")[:-1]
    assert [c.splitlines() for c in calls] == [c[1:] for c in commands]  # each argv, unchanged
    log = (bundle / "logs" / "atc-step.log").read_text()
    assert log.startswith(f"$ {atc.render_command(commands[0])}\n") and "ATC run success" in log
    assert (bundle / "logs" / "step.fusion_result.json").is_file()
    assert not (bundle / "fusion_result.json").exists()

    monkeypatch.setenv("FAKE_ATC_FAIL", "1")
    with pytest.raises(AtcError) as failed:
        atc.run_atc(commands, bundle / "logs", cwd=bundle)
    assert f"atc failed for model 'step' (exit 1); see {bundle / 'logs' / 'atc-step.log'}" in str(failed.value)
    assert "E16005: fake failure" in str(failed.value)
    monkeypatch.delenv("FAKE_ATC_FAIL")

    om.write_text("stale")
    monkeypatch.setenv("FAKE_ATC_NO_OM", "1")  # the .om of an earlier run is still there: it must not count
    with pytest.raises(AtcError, match="atc exited 0 for model 'step' but wrote no .*step\\*.om; see .*step.log"):
        atc.run_atc(commands, bundle / "logs", cwd=bundle)
    assert not om.exists()  # never a stand-in .om
    monkeypatch.delenv("FAKE_ATC_NO_OM")

    shutil.rmtree(bundle / "om")
    script = build_script.render_build_script(commands, bundle / "build.sh")
    run = subprocess.run(["bash", str(script)], cwd=tmp_path, capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr
    assert om.is_file() and f"wrote om/{om.name}" in run.stdout
    assert (bundle / "logs" / "step.fusion_result.json").is_file()
    monkeypatch.setenv("FAKE_ATC_FAIL", "1")
    run = subprocess.run(["bash", str(script)], capture_output=True, text=True, check=False)
    assert run.returncode == 1 and "atc failed for step" in run.stderr and "E16005" in run.stderr


def test_without_atc_the_step_is_left_and_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    compile, specs = VARIANTS["smollm2-910b3"]
    commands = [atc.atc_command(spec, compile, Path("om")) for spec in specs]
    with pytest.raises(AtcMissing) as missing:
        atc.run_atc(commands, tmp_path / "logs", cwd=tmp_path, script=Path("bundle/ascend/build.sh"))
    message = str(missing.value)
    assert "the ATC step (ONNX -> OM) is left: `atc` is not on PATH" in message
    assert "run `bash bundle/ascend/build.sh` there" in message
    assert all(atc.render_command(c) in message for c in commands) and "\n" not in message
    assert missing.value.commands == commands
    assert not (tmp_path / "om").exists() and not (tmp_path / "logs").exists()




def test_input_shapes_from_the_real_step_graph(tiny_ascend_step: tuple[dict, Path]) -> None:
    """The step graph's pools are static (issue 20 defect 2): only the step inputs have dims a gear sets; the
    in-place pools are what the RefData builder flips, and CANN's rules over its argv hold for them."""
    _, step = tiny_ascend_step
    shapes = atc.input_shapes_from_onnx(step, {d: d for d in STEP_DIMS})
    pools = [n for n in shapes if n == KV_POOL or n.startswith(("key_cache.", "value_cache."))]
    assert pools and all(isinstance(d, int) for n in pools for d in shapes[n])
    listed = {n: d for n, d in shapes.items() if n not in pools}
    assert all(any(isinstance(d, str) for d in dims) for dims in listed.values())  # each has a gear dim
    assert {n: d for n, d in STEP_INPUTS.items() if n in listed} == {n: listed[n] for n in STEP_INPUTS if n in listed}
    if KV_POOL not in pools:  # the in-place step graph: its pools become RefData
        used = [d for d in STEP_DIMS if any(d in dims for dims in listed.values())]
        gears = [tuple(v for _ in used) for v in (1, 2)]
        argv = refdata_build.refdata_command(AtcModelSpec("step", Path(step.name), listed, gears, used),
                                             CompileSection(target="ascend", soc_version="Ascend910B3"), Path("om"),
                                             pools)
        results = {r.rule: r for r in check_command(argv, step.parent)}
        assert all(r.ok for name, r in results.items() if "ref_inputs" in name or "tiling" in name), results
    spec = AtcModelSpec("step", step, STEP_INPUTS, [(16, 1, 16, 1, 4), (1, 1, 1, 1, 8)], list(STEP_DIMS))
    argv = atc.atc_command(spec, CompileSection(target="ascend"), step.parent / "om")
    assert "--dynamic_dims=16,16,1,4,1,16,16,1;1,1,1,8,1,1,1,1" in argv
    with pytest.raises(AtcError, match="input 'input_ids' has dim 'num_tokens' with no size or gear dim given"):
        atc.input_shapes_from_onnx(step, {})
    with pytest.raises(AtcError, match="cannot read the ONNX graph"):
        atc.input_shapes_from_onnx(step.parent / "missing.onnx", {})
