"""scripts/ascend-first-run.sh and its driver cannot run here (no NPU, no CANN): the script must parse, and the driver
must import and refuse in one line without pyACL, before touching any bundle."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_first_run_script_parses_and_refuses_without_pyacl(tmp_path: Path) -> None:
    subprocess.run(["bash", "-n", str(ROOT / "scripts" / "ascend-first-run.sh")], check=True)
    driver = ROOT / "scripts" / "ascend_first_run.py"
    run = subprocess.run([sys.executable, str(driver), "r.yaml", str(tmp_path / "ort"), f"inplace={tmp_path}"],
                         capture_output=True, text=True, check=False)
    assert run.returncode == 2 and run.stderr.strip().startswith("ascend_first_run: pyACL (`import acl`) is not")
    assert len(run.stderr.strip().splitlines()) == 1 and not (tmp_path / "ort").exists()
    usage = subprocess.run([sys.executable, str(driver), "only-one"], capture_output=True, text=True, check=False)
    assert usage.returncode == 2 and usage.stderr.startswith("usage: python scripts/ascend_first_run.py")
    script = subprocess.run(["bash", str(ROOT / "scripts" / "ascend-first-run.sh")], capture_output=True, text=True,
                            check=False, env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable})
    assert script.returncode == 2 and "pyACL (import acl) is not importable" in script.stderr
