"""``omforge diff``: histograms, fused-region provenance, numeric parity, the per-fusion sweep, the three
output formats and the exit codes (0 within tol, 1 over it, 2 on bad input)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from helpers import TINY_RECIPE
from omforge.cli import main
from omforge.compile import ort
from omforge.recipe import FUSIONS


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "omforge", "diff", *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from omforge.export.onnx_export import export_recipe
    from omforge.recipe import load_recipe

    out = tmp_path_factory.mktemp("diff-export")
    export_recipe(load_recipe(TINY_RECIPE), out, quiet=True)
    return out


@pytest.fixture(scope="module")
def fused(export: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ort.PassReport]:
    """The pipeline's fused graph of the export, with its report (fused.json) beside it."""
    path = tmp_path_factory.mktemp("diff-fused") / "fused.onnx"
    return path, ort.build(export, path)


@pytest.fixture(scope="module")
def perturbed(export: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the unfused graph with one weight nudged: same ops, different numbers."""
    model = onnx.load(str(export / "model.onnx"))
    init = next(i for i in model.graph.initializer if i.name.endswith("down_proj.weight.T"))
    w = numpy_helper.to_array(init).copy()
    w[0, 0] += 0.5
    init.CopyFrom(numpy_helper.from_array(w, init.name))
    path = tmp_path_factory.mktemp("diff-perturbed") / "perturbed.onnx"
    onnx.save(model, str(path), save_as_external_data=True, location="perturbed.onnx.data")
    return path


def diff_json(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict]:
    capsys.readouterr()
    code = main(["diff", *args, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_terminal_lists_every_fusion(export: Path, fused: tuple[Path, ort.PassReport],
                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["diff", str(export)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    counts = fused[1].fusion_counts
    assert all(counts[f] > 0 for f in FUSIONS if f != "moe")  # a dense model: no MoE block
    for name in FUSIONS:
        row = next(line for line in lines if line.startswith(f"{name} "))
        assert int(row.split()[1]) == counts[name]
    for op in ("RMSNormalization", "com.microsoft::SkipSimplifiedLayerNormalization", "RotaryEmbedding", "Attention"):
        assert any(line.startswith(op + " ") for line in lines), op
    assert "total nodes (≈ kernel launches)" in out and "nodes per decoder layer" in out
    assert "MatMul, Split ← MatMul×3" in out  # a merged QKV projection and the three it replaced
    assert lines[-1].startswith("PASS: max abs drift")


def test_json_has_histograms_regions_and_drift(export: Path, fused: tuple[Path, ort.PassReport],
                                               capsys: pytest.CaptureFixture[str]) -> None:
    code, d = diff_json(capsys, str(export), "--seq", "16", "--batch", "2", "--seed", "3")
    assert code == 0 and d["passed"] is True
    s = d["structure"]
    hist_b = {row["op"]: row["b"] for row in s["ops"] if row["b"]}
    assert hist_b == fused[1].op_histogram and s["total_b"] == fused[1].num_nodes
    assert s["total_a"] == json.loads((export / "export.json").read_text())["num_nodes"]
    assert {"Attention", "RotaryEmbedding", "RMSNormalization"} <= set(s["new_ops"])
    assert [c["layer"] for c in s["layers"]] == [0, 1] and all(c["b"] < c["a"] for c in s["layers"])
    (logits,) = d["parity"]
    assert logits["name"] == "logits" and logits["shape"] == [2, 16, 256]
    assert logits["max_abs"] < 1e-4 and logits["top1_agree"] == logits["rows"] == 32
    assert d["options"] == {"seq": 16, "batch": 2, "seed": 3, "tol": 1e-3, "per_fusion": False}

    prov = d["provenance"]
    assert prov["available"] is True
    fusions = {f["name"]: f for f in prov["fusions"]}
    assert [f["name"] for f in prov["fusions"]] == list(FUSIONS)
    assert {n: f["matches"] for n, f in fusions.items()} == fused[1].fusion_counts
    # Every AddRMSNorm took in one of the RMSNorm matches; the rest (the first layer's) stay RMSNorms.
    counts = fused[1].fusion_counts
    assert fusions["rms_norm"]["absorbed_by"] == {"add_rms_norm": counts["add_rms_norm"]}
    assert len(fusions["rms_norm"]["regions"]) == counts["rms_norm"] - counts["add_rms_norm"]
    for region in fusions["add_rms_norm"]["regions"]:
        assert region["fused"] == ["com.microsoft::SkipSimplifiedLayerNormalization"]
        assert sorted(op for op, _, _ in region["replaced"]) == sorted(
            ["Add", "Add", "Pow", "ReduceMean", "Sqrt", "Reciprocal", "Mul", "Mul"])
        assert region["absorbed"] == ["rms_norm"]
    for layer, region in enumerate(fusions["qkv_merge"]["regions"]):
        assert region["fused"] == ["MatMul", "Split"]
        assert [scope for _, _, scope in region["replaced"]] == [
            f"model.layers.{layer}.self_attn.{p}_proj" for p in "qkv"]
    for region in fusions["attention"]["regions"]:
        assert (region["fused"] == ["Attention"]
                and {"Softmax", "Where", "Expand"} <= {op for op, _, _ in region["replaced"]})
    # Regions are disjoint and name real nodes of A.
    names_a = {n.name for n in onnx.load(str(export / "model.onnx"), load_external_data=False).graph.node}
    replaced = [name for f in prov["fusions"] for r in f["regions"] for _, name, _ in r["replaced"]]
    assert len(replaced) == len(set(replaced)) and set(replaced) <= names_a


def test_html_report(export: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    page = tmp_path / "diff.html"
    assert main(["diff", str(export), "--html", str(page)]) == 0
    assert f"HTML report: {page}" in capsys.readouterr().out
    html = page.read_text()
    assert "<table>" in html and "<th>op type</th>" in html and "PASS" in html
    for name in FUSIONS:
        assert name in html
    assert "SkipSimplifiedLayerNormalization" in html and "model.layers.1.self_attn" in html


def test_per_fusion_sweep(export: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, d = diff_json(capsys, str(export), "--per-fusion")
    assert code == 0
    rows = {r["fusion"]: r for r in d["per_fusion"]}
    assert list(rows) == [*FUSIONS, "all"]
    for name in FUSIONS:
        assert rows[name]["matches"] > 0 or name == "moe", name
        assert rows[name]["max_abs"] < 1e-4 and rows[name]["passed"], rows[name]
        assert rows[name]["nodes"] <= d["structure"]["total_a"]  # gate_up_swiglu: 5 nodes → 5 on ORT CPU
    assert rows["add_rms_norm"]["enabled"] == ["rms_norm", "add_rms_norm"]
    assert rows["all"]["nodes"] == d["structure"]["total_b"]
    assert main(["diff", str(export), "--per-fusion"]) == 0
    out = capsys.readouterr().out
    assert "per-fusion drift on logits" in out and "add_rms_norm" in out


def test_two_onnx_files(export: Path, fused: tuple[Path, ort.PassReport], tmp_path: Path,
                        capsys: pytest.CaptureFixture[str]) -> None:
    code, d = diff_json(capsys, str(export / "model.onnx"), str(fused[0]))
    assert code == 0 and d["provenance"]["available"] and d["parity"][0]["max_abs"] < 1e-4
    # A B built with attention off: its report beside it says so, and the replay follows it.
    partial = tmp_path / "no-attention.onnx"
    ort.build(export, partial, fusions={"attention": False})
    code, d = diff_json(capsys, str(export / "model.onnx"), str(partial))
    fusions = {f["name"]: f for f in d["provenance"]["fusions"]}
    assert code == 0 and d["provenance"]["available"]
    assert fusions["attention"]["matches"] == 0 and not fusions["attention"]["regions"]
    assert len(fusions["rotary"]["regions"]) == 4 and "Attention" not in d["structure"]["new_ops"]


def test_drift_over_tol_exits_1(export: Path, perturbed: Path) -> None:
    out = run_cli(str(export / "model.onnx"), str(perturbed), "--tol", "0")
    assert out.returncode == 1, out.stderr
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("FAIL: max abs drift") and "exceeds tol 0" in last
    assert "nothing fused" in out.stdout


def test_unfused_copy_passes_at_default_tol_only_when_equal(export: Path, perturbed: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    code, d = diff_json(capsys, str(export / "model.onnx"), str(export / "model.onnx"), "--tol", "0")
    assert code == 0 and d["max_abs"] == 0.0
    code, d = diff_json(capsys, str(export / "model.onnx"), str(perturbed))
    assert code == 1 and not d["passed"] and d["verdict"].startswith("FAIL")
    assert all(row["a"] == row["b"] for row in d["structure"]["ops"])


def test_missing_file_exits_2(export: Path) -> None:
    out = run_cli(str(export / "model.onnx"), "/nonexistent/b.onnx")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == ["omforge: error: /nonexistent/b.onnx: no such file or directory"]


@pytest.mark.parametrize("args, message", [
    (["{a}"], "give an export directory, or two ONNX files A and B"),
    (["{a}", "{paged}"], "interfaces differ: "),
    (["{a}", "{a}", "--per-fusion"], "--per-fusion builds its graphs from an export"),
    (["{export}", "--seq", "0"], "--seq and --batch must be at least 1"),
    (["{export}", "--html", "/nonexistent/dir/x.html"], "/nonexistent/dir/x.html: its directory does not exist"),
    (["{recipe}", "{a}"], "not a readable ONNX model"),
])
def test_bad_input_exits_2(export: Path, tmp_path_factory: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str],
                           args: list[str], message: str) -> None:
    paged = tmp_path_factory.getbasetemp() / "diff-paged.onnx"
    if not paged.exists():
        ort.build(export, paged, block_size=16)
    fill = {"a": export / "model.onnx", "paged": paged, "export": export, "recipe": TINY_RECIPE}
    capsys.readouterr()
    assert main(["diff", *(a.format(**fill) for a in args)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("omforge: error: ") and message in err[0]


def test_relative_error_is_normwise() -> None:
    from omforge.diff.parity import drift

    ref = np.array([[[10.0, 0.0], [0.0, -5.0]]], np.float32)
    got = ref + np.array([[[0.0, 1e-3], [0.0, 0.0]]], np.float32)  # an error where A is 0 stays finite
    d = drift("logits", ref, got)
    assert d.max_abs == pytest.approx(1e-3) and d.max_rel == pytest.approx(1e-4)
    assert (d.top1_agree, d.rows) == (2, 2)
