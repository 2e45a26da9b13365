"""The ATC step (omforge.compile.atc): command lines against golden files, the fusion switch file, gear checks,
build.sh, and running ``atc`` — with a FAKE ``atc`` in one test only. The plugins: test_atc_plugins.py.

No CANN here: goldens were reviewed by hand against reference/ascend.md §1.1–1.5. Regenerate them with
``OMFORGE_UPDATE_GOLDEN=1`` and review the diff again.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from helpers import lowering_dict
from omforge.compile import atc, atc_plugins
from omforge.compile.atc import AtcError, AtcMissing, AtcModelSpec
from omforge.recipe import FUSIONS, CompileSection

TESTS = Path(__file__).resolve().parent
GOLDEN = TESTS / "golden" / "atc"
STUBS = TESTS / "stubs"
UPDATE = os.environ.get("OMFORGE_UPDATE_GOLDEN") == "1"
GXX = shutil.which("g++")
REAL_JSON = next((d for d in (Path("/usr/include"), Path("/usr/local/include"))
                  if (d / "nlohmann" / "json.hpp").is_file()), None)
FAILED = 0xFFFFFFFF  # domi::FAILED


def step_shapes(layers: int, kv_heads: int, head_dim: int, num_slots: int, *, tokens: str, seqs: int | str,
                query: int | str, logits: int | str) -> dict[str, list[int | str]]:
    """The step graph's inputs in graph order (passes/paged_kv.py ABI, lowered for ascend: no slot_mapping),
    with the pool size static as an OM needs it."""
    shapes: dict[str, list[int | str]] = {
        "input_ids": [1, tokens], "position_ids": [1, tokens], "block_tables": [seqs, "max_blocks"],
        "query_index": [seqs, query], "token_index": [tokens], "logits_indices": [logits]}
    for n in range(layers):
        shapes[f"key_cache.{n}"] = [num_slots, kv_heads, head_dim]
        shapes[f"value_cache.{n}"] = [num_slots, kv_heads, head_dim]
    return shapes


def profiles(layers: int, kv_heads: int, head_dim: int, num_slots: int, prefill: list[tuple[int, int]],
             decode: list[tuple[int, int]]) -> list[AtcModelSpec]:
    """The two OM models of a bundle, both from one step graph: prefill (one sequence, chunk_len tokens) and
    decode (batch sequences, one token each); gears as compile/buckets.py gives them."""
    onnx_path = Path("step.onnx")
    return [
        AtcModelSpec("prefill", onnx_path, step_shapes(layers, kv_heads, head_dim, num_slots, tokens="chunk_len",
                                                       seqs=1, query="chunk_len", logits=1),
                     prefill, ["chunk_len", "max_blocks"]),
        AtcModelSpec("decode", onnx_path, step_shapes(layers, kv_heads, head_dim, num_slots, tokens="batch",
                                                      seqs="batch", query=1, logits="batch"),
                     decode, ["batch", "max_blocks"]),
    ]


# name -> (compile section, model profiles): SmolLM2-135M (30 layers, 3 KV heads of 64), Llama-3-8B (32 layers,
# 8 KV heads of 128), Qwen2-0.5B (24 layers, 2 KV heads of 64); block size 128 (max_blocks = max_seq_len / 128).
VARIANTS: dict[str, tuple[CompileSection, list[AtcModelSpec]]] = {
    "smollm2-910b3": (
        CompileSection(target="ascend", soc_version="Ascend910B3", precision_mode="allow_fp32_to_fp16"),
        profiles(30, 3, 64, 65536, prefill=[(128, 16), (512, 16)], decode=[(1, 16), (16, 16), (64, 16)])),
    "llama3-910b4": (
        CompileSection(target="ascend", soc_version="Ascend910B4", precision_mode="force_fp32", max_seq_len=8192),
        profiles(32, 8, 128, 32768, prefill=[(256, 64), (1024, 64), (4096, 64)], decode=[(1, 64), (8, 64), (32, 64)])),
    "qwen2-310p3": (
        CompileSection(target="ascend", soc_version="Ascend310P3", precision_mode="must_keep_origin_dtype",
                       max_seq_len=1024, fusions={"attention": False}),
        profiles(24, 2, 64, 16384, prefill=[(64, 8), (128, 8), (256, 8), (512, 8)],
                 decode=[(1, 8), (2, 8), (4, 8), (8, 8)])),
}


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
            "--dynamic_dims", "--precision_mode", "--fusion_switch_file", "--log"]
        args = dict(a.split("=", 1) for a in argv[1:])
        assert args["--framework"] == "5" and args["--input_format"] == "ND" and args["--log"] == "error"
        assert args["--soc_version"] == compile.soc_version and args["--precision_mode"] == compile.precision_mode
        assert args["--output"] == f"om/{spec.name}" and atc.om_path(argv) == Path(f"om/{spec.name}.om")
        assert args["--fusion_switch_file"] == "om/fusion_switch.cfg"
        assert "--out_nodes" not in flags  # the graph's own outputs are the model's (module docstring)
        # one value per -1, every gear; a dim shared by several inputs repeats its gear value (§1.3)
        minus_ones = args["--input_shape"].count("-1")
        gears = [g.split(",") for g in args["--dynamic_dims"].split(";")]
        assert len(gears) == len(spec.gears) and {len(g) for g in gears} == {minus_ones}
        names = [part.split(":")[0] for part in args["--input_shape"].split(";")]
        assert names == list(spec.input_shapes)  # graph input order


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


# --- fusion switch file -----------------------------------------------------------------------------------------


def test_fusion_switch_file_has_the_documented_structure(tmp_path: Path) -> None:
    compile = VARIANTS["qwen2-310p3"][0]
    path = atc.write_fusion_switch(compile.fusions, tmp_path / "om" / atc.FUSION_SWITCH_FILE)
    data = json.loads(path.read_text())
    # §1.5: {"Switch":{"GraphFusion":{...},"UBFusion":{...}}}; no CANN pass named in the reference, so all on
    assert data["Switch"] == {"GraphFusion": {"ALL": "on"}, "UBFusion": {"ALL": "on"}}
    assert set(data) == {"Switch", "omforge"}
    assert data["omforge"]["fusions"] == {f: "off" if f == "attention" else "on" for f in FUSIONS}
    assert list(data["omforge"]["fusions"]) == list(FUSIONS)
    with pytest.raises(AtcError, match="unknown fusion"):
        atc.fusion_switch_config({"rmsnorm": True})


# --- build.sh ---------------------------------------------------------------------------------------------------


def test_build_script_matches_golden(tmp_path: Path) -> None:
    compile, specs = VARIANTS["smollm2-910b3"]
    commands = [atc.atc_command(spec, compile, Path("om")) for spec in specs]
    plugins = atc_plugins.render_plugins(lowering_dict(), tmp_path / "plugins")
    script = atc.render_build_script(commands, tmp_path / "build.sh", plugins)
    check_golden(GOLDEN / "smollm2-910b3.build.sh", script.read_text())
    assert os.access(script, os.X_OK)
    subprocess.run(["bash", "-n", str(script)], check=True)
    plain = atc.render_build_script(commands, tmp_path / "plain" / "build.sh")
    text = plain.read_text()
    subprocess.run(["bash", "-n", str(plain)], check=True)
    assert "plugins" not in text and "ASCEND_CUSTOM_OPP_PATH" not in text
    assert "\n  " + " \\\n  ".join(atc._quote(a) for a in commands[1]) + "\n" in text


# --- running atc ------------------------------------------------------------------------------------------------

FAKE_ATC = """#!/bin/sh
# FAKE atc for tests/test_atc.py only, NOT CANN's ATC: it records its arguments, then writes <--output>.om and a
# fusion_result.json like ATC does; FAKE_ATC_FAIL makes it fail like ATC, FAKE_ATC_NO_OM exit 0 without an .om.
printf '%s\\n' "$@" '--end--' >> "$FAKE_ATC_RECORD"
if [ -n "${FAKE_ATC_FAIL:-}" ]; then echo 'ATC start working now, please wait for a moment.'; \
echo 'E16005: fake failure for the test' >&2; exit 1; fi
for arg in "$@"; do case "$arg" in --output=*) out="${arg#--output=}" ;; esac; done
echo '{"graph_fusion": {}}' > fusion_result.json
if [ -z "${FAKE_ATC_NO_OM:-}" ]; then printf 'fake om\\n' > "$out.om"; fi
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
    oms = atc.run_atc(commands, bundle / "logs", cwd=bundle)
    assert oms == [bundle / "om" / "prefill.om", bundle / "om" / "decode.om"]
    calls = record.read_text().split("--end--\n")[:-1]
    assert [c.splitlines() for c in calls] == [c[1:] for c in commands]  # each argv, unchanged
    for name in ("prefill", "decode"):
        log = (bundle / "logs" / f"atc-{name}.log").read_text()
        assert log.startswith(f"$ {atc.render_command(commands[0 if name == 'prefill' else 1])}\n")
        assert "ATC run success" in log
        assert (bundle / "logs" / f"{name}.fusion_result.json").is_file()
    assert not (bundle / "fusion_result.json").exists()

    monkeypatch.setenv("FAKE_ATC_FAIL", "1")
    with pytest.raises(AtcError) as failed:
        atc.run_atc(commands[1:], bundle / "logs", cwd=bundle)
    assert f"atc failed for model 'decode' (exit 1); see {bundle / 'logs' / 'atc-decode.log'}" in str(failed.value)
    assert "E16005: fake failure" in str(failed.value)
    monkeypatch.delenv("FAKE_ATC_FAIL")

    monkeypatch.setenv("FAKE_ATC_NO_OM", "1")  # decode.om of the first run is still there: it must not count
    with pytest.raises(AtcError, match="atc exited 0 for model 'decode' but wrote no .*decode.om; see .*decode.log"):
        atc.run_atc(commands[1:], bundle / "logs", cwd=bundle)
    assert not (bundle / "om" / "decode.om").exists()  # never a stand-in .om
    monkeypatch.delenv("FAKE_ATC_NO_OM")

    shutil.rmtree(bundle / "om")
    script = atc.render_build_script(commands, bundle / "build.sh")
    run = subprocess.run(["bash", str(script)], cwd=tmp_path, capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr
    assert (bundle / "om" / "prefill.om").is_file() and (bundle / "om" / "decode.om").is_file()
    assert (bundle / "logs" / "decode.fusion_result.json").is_file()
    monkeypatch.setenv("FAKE_ATC_FAIL", "1")
    run = subprocess.run(["bash", str(script)], capture_output=True, text=True, check=False)
    assert run.returncode == 1 and "atc failed for prefill" in run.stderr and "E16005" in run.stderr


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
    _, step = tiny_ascend_step
    prefill = {"num_tokens": "chunk_len", "max_query_len": "chunk_len", "num_seqs": 1, "num_logits": 1,
               "max_blocks": "max_blocks", "num_slots": 4096}
    shapes = atc.input_shapes_from_onnx(step, prefill)
    assert shapes == step_shapes(2, 2, 16, 4096, tokens="chunk_len", seqs=1, query="chunk_len", logits=1)
    spec = AtcModelSpec("prefill", step, shapes, [(16, 4), (64, 8)], ["chunk_len", "max_blocks"])
    argv = atc.atc_command(spec, CompileSection(target="ascend"), step.parent / "om")
    assert "--dynamic_dims=16,16,4,16,16;64,64,8,64,64" in argv
    with pytest.raises(AtcError, match="input 'key_cache.0' has dim 'num_slots' with no size or gear dim given"):
        atc.input_shapes_from_onnx(step, {k: v for k, v in prefill.items() if k != "num_slots"})
    with pytest.raises(AtcError, match="cannot read the ONNX graph"):
        atc.input_shapes_from_onnx(step.parent / "missing.onnx", prefill)
