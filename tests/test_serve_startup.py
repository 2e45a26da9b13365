"""``omforge serve`` refusing to start, as a stranger meets it (issue 46, findings 5, 6 and 8): through the real CLI
in a subprocess, each a single line ``omforge: error: …`` naming the flag, exit code 2 — a port in use before the
bundle is loaded (it was an ``OSError`` traceback after 7 s of loading and a 2 GiB pool), a host that does not
resolve (``gaierror``), a port past 65535 (``OverflowError``), ``--max-model-len`` outside 1 … the bundle's limit
(-5 started a server that refused everything, 0 was "unset", 999999 was capped silently), and ``compile -o`` naming
a file (``NotADirectoryError``)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def omforge(*args: str, timeout: float = 120) -> tuple[int, str, str, float]:
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "omforge", *args], capture_output=True, text=True, timeout=timeout)
    return r.returncode, r.stdout, r.stderr, time.monotonic() - t0


def assert_one_line(rc: int, out: str, err: str, *needles: str) -> None:
    lines = [line for line in (out + err).splitlines() if line.strip()]
    assert rc == 2, (rc, out, err)
    assert len(lines) == 1 and lines[0].startswith("omforge: error: "), lines
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_a_port_in_use_is_one_line_before_the_bundle_loads(smollm2_bundle: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        rc, out, err, _ = omforge("serve", str(smollm2_bundle), "--host", "127.0.0.1", "--port", str(port))
    assert_one_line(rc, out, err, "--port", str(port), "in use")
    assert "loaded in" not in out  # refused before loading, not after the pool was allocated


@pytest.mark.parametrize(("flags", "needles"), [
    (["--host", "no-such-host.invalid"], ["--host", "no-such-host.invalid"]),
    (["--port", "70000"], ["--port", "70000", "65535"]),
    (["--port", "-1"], ["--port"]),
    (["--max-model-len", "-5"], ["--max-model-len", "-5"]),
    (["--max-model-len", "0"], ["--max-model-len", "got 0"]),
    (["--max-model-len", "999999"], ["max_model_len", "999999", "compile.max_seq_len"]),
    (["--max-num-seqs", "0"], ["--max-num-seqs"]),
    (["--header-timeout", "0"], ["--header-timeout"]),
])
def test_start_up_errors_are_one_line_with_exit_2(smollm2_bundle: Path, flags: list[str],
                                                   needles: list[str]) -> None:
    args = ["serve", str(smollm2_bundle), *(["--port", "0"] if "--port" not in flags else []), *flags]
    rc, out, err, _ = omforge(*args)
    assert_one_line(rc, out, err, *needles)


def test_compile_into_a_file_is_one_line(tmp_path: Path) -> None:
    existing = tmp_path / "bundle.txt"
    existing.write_text("not a directory")
    for out in (existing, existing / "inside"):
        rc, stdout, stderr, seconds = omforge("compile", str(ROOT / "tests/recipes/tiny-llama.yaml"), "-o", str(out))
        assert_one_line(rc, stdout, stderr, "-o", str(existing), "is a file")
        assert "[export]" not in stdout + stderr  # refused before the export
