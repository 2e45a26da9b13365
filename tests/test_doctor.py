"""`omforge doctor`: a correct picture of this machine (only the ort target runs here), as a table and as JSON,
and what it reports when a CANN toolkit is (partly) present."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import onnxruntime as ort


def doctor(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "omforge", "doctor", *args], capture_output=True, text=True,
                          timeout=120, env=env)


def test_doctor_says_only_ort_runs_here() -> None:
    r = doctor("--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["packages"]["onnxruntime"] == ort.__version__
    assert report["onnxruntime_providers"] == ort.get_available_providers()
    t = report["targets"]
    assert t["ort"] == {"compile": True, "run": True, "why": "onnxruntime CPU"}
    assert t["ascend"]["run"] is False and "pyACL" in t["ascend"]["why"]
    assert t["ort-cuda"]["run"] == ("CUDAExecutionProvider" in ort.get_available_providers())
    assert report["pyacl"]["importable"] is False and report["npus"]["count"] == 0
    from omforge.runtime.ort import kernels

    k = kernels.status()
    assert report["kernels"]["gemm"] == (k.gemm if k.available else None)  # which MatMulQ path int4 bundles take
    assert report["kernels"]["qbf16"] == (k.qbf16 if k.available else None)  # activations: bfloat16's op
    table = doctor()
    assert table.returncode == 0
    assert "this machine runs: ort" in table.stdout.splitlines()[-1]
    assert any(line.split()[:3] == ["ascend", "no", "no"] for line in table.stdout.splitlines())


def test_doctor_reports_a_toolkit_on_path(tmp_path: Path) -> None:
    """A FAKE `atc` script and toolkit folder (just files): doctor finds them; running still needs pyACL + NPU."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    atc = bin_dir / "atc"
    atc.write_text("#!/bin/sh\necho fake atc\n")
    atc.chmod(0o755)
    home = tmp_path / "ascend-toolkit" / "latest"
    home.mkdir(parents=True)
    (home / "version.cfg").write_text("# fake toolkit for the doctor test\nversion=8.0.RC3\n")
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "ASCEND_TOOLKIT_HOME": str(home),
           "ASCEND_OPP_PATH": str(home / "opp")}
    report = json.loads(doctor("--json", env=env).stdout)
    from omforge.contract.ascend import CANN_RELEASE

    line = (f"CANN 8.0.RC3 is older than {CANN_RELEASE}, the release omforge's Ascend path targets: ops, ONNX plugins "
            "and options it relies on may be missing")
    assert report["cann"] == {"atc": str(atc), "version": "8.0.RC3", "ASCEND_OPP_PATH": str(home / "opp"),
                              "set_env_sourced": True, "targets": CANN_RELEASE, "older": True, "release": line}
    assert line in doctor(env=env).stdout  # the table says it in one line
    assert report["targets"]["ascend"]["compile"] is True
    assert report["targets"]["ascend"]["run"] is False


def test_doctor_advises_bf16_activations_only_where_the_tile_unit_runs_them() -> None:
    """The advice line follows the kernel library's MatMulQBF16 path: AMX (batched int4 measured 1.28–1.47× with
    bfloat16 activations there, docs/weights.md) and nowhere else; the real report of this machine, then the same
    report with the path replaced."""
    from omforge import doctor as doc

    report = doc.gather()
    for path, advised in (("amx-bf16", True), ("avx512-bf16", False), (None, False)):
        report["kernels"]["qbf16"] = path
        text = doc.render(report)
        assert ("compile.quantization.activations: bfloat16" in text) is advised, path


def test_doctor_reads_the_toolkit_version_where_cann_documents_it(tmp_path: Path) -> None:
    """``<toolkit>/<arch>-linux/ascend_toolkit_install.info``'s ``version=`` (hicann/ge docs/en/build.md:11-14), before
    the compiler package's ``share/info/ge-compiler/version.info`` ``Version=`` (cmake/package.cmake:63-66)."""
    import platform

    from omforge import doctor as doc
    from omforge.contract.ascend import CANN_RELEASE

    home = tmp_path / "cann"
    (home / "share" / "info" / "ge-compiler").mkdir(parents=True)
    (home / "share" / "info" / "ge-compiler" / "version.info").write_text("Version=9.0.0\nversion_dir=9.0.0\n")
    env = {"ASCEND_TOOLKIT_HOME": str(home), "PATH": ""}
    assert doc.gather(env)["cann"]["version"] == "9.0.0" and doc.gather(env)["cann"]["older"] is True
    (home / f"{platform.machine()}-linux").mkdir()
    (home / f"{platform.machine()}-linux" / "ascend_toolkit_install.info").write_text(
        f"package_name=Ascend-cann-toolkit\nversion={CANN_RELEASE}\narch={platform.machine()}\nos=linux\n")
    cann = doc.gather(env)["cann"]
    assert cann["version"] == CANN_RELEASE and cann["older"] is False and "not older" in cann["release"]
    keys = [doc.release_key(v) for v in ("8.0.RC3", "8.5.0.alpha001", "8.5.0", "9.1.RC1", "9.1.0", "9.1.1", "9.2.0")]
    assert keys == sorted(keys) and len(set(keys)) == len(keys)
    assert doc.release_key("latest") is None and "cannot compare" in doc.release_line("latest")
