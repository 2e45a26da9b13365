"""The Ascend toolchain step: exact ``atc`` command lines and the bundle's ``build.sh``; ``atc`` itself runs only
where it is on PATH (reference/ascend.md §1). Our ONNX parser plugins are rendered by
:mod:`omforge.compile.ascend.atc_plugins`; the rules CANN applies to what we write are checked by
:mod:`omforge.compile.ascend.atc_conformance`.

One ATC model per bundle, ``step`` (``AtcModelSpec``), whose gears cover every bucket profile (prefill chunks
and decode batches) over the common step dims, so the weights are loaded on the device once (each loaded OM
allocates its own weight memory, §5.1). Its command line (§1.1–1.5)::

  atc --model=step.onnx --framework=5 --output=om/step --soc_version=<compile.soc_version> --input_format=ND
      --input_shape="input_ids:1,-1;position_ids:1,-1;block_tables:-1,-1;query_index:-1,-1;token_index:-1;
      logits_indices:-1" --dynamic_dims="128,128,1,4,1,128,128,1;…" --precision_mode=<…> --log=error

``--input_shape`` lists only the graph inputs with a dim a gear sets (``-1``): "all dynamic nodes must be set"
(hicann/ge ``CheckAndParseDynamicData``), and the dims list a gear model carries at run time is built from the
listed inputs, static dims included, capped at 128 (``ACL_MAX_DIM_CNT``, hicann/ge ``model_om2.cpp``; §3.4) —
so the KV pool, static in the graph, is left out. A gear gives one value per *dynamic dim* (``dim_order``);
``--dynamic_dims`` repeats that value at each ``-1`` the dim occupies, in input order then dim order (§1.3).
ATC writes ``<output>.om``, or ``<output>_<os>_<cpu>.om`` for a model with dynamic-shape parts (hicann/ge
``model_helper.cc``; §5.1): :func:`find_om` looks for ``<output>*.om``.

Decisions and known limits:

* ``--out_nodes`` is not emitted: it only sets or limits the model outputs and their order (§1.5); the ONNX
  parser keeps the graph's output order (Ascend/parser ``onnx_parser.cc`` GetGraphOutputs), which is what the
  runtime matches by index (``logits``, and ``kv_new`` in the gather mode; an in-place bundle has no ``kv_new``).
* No ``--fusion_switch_file``: our recipe switches (``compile.fusions``) drive OUR passes, whose result is already
  in the ONNX graph (the manifest records them); no CANN pass is known to re-fuse or split what we chose, and a
  switch file is not neutral — its entries take precedence over CANN's defaults, and its JSON form admits only
  the first-level keys ``Switch`` and ``Priority`` (hicann/ge ``fusion_config_parser.cc``; §1.5).
* Older ATC docs allow at most 4 dynamic dims per gear; current docs (8.0+) state no such limit. The step
  graph has 8 ``-1`` per gear. [unverified] on CANN releases before 8.0.
* Plugins (§1.7, §2.2): one C++ ONNX parser plugin per op type the lowering marks ``own_plugin``, each mapping
  ``ai.onnx::<opset>::<op>`` to a GE op and copying the node's attributes (ATC hands a
  ``ParseParamsByOperatorFn`` plugin the ONNX attributes as one JSON string attribute named ``attribute``:
  Ascend/parser ``Message2Operator`` + ``Pb2Json``, and CANN's plugin development guide). They build into
  ``libcust_onnx_parsers.so``, installed as the OPP vendor ``omforge``. None was compiled against a real CANN
  toolkit here (no CANN, no hardware): the tests compile them against stub headers (tests/stubs/) and a real
  nlohmann/json. No op needs a kernel of ours: the in-place paged attention's OmScatterPaKvCache and
  OmFusedInferAttentionScore map to CANN's GE ops ScatterPaKvCache and FusedInferAttentionScore
  (passes/ascend/lower.py; their kernels ship for 910B / 910_93 only, passes/ascend/kernels.py).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from omforge.compile.ascend.render import (
    AtcError,
)
from omforge.compile.ascend.render import quote as _quote
from omforge.contract import ascend as ascend_contract
from omforge.errors import OmforgeError
from omforge.recipe import CompileSection

ATC = "atc"
FRAMEWORK_ONNX = 5
MIN_GEARS, MAX_GEARS = 2, 100  # --dynamic_dims takes (1, 100] gears (reference/ascend.md §1.3)

_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_INPUT_NAME = re.compile(r"[^\s:;,\"'$`\\]+")  # ATC's --input_shape separators and shell-special characters
_SOC = re.compile(r"Ascend[A-Za-z0-9_]+")


class AtcMissing(OmforgeError):
    """``atc`` is not on PATH: everything up to the ATC step is written, the step itself is left.

    ``str(err)`` names the step and the commands that run it; ``commands`` holds them as argv lists."""

    def __init__(self, commands: Sequence[Sequence[str]], script: Path | None = None):
        self.commands = [list(c) for c in commands]
        self.script = script
        run = f"run `bash {script}` there, or the ATC commands: " if script else "run: "
        super().__init__("the ATC step (ONNX -> OM) is left: `atc` is not on PATH (install the CANN toolkit and "
                         f"source its set_env.sh); {run}{' && '.join(render_command(c) for c in commands)}")


@dataclass(frozen=True)
class AtcModelSpec:
    """One OM model to build: a step graph and the gears it is compiled for.

    ``input_shapes``: every graph input in graph order; a dim is a static size (int) or the name of a dynamic
    dim listed in ``dim_order`` (it becomes ``-1``). ``gears``: one tuple per gear, a value per ``dim_order``
    name. Invariants (checked on construction, :class:`AtcError` otherwise): 2..100 distinct gears of positive
    sizes, each as long as ``dim_order``; every dynamic dim is used by some input and every symbolic dim is in
    ``dim_order``; names are safe in ATC's ``name:d0,d1;…`` syntax and as a file name.
    """

    name: str
    onnx_path: Path
    input_shapes: dict[str, list[int | str]]
    gears: list[tuple[int, ...]]
    dim_order: list[str]

    def __post_init__(self) -> None:
        where = f"ATC model '{self.name}'"
        if not _NAME.fullmatch(self.name):
            raise AtcError(f"ATC model name {self.name!r}: use letters, digits, '_', '.', '-' (it names the .om)")
        if not self.input_shapes:
            raise AtcError(f"{where}: no graph inputs given")
        if not self.dim_order or len(set(self.dim_order)) != len(self.dim_order):
            raise AtcError(f"{where}: dim_order {self.dim_order} must name each dynamic dim once")
        for name, dims in self.input_shapes.items():
            if not _INPUT_NAME.fullmatch(name):
                raise AtcError(f"{where}: input name {name!r} contains a character ATC's --input_shape or the "
                               "shell cannot take (whitespace : ; , quotes $ ` \\)")
            for d in dims:
                if isinstance(d, str):
                    if d not in self.dim_order:
                        raise AtcError(f"{where}: input '{name}' has dim '{d}', which is not in dim_order "
                                       f"{self.dim_order}; give it a static size or add it to the gears")
                elif isinstance(d, bool) or not isinstance(d, int) or d < 1:
                    raise AtcError(f"{where}: input '{name}' has dim {d!r}; a static dim is a positive integer")
        unused = [d for d in self.dim_order if d not in self.dynamic_dims()]
        if unused:
            raise AtcError(f"{where}: dynamic dim(s) {unused} are in dim_order but no input uses them")
        if not MIN_GEARS <= len(self.gears) <= MAX_GEARS:
            raise AtcError(f"{where}: {len(self.gears)} gear(s); ATC's --dynamic_dims takes {MIN_GEARS} to "
                           f"{MAX_GEARS} (a single shape needs no gears: make its dims static)")
        for i, gear in enumerate(self.gears):
            if len(gear) != len(self.dim_order):
                raise AtcError(f"{where}: gear {i} {tuple(gear)} has {len(gear)} value(s); each gear gives one "
                               f"value per dynamic dim {tuple(self.dim_order)} ({len(self.dim_order)} values)")
            if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in gear):
                raise AtcError(f"{where}: gear {i} {tuple(gear)}: every value must be a positive integer")
        if len(set(map(tuple, self.gears))) != len(self.gears):
            raise AtcError(f"{where}: duplicate gears in {[tuple(g) for g in self.gears]}")

    def dynamic_dims(self) -> list[str]:
        """The dynamic dim behind each ``-1`` of ``--input_shape``, in input order then dim order."""
        return [d for dims in self.input_shapes.values() for d in dims if isinstance(d, str)]

    def input_shape_arg(self) -> str:
        """``--input_shape``'s value: ``name:d0,d1;…`` with ``-1`` where a gear sets the dim."""
        return ";".join(f"{name}:{','.join('-1' if isinstance(d, str) else str(d) for d in dims)}"
                        for name, dims in self.input_shapes.items())

    def dynamic_dims_arg(self) -> str:
        """``--dynamic_dims``'s value: gears separated by ``;``, one value per ``-1`` in each."""
        index = {d: i for i, d in enumerate(self.dim_order)}
        slots = [index[d] for d in self.dynamic_dims()]
        return ";".join(",".join(str(gear[i]) for i in slots) for gear in self.gears)


def graph_interface(path: Path, drop_ref_outputs: bool = False) -> list[tuple[str, int, list[int | str]]]:
    """A graph's inputs and outputs (weights excluded, read without them): name, element type, dims — what an OM
    built from it and its plain-op twin must agree on. ``drop_ref_outputs``: leave out the outputs named
    ``<input>`` + :data:`~omforge.contract.ascend.REF_SUFFIX` (a twin's record of what a ref op wrote into an input;
    the OM has no such output)."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    weights = {t.name for t in graph.initializer}
    outputs = [v for v in graph.output
               if not (drop_ref_outputs and v.name.endswith(ascend_contract.REF_SUFFIX))]
    return [(v.name, v.type.tensor_type.elem_type,
             [d.dim_value if d.HasField("dim_value") else d.dim_param for d in v.type.tensor_type.shape.dim])
            for v in [*graph.input, *outputs] if v.name not in weights]


def input_shapes_from_onnx(onnx_path: Path, dims: Mapping[str, int | str]) -> dict[str, list[int | str]]:
    """The graph inputs of ``onnx_path`` (weights not loaded) with each symbolic dim replaced by ``dims[symbol]``:
    an int fixes it (e.g. ``num_slots``, ``num_seqs=1`` for prefill), a str names the gear dim it follows
    (e.g. ``num_tokens -> "chunk_len"``)."""
    import onnx

    try:
        graph = onnx.load(str(onnx_path), load_external_data=False).graph
    except Exception as e:  # a missing file or a protobuf that does not parse: say which file
        raise AtcError(f"{onnx_path}: cannot read the ONNX graph: {e}") from None
    weights = {t.name for t in graph.initializer}
    shapes: dict[str, list[int | str]] = {}
    for value in graph.input:
        if value.name in weights:
            continue
        out: list[int | str] = []
        for d in value.type.tensor_type.shape.dim:
            if d.HasField("dim_value"):
                out.append(int(d.dim_value))
            elif d.HasField("dim_param") and d.dim_param in dims:
                out.append(dims[d.dim_param])
            else:
                symbol = d.dim_param or "?"
                raise AtcError(f"{onnx_path}: input '{value.name}' has dim '{symbol}' with no size or gear dim "
                               f"given (known: {', '.join(sorted(dims)) or 'none'})")
        shapes[value.name] = out
    return shapes


def atc_command(spec: AtcModelSpec, compile: CompileSection, out_dir: Path) -> list[str]:
    """The exact argv that builds ``<out_dir>/<spec.name>*.om``. Paths are written as given (build.sh runs from
    its own folder, so give them relative to it there)."""
    if not _SOC.fullmatch(compile.soc_version):
        raise AtcError(f"compile.soc_version: {compile.soc_version!r} is not an ATC SoC name ('Ascend' + the chip "
                       "name npu-smi reports, e.g. Ascend910B3, Ascend310P3, Ascend910_9392)")
    return [
        ATC,
        f"--model={spec.onnx_path}",
        f"--framework={FRAMEWORK_ONNX}",
        f"--output={out_dir / spec.name}",
        f"--soc_version={compile.soc_version}",
        "--input_format=ND",
        f"--input_shape={spec.input_shape_arg()}",
        f"--dynamic_dims={spec.dynamic_dims_arg()}",
        f"--precision_mode={compile.precision_mode}",
        "--log=error",
    ]


def output_prefix(argv: Sequence[str]) -> Path:
    """The ``--output`` prefix of an atc command: it writes ``<prefix>.om`` or ``<prefix>_<os>_<cpu>.om``."""
    for arg in argv:
        if arg.startswith("--output="):
            return Path(arg.removeprefix("--output="))
    raise AtcError(f"not an atc command with --output: {render_command(argv)}")


def find_om(prefix: Path) -> Path | None:
    """:func:`omforge.contract.ascend.find_om`, a name clash as :class:`AtcError`."""
    try:
        return ascend_contract.find_om(prefix)
    except ascend_contract.OmNameClash as e:
        raise AtcError(str(e)) from None



def render_command(argv: Sequence[str]) -> str:
    """One shell line that runs ``argv`` (``shlex.split`` gives ``argv`` back)."""
    return " ".join(_quote(a) for a in argv)


# --- running ATC ------------------------------------------------------------------------------------------------


def run_atc(commands: Sequence[Sequence[str]], log_dir: Path, cwd: Path | None = None,
            script: Path | None = None) -> list[Path]:
    """Run each atc command (relative paths in them are relative to ``cwd``, default the current directory),
    output in ``<log_dir>/atc-<name>.log`` and ATC's ``fusion_result.json`` kept as
    ``<log_dir>/<name>.fusion_result.json``; returns the .om paths (:func:`find_om`). Raises :class:`AtcMissing`
    (naming ``script`` and the commands) when ``atc`` is not on PATH, :class:`AtcError` naming the log when a run
    fails or leaves no .om. Never writes an .om itself."""
    if shutil.which(ATC) is None:
        raise AtcMissing(commands, script)
    base = (cwd or Path.cwd()).resolve()
    log_dir.mkdir(parents=True, exist_ok=True)
    built = []
    for argv in commands:
        prefix = base / output_prefix(argv)  # an absolute --output stays as it is
        name = prefix.name
        log = log_dir / f"atc-{name}.log"
        prefix.parent.mkdir(parents=True, exist_ok=True)
        while (stale := find_om(prefix)) is not None:  # a stale .om must not pass for this run's
            stale.unlink()
        with log.open("wb") as f:
            f.write(f"$ {render_command(argv)}\n".encode())
            f.flush()
            rc = subprocess.run(list(argv), stdout=f, stderr=subprocess.STDOUT, cwd=base, check=False).returncode
        result = base / "fusion_result.json"
        if result.is_file():
            result.replace(log_dir / f"{name}.fusion_result.json")
        if rc != 0:
            raise AtcError(f"atc failed for model '{name}' (exit {rc}); see {log}{_last_line(log)}")
        om = find_om(prefix)
        if om is None:
            raise AtcError(f"atc exited 0 for model '{name}' but wrote no {prefix}*.om; see {log}")
        built.append(om)
    return built


def _last_line(log: Path) -> str:
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    return f": {lines[-1][:300]}" if len(lines) > 1 else ""
