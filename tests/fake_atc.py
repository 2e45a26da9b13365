"""FAKE atc and FAKE RefData builder, for tests only — they compile nothing and are neither CANN's ATC nor CANN's IR
build API.

``run`` takes the exact argv omforge writes (``ascend/atc_commands.txt``): an ``atc`` command, or for an in-place
bundle the RefData builder's (``./refdata_build/omforge_refdata_build``, :mod:`omforge.compile.ascend.refdata_build`).
It refuses it as CANN would when any of CANN's rules in :mod:`omforge.compile.ascend.atc_conformance` breaks (each rule
cites CANN's source there: gears, dims cap, the op matrix, ref inputs, tiling sink only on Atlas A2/A3/310P with
static gears per ``--tiling_schedule_optimize.md:3-42``), and otherwise writes a FAKE ``.om``: a JSON pointer to the
plain-op twin of the step graph with what the real OM would carry from the command — the inputs ``--input_shape``
listed, in that order, the ``--dynamic_dims`` gears, and ``ref_inputs``: the inputs the builder declared ``RefData``
(empty for atc, which cannot) — for ``tests/fake_acl.py`` to load. ``flip=False`` writes the same OM as if the
builder had left its inputs plain ``Data``: the fake pyACL then drops what the ref ops wrote (GE's Identity copy),
so a test shows the write is lost without the flip. Like ATC for a model with dynamic-shape parts (hicann/ge
``model_helper.cc``), it names the file ``<output>_linux_x86_64.om`` unless told otherwise, so a loader that expects
``<output>.om`` fails.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from omforge.compile.ascend.atc import graph_interface
from omforge.compile.ascend.atc_conformance import Command, check_command, parse_dynamic_dims, parse_input_shape
from omforge.compile.ascend.refdata_build import REF_INPUTS_FLAG, TILING_FLAG, is_builder

DEFAULT_SUFFIX = "_linux_x86_64"


class FakeAtcError(Exception):
    """What ATC (or the IR build) would refuse: every broken rule, one per line."""


def run(argv: list[str], cwd: Path, twin: Path, suffix: str = DEFAULT_SUFFIX, flip: bool = True) -> Path:
    """Check ``argv`` against CANN's rules and write the FAKE OM; returns its path. ``twin``: the plain-op graph
    with the same interface as ``--model`` (checked; its outputs ``<input>.ref`` are the twin's record of ref-op
    writes and have no OM counterpart) that the fake pyACL runs. ``flip``: for a builder command, whether the OM
    declares ``--ref_inputs`` RefData (False: the same OM with every input a plain Data)."""
    broken = [r for r in check_command(argv, cwd) if not r.ok]
    if broken:
        raise FakeAtcError("\n".join(r.line() for r in broken))
    cmd = Command(tuple(argv), Path(cwd))
    flags = cmd.flags()
    if graph_interface(cmd.path("--model")) != graph_interface(twin, drop_ref_outputs=True):
        raise FakeAtcError(f"the twin {twin} has another interface than {cmd.path('--model')}")
    refs = flags[REF_INPUTS_FLAG].split(",") if is_builder(argv) and flip else []
    prefix = cmd.path("--output")
    om = prefix.with_name(prefix.name + suffix + ".om")
    om.parent.mkdir(parents=True, exist_ok=True)
    om.write_text(json.dumps({
        "fake_om": True, "note": "FAKE OM for tests/fake_acl.py, not an ATC output", "onnx": str(twin),
        "input_shape": parse_input_shape(flags["--input_shape"]), "gears": parse_dynamic_dims(flags["--dynamic_dims"]),
        "soc_version": flags["--soc_version"], "ref_inputs": refs,
        "built_by": "refdata_build" if is_builder(argv) else "atc",
        "tiling_schedule_optimize": flags.get(TILING_FLAG, "0")}))
    return om


def build_bundle(bundle: Path, twin: Path, suffix: str = DEFAULT_SUFFIX, flip: bool = True) -> list[Path]:
    """Run every command of ``bundle/ascend/atc_commands.txt`` from ``bundle/ascend`` (as build.sh does);
    ``flip`` as in :func:`run`."""
    asc = Path(bundle) / "ascend"
    lines = (asc / "atc_commands.txt").read_text().splitlines()
    return [run(shlex.split(line), asc, twin, suffix, flip) for line in lines if line.strip()]
