"""FAKE atc, for tests only — it compiles nothing and is not CANN's ATC.

It takes the exact argv omforge writes (``ascend/atc_commands.txt``), refuses it as ATC would when any of CANN's
rules in :mod:`omforge.compile.atc_conformance` breaks (each rule cites CANN's source there), and otherwise writes
a FAKE ``.om``: a JSON pointer to the plain-op twin of the step graph with what the real OM would carry from the
command — the inputs ``--input_shape`` listed, in that order, and the ``--dynamic_dims`` gears — for
``tests/fake_acl.py`` to load. Like ATC for a model with dynamic-shape parts (hicann/ge ``model_helper.cc``), it
names the file ``<output>_linux_x86_64.om`` unless told otherwise, so a loader that expects ``<output>.om`` fails.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from omforge.compile.atc import graph_interface
from omforge.compile.atc_conformance import Command, check_command, parse_dynamic_dims, parse_input_shape

DEFAULT_SUFFIX = "_linux_x86_64"


class FakeAtcError(Exception):
    """What ATC would refuse: every broken rule, one per line."""



def run(argv: list[str], cwd: Path, twin: Path, suffix: str = DEFAULT_SUFFIX) -> Path:
    """Check ``argv`` against CANN's rules and write the FAKE OM; returns its path. ``twin``: the plain-op graph
    with the same interface as ``--model`` (checked) that the fake pyACL runs."""
    broken = [r for r in check_command(argv, cwd) if not r.ok]
    if broken:
        raise FakeAtcError("\n".join(r.line() for r in broken))
    cmd = Command(tuple(argv), Path(cwd))
    flags = cmd.flags()
    if graph_interface(cmd.path("--model")) != graph_interface(twin):
        raise FakeAtcError(f"the twin {twin} has another interface than {cmd.path('--model')}")
    prefix = cmd.path("--output")
    om = prefix.with_name(prefix.name + suffix + ".om")
    om.parent.mkdir(parents=True, exist_ok=True)
    om.write_text(json.dumps({
        "fake_om": True, "note": "FAKE OM for tests/fake_acl.py, not an ATC output", "onnx": str(twin),
        "input_shape": parse_input_shape(flags["--input_shape"]), "gears": parse_dynamic_dims(flags["--dynamic_dims"]),
        "soc_version": flags["--soc_version"]}))
    return om


def build_bundle(bundle: Path, twin: Path, suffix: str = DEFAULT_SUFFIX) -> list[Path]:
    """Run every command of ``bundle/ascend/atc_commands.txt`` from ``bundle/ascend`` (as build.sh does)."""
    asc = Path(bundle) / "ascend"
    return [run(shlex.split(line), asc, twin, suffix) for line in (asc / "atc_commands.txt").read_text().splitlines()
            if line.strip()]
