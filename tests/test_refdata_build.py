"""The RefData build route of in-place bundles (omforge.compile.ascend.refdata_build): the builder's argv against the
atc command it replaces, its C++ source compiled against STUB CANN headers (tests/stubs/) and run through a harness
that records the IR build calls, CANN's rules over its argv (compile/ascend/atc_conformance.py), the FAKE builder
(tests/fake_atc.py) with and without the flip, and ``build.sh`` compiling and running it with stand-ins.
Nothing here has run against a CANN toolkit or an NPU."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import fake_atc
import onnx
import pytest
from onnx import TensorProto, helper

from omforge.compile.ascend import atc, build_script, refdata_build
from omforge.compile.ascend.atc import AtcError, AtcModelSpec
from omforge.compile.ascend.atc_conformance import check_command
from omforge.contract.ascend import CANN_RELEASE, REF_SUFFIX, key_cache, value_cache
from omforge.recipe import CompileSection

TESTS = Path(__file__).resolve().parent
STUBS = TESTS / "stubs"
GXX = shutil.which("g++")
STEP = {"input_ids": [1, "T"], "position_ids": [1, "T"], "block_tables": ["B", "M"], "token_index": ["T"]}
POOL = [4, 128, 192]  # [num_blocks, block_size, kv_heads * head_dim]
REFS = [key_cache(0), value_cache(0)]
GEARS = [(1, 1, 4), (128, 1, 4)]


def spec(inputs: dict | None = None) -> AtcModelSpec:
    return AtcModelSpec("step", Path("step.onnx"), inputs or {"input_ids": [1, "T"], "position_ids": [1, "T"],
                                                              "block_tables": ["B", "M"], "token_index": ["T"]},
                        GEARS, ["T", "B", "M"])


def compile_for(soc: str) -> CompileSection:
    return CompileSection(target="ascend", soc_version=soc, weights="float16", precision_mode="must_keep_origin_dtype")


def step_graph(path: Path, twin: bool = False, dynamic_pool: bool = False) -> Path:
    """A graph with the step inputs and one layer's two static pools; ``twin`` adds the twin's ref outputs."""
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT64, d) for n, d in STEP.items()]
    shape = ["N", *POOL[1:]] if dynamic_pool else POOL
    inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT16, shape) for n in REFS]
    nodes = [helper.make_node("Cast", ["input_ids"], ["y"], to=TensorProto.INT64)]
    outputs = [helper.make_tensor_value_info("y", TensorProto.INT64, [1, "T"])]
    if twin:
        nodes += [helper.make_node("Identity", [n], [n + REF_SUFFIX]) for n in REFS]
        outputs += [helper.make_tensor_value_info(n + REF_SUFFIX, TensorProto.FLOAT16, POOL) for n in REFS]
    graph = helper.make_graph(nodes, "g", inputs, outputs)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(path))
    return path


# --- the command ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("soc", "sink"), [("Ascend910B3", True), ("Ascend910_9392", True), ("Ascend310P3", True),
                                           ("Ascend310B1", False), ("Ascend910A", False)])
def test_the_builder_takes_atcs_gear_flags_plus_the_ref_inputs(soc: str, sink: bool) -> None:
    compile = compile_for(soc)
    argv = refdata_build.refdata_command(spec(), compile, Path("om"), REFS)
    gear_command = atc.atc_command(spec(), compile, Path("om"))
    assert argv[0] == refdata_build.BUILDER and refdata_build.is_builder(argv) and not refdata_build.is_builder(
        gear_command)
    # the same flags with the same values as today's atc line, minus --framework (the builder parses ONNX itself)
    assert argv[1:len(gear_command) - 1] == [a for a in gear_command[1:] if not a.startswith("--framework=")]
    assert f"--ref_inputs={key_cache(0)},{value_cache(0)}" in argv
    assert ("--tiling_schedule_optimize=1" in argv) is sink  # --tiling_schedule_optimize.md:3-27


@pytest.mark.parametrize(("refs", "message"), [
    ([], "needs at least one ref input"), ([key_cache(0), key_cache(0)], "repeated ref inputs"),
    (["block_tables"], r"ref input\(s\) \['block_tables'\] have a gear dim"), (["a,b"], "contain ',' or '='")])
def test_bad_ref_inputs_are_refused(refs: list[str], message: str) -> None:
    with pytest.raises(AtcError, match=message):
        refdata_build.refdata_command(spec(), compile_for("Ascend910B3"), Path("om"), refs)


# --- the C++ source ---------------------------------------------------------------------------------------------


def gxx(*args: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run([GXX or "g++", "-std=c++17", "-Wall", "-Wextra", "-Werror", *map(str, args)],
                          capture_output=True, text=True, check=False)


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The rendered builder linked with the STUB harness (tests/stubs/refdata_harness.cc) in place of CANN."""
    if GXX is None:
        pytest.skip("g++ is not installed: cannot compile the RefData builder against the stub headers")
    asc = tmp_path_factory.mktemp("refdata")
    (source,) = refdata_build.render_builder(asc)
    assert source == asc / "refdata_build" / "omforge_refdata_build.cc"
    text = source.read_text()
    assert f"CANN {CANN_RELEASE}" in text and "[unverified]" in text and "reference/" not in text
    binary = asc / "builder"
    result = gxx("-I", STUBS, "-o", binary, source, STUBS / "refdata_harness.cc")
    assert result.returncode == 0, result.stderr
    return binary


def run_builder(binary: Path, argv: list[str], cwd: Path, inputs: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(binary), *argv[1:]], cwd=cwd, capture_output=True, text=True, check=False,
                          env={**os.environ, "STUB_ONNX_INPUTS": inputs})


def test_the_builder_flips_each_ref_input_and_passes_atcs_options(harness: Path, tmp_path: Path) -> None:
    argv = refdata_build.refdata_command(spec(), compile_for("Ascend910B3"), Path("om"), REFS)
    (tmp_path / "om").mkdir()
    run = run_builder(harness, argv, tmp_path, ",".join([*STEP, *REFS]))
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    flags = dict(a.split("=", 1) for a in argv[1:])
    assert f"parse {flags['--model']}" in lines and not [ln for ln in lines if ln.startswith("parser ")]
    assert [ln for ln in lines if ln.startswith("global ")] == [f"global ge.socVersion={flags['--soc_version']}"]
    assert sorted(ln for ln in lines if ln.startswith("build ")) == sorted([
        f"build input_format={flags['--input_format']}", f"build input_shape={flags['--input_shape']}",
        f"build ge.dynamicDims={flags['--dynamic_dims']}", f"build ge.exec.precision_mode={flags['--precision_mode']}",
        f"build log={flags['--log']}", "build ge.tiling_schedule_optimize=1"])
    # each pool: a RefData with the Data's name, index and descs, its consumer relinked; the step inputs stay Data
    nodes = {ln.split()[1]: ln.split()[2:] for ln in lines if ln.startswith("node ")}
    for i, name in enumerate([*STEP, *REFS]):
        kind = "RefData" if name in REFS else "Data"
        assert nodes[name] == [kind, f"index={i}", f"in=desc:{name}", f"out=desc:{name}"], name
        assert f"edge {name}:0 -> use:{name}:1" in lines
    assert (tmp_path / "om" / "step.om").is_file() and lines[-2:] == [
        f"omforge_refdata_build: wrote om/step*.om with {len(REFS)} RefData input(s)", "finalize"]


def test_the_builder_fails_in_one_line(harness: Path, tmp_path: Path) -> None:
    argv = refdata_build.refdata_command(spec(), compile_for("Ascend310B1"), Path("om"), REFS)
    run = run_builder(harness, argv, tmp_path, ",".join(STEP))  # the graph has no pools
    assert run.returncode == 1 and run.stderr.strip() == (
        f"omforge_refdata_build: --ref_inputs names '{key_cache(0)}', which is not a graph input")
    assert "ge.tiling_schedule_optimize" not in run.stdout  # never on 310B
    run = run_builder(harness, [*argv, "--framework=5"], tmp_path, ",".join(STEP))
    assert run.returncode == 2 and "unknown argument '--framework=5'" in run.stderr
    run = run_builder(harness, [a for a in argv if not a.startswith("--ref_inputs")], tmp_path, "")
    assert run.returncode == 2 and run.stderr.strip() == "omforge_refdata_build: missing --ref_inputs"


# --- CANN's rules over the argv, and the FAKE builder -------------------------------------------------------------


def broken(argv: list[str], cwd: Path) -> dict[str, str]:
    return {r.rule: r.detail for r in check_command(argv, cwd) if not r.ok}


def builder_argv(soc: str = "Ascend910B3", refs: list[str] = REFS) -> list[str]:
    return refdata_build.refdata_command(spec(), compile_for(soc), Path("om"), refs)


REF_RULE = "--ref_inputs: static graph inputs, each once, none a graph output (builder only)"
SINK_RULE = "--tiling_schedule_optimize=1: Atlas A2/A3/310P, static shapes per gear"


def test_the_rules_fit_the_builder_argv(tmp_path: Path) -> None:
    step_graph(tmp_path / "step.onnx")
    assert broken(builder_argv(), tmp_path) == {}
    assert broken(builder_argv("Ascend310B1"), tmp_path) == {}  # no tiling sink there: nothing to refuse
    assert "--framework=5 for ONNX (none for the RefData builder)" in broken([*builder_argv(), "--framework=5"],
                                                                            tmp_path)
    assert "every RefData builder flag is an IR build option" in broken([*builder_argv(), "--out_nodes=y"], tmp_path)
    assert "not graph inputs" in broken(builder_argv(refs=[*REFS, key_cache(1)]), tmp_path)[REF_RULE]
    gather = atc.atc_command(spec(), compile_for("Ascend910B3"), Path("om"))
    assert "atc has none" in broken([*gather, f"--ref_inputs={key_cache(0)}"], tmp_path)[REF_RULE]
    step_graph(tmp_path / "step.onnx", dynamic_pool=True)
    shape = ";".join(f"{n}:{','.join(map(str, d))}" for n, d in {**{k: [-1] * len(v) for k, v in STEP.items()},
                                                               **{k: [-1, *POOL[1:]] for k in REFS}}.items())
    argv = [a if not a.startswith("--input_shape=") else f"--input_shape={shape}" for a in builder_argv()]
    assert "have dynamic dims" in broken(argv, tmp_path)[REF_RULE]


def test_tiling_sink_is_refused_on_310b_and_without_static_gears(tmp_path: Path) -> None:
    """--tiling_schedule_optimize.md:3-42: not on Atlas 200I/500 A2 (310B) nor the 910 series; static shapes."""
    step_graph(tmp_path / "step.onnx")
    on_310b = [a.replace("Ascend910B3", "Ascend310B1") for a in builder_argv()]
    assert "not documented for Ascend310B1" in broken(on_310b, tmp_path)[SINK_RULE]
    assert "not documented for Ascend910A" in broken([a.replace("Ascend910B3", "Ascend910A") for a in builder_argv()],
                                                    tmp_path)[SINK_RULE]
    no_gears = [a for a in builder_argv() if not a.startswith("--dynamic_dims=")]
    assert "need --dynamic_dims gears" in broken(no_gears, tmp_path)[SINK_RULE]
    assert "static shapes" in broken([*builder_argv(), "--input_shape_range=x:[1~2]"], tmp_path)[SINK_RULE]
    assert "the values are 0 (default) and 1" in broken(
        [a.replace("--tiling_schedule_optimize=1", "--tiling_schedule_optimize=2") for a in builder_argv()],
        tmp_path)[SINK_RULE]
    with pytest.raises(fake_atc.FakeAtcError, match="tiling sink is not documented for Ascend310B1"):
        fake_atc.run(on_310b, tmp_path, step_graph(tmp_path / "twin.onnx", twin=True))


def test_the_fake_builder_records_the_flip_and_can_leave_it_out(tmp_path: Path) -> None:
    step_graph(tmp_path / "step.onnx")
    twin = step_graph(tmp_path / "twin.onnx", twin=True)  # its .ref outputs are not part of the OM's interface
    om = json.loads(fake_atc.run(builder_argv(), tmp_path, twin).read_text())
    assert om["ref_inputs"] == REFS and om["built_by"] == "refdata_build" and om["tiling_schedule_optimize"] == "1"
    assert [n for n, _ in om["input_shape"]] == list(STEP) and om["gears"] == [[1, 1, 1, 4, 1], [128, 128, 1, 4, 128]]
    plain = json.loads(fake_atc.run(builder_argv(), tmp_path, twin, flip=False).read_text())
    assert plain["ref_inputs"] == [] and {k: v for k, v in plain.items() if k != "ref_inputs"} == {
        k: v for k, v in om.items() if k != "ref_inputs"}
    gather = json.loads(fake_atc.run(atc.atc_command(spec(), compile_for("Ascend910B3"), Path("om")), tmp_path,
                                     twin).read_text())
    assert gather["ref_inputs"] == [] and gather["built_by"] == "atc"  # ATC's parser makes no RefData
    other = step_graph(tmp_path / "other.onnx")
    onnx.save(helper.make_model(helper.make_graph([], "g", [], [helper.make_tensor_value_info(
        "z", TensorProto.FLOAT, [1])]), opset_imports=[helper.make_opsetid("", 18)]), str(other))
    with pytest.raises(fake_atc.FakeAtcError, match="another interface"):
        fake_atc.run(builder_argv(), tmp_path, other)


# --- build.sh ---------------------------------------------------------------------------------------------------

STAND_IN_GXX = """#!/bin/sh
# STAND-IN C++ compiler for tests/test_refdata_build.py only, NOT g++: it records its arguments and writes, at -o, a
# STAND-IN builder that records its own arguments and writes <--output>.om as aclgrphSaveModel does.
printf '%s\\n' "$@" > "$STAND_IN_RECORD.cxx"
while [ $# -gt 0 ]; do if [ "$1" = "-o" ]; then out="$2"; fi; shift; done
cat > "$out" <<'EOF'
#!/bin/sh
printf '%s\\n' "$@" > "$STAND_IN_RECORD.builder"
for arg in "$@"; do case "$arg" in --output=*) o="${arg#--output=}" ;; esac; done
printf 'stand-in om\\n' > "$o.om"
EOF
chmod +x "$out"
"""


def toolkit(root: Path, version: str | None) -> Path:
    """A FAKE toolkit folder (files only): the IR build header build.sh checks for, and the version file CANN's
    docs read (``<arch>-linux/ascend_toolkit_install.info``, ``version=``: hicann/ge docs/en/build.md:11-14)."""
    home = root / "cann"
    (home / "include" / "ge").mkdir(parents=True)
    (home / "include" / "ge" / "ge_ir_build.h").write_text("// fake toolkit for tests/test_refdata_build.py\n")
    if version is not None:
        (home / "x86_64-linux").mkdir()
        (home / "x86_64-linux" / "ascend_toolkit_install.info").write_text(
            f"package_name=Ascend-cann-toolkit\nversion={version}\narch=x86_64\nos=linux\n")
    return home


@pytest.mark.parametrize(("version", "older"), [("8.0.RC3", True), ("9.1.RC1", True), ("8.5.0.alpha001", True),
                                                ("9.1.0", False), ("9.2.0", False), (None, None)])
def test_build_sh_compiles_and_runs_the_builder_and_checks_the_release(tmp_path: Path, version: str | None,
                                                                       older: bool | None) -> None:
    asc = tmp_path / "ascend"
    asc.mkdir()
    step_graph(asc / "step.onnx")
    refdata_build.render_builder(asc)
    argv = builder_argv()
    script = build_script.render_build_script([argv], asc / "build.sh")
    text = script.read_text()
    assert "command -v atc" not in text and "refdata_build/omforge_refdata_build.cc" in text
    subprocess.run(["bash", "-n", str(script)], check=True)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "stand-in-g++").write_text(STAND_IN_GXX)
    (bin_dir / "stand-in-g++").chmod(0o755)
    record = tmp_path / "record"
    env = {"PATH": f"{bin_dir}{os.pathsep}/usr/bin:/bin", "CXX": "stand-in-g++", "STAND_IN_RECORD": str(record),
           "ASCEND_TOOLKIT_HOME": str(toolkit(tmp_path, version)), "HOME": str(tmp_path)}
    run = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr
    warning = f"build.sh: warning: CANN {version} is older than {CANN_RELEASE}, the release omforge's Ascend path"
    assert (warning in run.stderr) is bool(older)
    assert ("the CANN toolkit's version is unknown" in run.stderr) is (version is None)
    assert (asc / "om" / "step.om").is_file() and "wrote om/step.om" in run.stdout
    assert Path(f"{record}.builder").read_text().splitlines() == argv[1:]  # the bundle's exact argv
    cxx = Path(f"{record}.cxx").read_text().splitlines()
    assert "-D_GLIBCXX_USE_CXX11_ABI=0" in cxx and "-lge_compiler" in cxx and "-lfmk_onnx_parser" in cxx
    assert cxx[cxx.index("-o") + 1] == refdata_build.BUILDER


def test_build_sh_says_what_the_builder_needs(tmp_path: Path) -> None:
    asc = tmp_path / "ascend"
    asc.mkdir()
    script = build_script.render_build_script([builder_argv()], asc / "build.sh")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "CXX": "no-such-compiler"}
    run = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, check=False)
    assert run.returncode == 127 and "the RefData builder needs the CANN toolkit's headers" in run.stderr
    env["ASCEND_TOOLKIT_HOME"] = str(toolkit(tmp_path, CANN_RELEASE))
    run = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, check=False)
    assert run.returncode == 127 and "no-such-compiler is not on PATH" in run.stderr and "warning" not in run.stderr
