"""``omforge compile`` / ``inspect``: the bundle, stage caching and invalidation, corrupted or missing artifacts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from helpers import TINY_RECIPE, compile_bundle
from omforge.cli import main
from omforge.compile.compiler import compile_recipe
from omforge.contract.manifest import SCHEMA_VERSION, BundleError, load_manifest
from omforge.recipe import load_recipe


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("OMFORGE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("bundle")
    return compile_bundle(TINY_RECIPE, root / "b", root / "cache")


def test_manifest_contents(bundle: Path) -> None:
    m = load_manifest(bundle)
    assert m.schema_version == SCHEMA_VERSION and m.target == "ort" and m.ascend is None
    assert m.model.config.num_hidden_layers == 2
    assert m.kv.block_size == 64 and m.kv.num_layers == 2  # the ort default, measured
    names = [i.name for i in m.abi.inputs]
    assert names[:7] == ["input_ids", "position_ids", "slot_mapping", "block_tables", "query_index", "token_index",
                         "logits_indices"]
    assert [o.name for o in m.abi.outputs][:3] == ["logits", "key_cache_out.0", "value_cache_out.0"]
    assert m.passes.fusion_counts == {"rms_norm": 5, "add_rms_norm": 4, "rotary": 4, "qkv_merge": 2, "moe": 0,
                                      "gate_up_swiglu": 2, "attention": 2}
    assert set(m.files) >= {"ort/step.onnx", "ort/step.onnx.data"}
    # no second copy of the weights: the unfused export stays in the stage cache, named by the manifest
    assert not any(f.startswith("export/") for f in m.files) and not (bundle / "export").exists()
    assert m.export is not None and (Path(m.export.dir) / "model.onnx").is_file()
    assert m.buckets.profiles[0].name == "step"
    for tool in ("onnx", "onnxruntime", "omforge"):
        assert m.toolchain[tool]


def test_step_graph_of_the_bundle_runs(bundle: Path) -> None:
    from omforge.runtime.ort.ort_executor import OrtExecutor
    from omforge.runtime.step import SeqWork, build_step

    m = load_manifest(bundle)
    layout = m.kv.paged_layout
    ex = OrtExecutor(bundle / m.graphs.step, layout, num_blocks=4)
    logits = ex.run(build_step([SeqWork([1, 2, 3], 0, [2])], layout.block_size))
    assert logits.shape == (1, 256) and np.isfinite(logits).all()


def test_second_compile_reuses_every_stage_and_a_switch_redoes_only_the_passes(cache: Path, tmp_path: Path) -> None:
    recipe = load_recipe(TINY_RECIPE)
    first = compile_recipe(recipe, tmp_path / "a", quiet=True)
    assert first.cached == {"export": False, "passes": False}
    second = compile_recipe(recipe, tmp_path / "a", quiet=True)
    assert second.cached == {"export": True, "passes": True}
    assert second.manifest.files == first.manifest.files
    text = TINY_RECIPE.read_text().replace("compile:\n", "compile:\n  fusions: {rms_norm: false}\n")
    switched = tmp_path / "switched.yaml"
    switched.write_text(text.replace("name: tiny-llama", "name: tiny-llama"))
    third = compile_recipe(load_recipe(switched), tmp_path / "b", quiet=True)
    assert third.cached == {"export": True, "passes": False}
    assert third.manifest.passes.fusion_counts["rms_norm"] == 0
    block = tmp_path / "block.yaml"
    block.write_text(TINY_RECIPE.read_text().replace("compile:\n", "compile:\n  kv_block_size: 16\n"))
    fourth = compile_recipe(load_recipe(block), tmp_path / "c", quiet=True)
    assert fourth.cached == {"export": True, "passes": False} and fourth.manifest.kv.block_size == 16


def test_two_compiles_sharing_a_cache_build_each_stage_once(tmp_path: Path) -> None:
    """Two ``omforge compile`` processes started together on one stage cache: both bundles are whole and equal, the
    passes stage was built by one of them and found done by the other (omforge/file_lock.py), one export folder."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMFORGE_CACHE_DIR": str(tmp_path / "cache")}
    procs = [subprocess.Popen([sys.executable, "-m", "omforge", "compile", str(TINY_RECIPE), "-o", str(tmp_path / n)],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for n in "ab"]
    logs = [p.communicate(timeout=600)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    for stage in ("export", "passes + lowering (ort)"):  # one built it, the other waited and found it done
        assert sorted(f"[compile] {stage} (cached)" in log for log in logs) == [False, True], logs
    assert len(list((tmp_path / "cache" / "exports").glob("*/export.json"))) == 1
    a, b = load_manifest(tmp_path / "a"), load_manifest(tmp_path / "b")
    assert a.files == b.files and (tmp_path / "a" / a.graphs.step).read_bytes() == (tmp_path / "b" /
                                                                                   b.graphs.step).read_bytes()


def test_corrupted_or_missing_artifacts_are_clear_errors(bundle: Path, tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(bundle, copy)
    data = copy / "ort" / "step.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(BundleError, match=r"file 'ort/step.onnx.data' was modified \(SHA-256"):
        load_manifest(copy)
    data.write_bytes(bytes(raw[:-4]))
    with pytest.raises(BundleError, match=r"'ort/step.onnx.data' was modified \(size"):
        load_manifest(copy)
    data.unlink()
    with pytest.raises(BundleError, match=r"file 'ort/step.onnx.data' listed in the manifest is missing"):
        load_manifest(copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["schema_version"] = 99
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="schema_version 99 is not supported"):
        load_manifest(copy)
    (copy / "manifest.json").unlink()
    with pytest.raises(BundleError, match="no manifest.json"):
        load_manifest(copy)


def test_inspect_cli(bundle: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(bundle)]) == 0
    out = capsys.readouterr().out
    assert "target ort" in out and "block size 64" in out and "block_tables" in out and "key_cache.0" in out
    assert main(["inspect", str(bundle), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["target"] == "ort"
    assert main(["inspect", str(tmp_path / "nothing")]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_compile_cli_refuses_to_overwrite_a_non_bundle(cache: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    assert main(["compile", str(TINY_RECIPE), "-o", str(precious)]) == 2
    assert "exists and is not a bundle" in capsys.readouterr().err
    assert (precious / "notes.txt").read_text() == "keep me"


def test_ascend_target_writes_everything_up_to_atc(cache: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str], monkeypatch) -> None:  # noqa: ANN001
    """No CANN here: exit code 3, one message naming the step left and how to run it; no .om is ever written."""
    import onnx

    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # make sure no atc (real or fake) is found
    out = tmp_path / "asc"
    assert main(["compile", str(TINY_RECIPE), "-o", str(out), "--target", "ascend"]) == 3
    err = capsys.readouterr().err
    assert "complete up to the ATC step" in err and "`atc` is not on PATH" in err
    # the default ascend bundle (float16 on Ascend910B3) is in place: its OM comes from the RefData builder
    assert f"bash {out / 'ascend' / 'build.sh'}" in err
    assert "./refdata_build/omforge_refdata_build --model=step.onnx" in err
    m = load_manifest(out)
    assert m.target == "ascend" and m.kv.block_size == 128 and m.ascend is not None and m.ascend.atc == "left"
    assert m.ascend.paged_attention == "inplace" and m.ascend.ref_inputs[:2] == ("key_cache.0", "value_cache.0")
    assert [p.name for p in m.buckets.profiles] == ["prefill", "decode"]
    for rel in ("ascend/build.sh", "ascend/atc_commands.txt", "ascend/step.onnx",
                "ascend/plugins/CMakeLists.txt", "ascend/plugins/swi_glu_onnx_plugin.cc"):
        assert rel in m.files, rel
    assert not list(out.rglob("*.om")) and not (out / "ascend" / "fusion_switch.cfg").exists()
    step = onnx.load(str(out / "ascend" / "step.onnx"), load_external_data=False)
    assert [(o.domain, o.version) for o in step.opset_import] == [("", 18)]
    assert {n.domain for n in step.graph.node} == {""}
    assert [o.name for o in step.graph.output] == ["logits"]  # no kv_new, no pool among the outputs
    commands = (out / "ascend" / "atc_commands.txt").read_text().splitlines()
    assert len(commands) == 1 and all("--soc_version=Ascend910B3" in c and "--input_format=ND" in c for c in commands)
    assert m.ascend.model == "ascend/om/step" and m.ascend.memory.om_models == 1


def test_stage_key_covers_every_module_the_stage_runs() -> None:
    """Issue 12 defect 6: the ascend passes stage also runs compile/ascend/stages.py (and what it imports of compile/);
    an edit there must not reuse a stale stage."""
    from omforge.compile.compiler import _ROOT, stage_sources

    ascend, ort = stage_sources("ascend"), stage_sources("ort")
    for name in ("ascend/stages.py", "ascend/atc.py", "ascend/refdata_build.py", "bucket_plan.py"):
        assert _ROOT / "compile" / name in ascend and _ROOT / "compile" / name not in ort
    for f in (_ROOT / "passes" / "lower_ort.py", _ROOT / "passes" / "ascend" / "lower.py",
              _ROOT / "contract" / "buckets.py"):
        assert f in ascend and f in ort
    assert all(f.is_file() for f in ascend)
