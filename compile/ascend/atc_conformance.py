"""CANN's rules for what we hand ATC and what ACL later reads back, checked without CANN.

Each rule is what CANN's own sources or docs state (cited per rule; the facts are collected in
reference/ascend.md §1.3–1.6, §3.4, §5.1), checked over the exact argv of an ``atc`` command, the ONNX graph it
names (read without weights: its ops, attribute forms and dtypes against :mod:`omforge.compile.ascend.cann_matrix`) and
the files it passes — or over the RefData builder's argv (:mod:`.refdata_build`: atc's flags without ``--framework``,
with ``--ref_inputs``), which the same rules fit, plus its own (ref inputs, IR options, tiling sink).
``omforge inspect`` runs them over an ascend bundle, and the tests' FAKE ``atc`` (tests/fake_atc.py) refuses any
command that breaks one — so an argv ATC would reject fails a test here. Passing them is necessary, not
sufficient: none of this has run against a real ATC or NPU.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from omforge.compile.ascend import cann_matrix, refdata_build
from omforge.compile.ascend.step_usage import uses
from omforge.contract.buckets import MAX_GEARS, MIN_GEARS

MAX_DIM_CNT = 128  # ACL_MAX_DIM_CNT: aclmdlIODims.dims is int64[128]
MAX_ONNX_OPSET = 18
SWITCH_KEYS = ("Switch", "Priority")
PRECISION_MODES = ("force_fp16", "force_fp32", "cube_fp16in_fp32out", "allow_fp32_to_fp16", "must_keep_origin_dtype",
                   "allow_mix_precision", "allow_mix_precision_fp16", "allow_mix_precision_bf16", "allow_fp32_to_bf16")
LOG_LEVELS = ("debug", "info", "warning", "error", "null")
REF, TILING = refdata_build.REF_INPUTS_FLAG, refdata_build.TILING_FLAG
BUILDER_FLAGS = ("--model", "--output", "--soc_version", "--input_format", "--input_shape", "--dynamic_dims",
                 "--precision_mode", "--log", REF, TILING)
"""The RefData builder's flags (atc's names; the template maps each to its ir_option)."""
_EXCLUSIVE_WITH_DIMS = ("--dynamic_batch_size", "--dynamic_image_size", "--input_shape_range", "--insert_op_conf")


@dataclass(frozen=True)
class RuleResult:
    """One rule over one command: ``ok``, or ``detail`` says what breaks it."""

    rule: str
    source: str
    ok: bool
    detail: str = ""

    def line(self) -> str:
        return f"{'ok  ' if self.ok else 'FAIL'} {self.rule}{'' if self.ok else ': ' + self.detail}  [{self.source}]"


@dataclass(frozen=True)
class Command:
    """An atc argv parsed the way ATC reads it: ``--flag=value`` pairs; ``cwd`` resolves relative paths."""

    argv: tuple[str, ...]
    cwd: Path

    def flags(self) -> dict[str, str]:
        return dict(a.split("=", 1) if "=" in a else (a, "") for a in self.argv[1:])

    def path(self, flag: str) -> Path | None:
        value = self.flags().get(flag)
        return None if value is None else (self.cwd / value)

    @cached_property
    def model(self):  # noqa: ANN201 - the --model's onnx.ModelProto without weights (read once), or None
        import onnx

        path = self.path("--model")
        if path is None or not path.is_file():
            return None
        return onnx.load(str(path), load_external_data=False)


def parse_input_shape(value: str) -> list[tuple[str, list[int]]]:
    """``name:d0,d1;name2:…`` → ``[(name, dims)]`` (``-1`` a gear-set dim; ``name:`` a scalar). Raises
    ``ValueError`` on what ATC's syntax does not allow (atlasatcparam_16_0016)."""
    out = []
    for part in value.split(";"):
        name, sep, dims = part.rpartition(":")
        if not sep or not name:
            raise ValueError(f"'{part}' is not name:dims")
        out.append((name, [int(d) for d in dims.split(",")] if dims else []))
    return out


def parse_dynamic_dims(value: str) -> list[list[int]]:
    """``g1a,g1b;g2a,g2b`` → the gears' values (atlasatcparam_16_0020)."""
    return [[int(v) for v in gear.split(",")] for gear in value.split(";")]


Rule = Callable[[Command], str | None]  # None: the rule holds; else what breaks it


def _framework(cmd: Command) -> str | None:
    value = cmd.flags().get("--framework")
    if refdata_build.is_builder(cmd.argv):  # aclgrphParseONNX reads the ONNX itself: no framework flag
        return None if value is None else f"--framework={value}: the RefData builder parses ONNX itself; drop it"
    return None if value == "5" else f"--framework={value}: an ONNX model needs --framework=5"


def _builder_flags(cmd: Command) -> str | None:
    if not refdata_build.is_builder(cmd.argv):
        return None
    unknown = sorted(set(cmd.flags()) - set(BUILDER_FLAGS))
    return f"flags {unknown} have no IR build option (it takes {', '.join(BUILDER_FLAGS)})" if unknown else None


def _ref_inputs(cmd: Command) -> str | None:
    flags = cmd.flags()
    if not refdata_build.is_builder(cmd.argv):
        return f"{REF} is the RefData builder's flag; atc has none (it cannot make a RefData)" if REF in flags else None
    names = flags.get(REF, "").split(",")
    if not flags.get(REF) or "" in names or len(set(names)) != len(names):
        return f"{REF}={flags.get(REF, '')!r}: name each in-place input once"
    model = cmd.model
    if model is None:
        return "no readable --model"
    weights = {t.name for t in model.graph.initializer}
    inputs = {v.name: v for v in model.graph.input if v.name not in weights}
    missing = [n for n in names if n not in inputs]
    if missing:
        return f"{missing} are not graph inputs (the parser makes a Data node only for those)"
    dynamic = [n for n in names if any(not d.HasField("dim_value") for d in inputs[n].type.tensor_type.shape.dim)]
    if dynamic:
        return f"{dynamic} have dynamic dims; an in-place pool is static (its buffer is the caller's, every gear)"
    outputs = sorted(set(names) & {v.name for v in model.graph.output})
    return f"{outputs} are also graph outputs: a ref output reaching NetOutput gets a copy" if outputs else None


def _tiling_sink(cmd: Command) -> str | None:
    flags = cmd.flags()
    value = flags.get(TILING)
    if value is None or value == "0":
        return None
    if value != "1":
        return f"{TILING}={value}: the values are 0 (default) and 1"
    soc = flags.get("--soc_version", "")
    if not refdata_build.tiling_sink_allowed(soc):
        return f"tiling sink is not documented for {soc} (Atlas A2/A3 and 310P only; not 310B nor the 910 series)"
    if "--input_shape_range" in flags:
        return "tiling sink needs static shapes; --input_shape_range makes them dynamic"
    try:
        minus = sum(d == -1 for _, dims in _listed(cmd) for d in dims)
    except ValueError as e:
        return f"--input_shape: {e}"
    if minus and "--dynamic_dims" not in flags:
        return "tiling sink needs static shapes: the -1 dims of --input_shape need --dynamic_dims gears"
    return None


def _model(cmd: Command) -> str | None:
    path = cmd.path("--model")
    if path is None:
        return "no --model"
    return None if path.is_file() else f"--model {path} does not exist"


def _one_opset_import(cmd: Command) -> str | None:
    model = cmd.model
    if model is None:
        return "no readable --model"
    domains = [o.domain for o in model.opset_import]
    if len(domains) != 1:
        return f"{len(domains)} opset_import entries {domains}: a default-domain node needs exactly one (E16005)"
    foreign = sorted({n.domain for n in model.graph.node} - {"", "ai.onnx"} - set(domains))
    return f"nodes in domains {foreign} without an opset_import" if foreign else None


def _opset(cmd: Command) -> str | None:
    model = cmd.model
    if model is None:
        return "no readable --model"
    version = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    if version is None:
        return "no default-domain opset_import"
    return None if version <= MAX_ONNX_OPSET else f"opset {version} > {MAX_ONNX_OPSET}"


def _matrix(cmd: Command) -> str | None:
    model = cmd.model
    if model is None:
        return "no readable --model"
    try:
        bad = cann_matrix.violations(uses(model))
    except ValueError as e:
        return str(e)
    return f"{len(bad)} without a row: {'; '.join(bad[:4])}{' …' if len(bad) > 4 else ''}" if bad else None


def _kernels_ship(cmd: Command) -> str | None:
    """Every GE op the graph's nodes map to (their matrix row's GE op) whose kernel is per SoC ships for
    ``--soc_version`` (passes/ascend/kernels.py KERNELS: an ``AddConfig("<soc>")`` in the op's ``op_host/*_def.cpp``;
    without one GE's op selection finds no kernel for the node and ATC stops)."""
    from omforge.passes.ascend.kernels import KERNELS, soc_family

    model, soc = cmd.model, cmd.flags().get("--soc_version", "")
    if model is None:
        return "no readable --model"
    try:
        found = uses(model)
    except ValueError as e:
        return str(e)
    missing = {}
    for use in found:
        row = cann_matrix.row_for(use)
        for ge_op in cann_matrix.ge_ops(row) if row is not None else ():
            kernel = KERNELS.get(ge_op)
            if kernel is not None and soc_family(soc) not in kernel.families:
                missing.setdefault(ge_op, (use.op_type, kernel))
    if not missing:
        return None
    return "; ".join(f"{op_type} → {ge_op}: no kernel ships for {soc} ({soc_family(soc) or 'no family'}; it ships "
                     f"for {', '.join(sorted(k.families)) or 'no SoC'}) [{k.source}]"
                     for ge_op, (op_type, k) in sorted(missing.items()))


def _listed(cmd: Command) -> list[tuple[str, list[int]]]:
    return parse_input_shape(cmd.flags()["--input_shape"]) if "--input_shape" in cmd.flags() else []


def _input_shape_syntax(cmd: Command) -> str | None:
    if "--input_shape" not in cmd.flags():
        return None
    try:
        listed = _listed(cmd)
    except ValueError as e:
        return f"--input_shape: {e}"
    bad = [f"{n}:{d}" for n, dims in listed for d in dims if d < -1 or d == 0]
    return f"dims must be positive or -1: {bad}" if bad else None


def _dynamic_inputs_listed(cmd: Command) -> str | None:
    model = cmd.model
    if model is None:
        return "no readable --model"
    try:
        listed = dict(_listed(cmd))
    except ValueError as e:
        return f"--input_shape: {e}"
    weights = {t.name for t in model.graph.initializer}
    inputs = {v.name: v for v in model.graph.input if v.name not in weights}
    unknown = sorted(set(listed) - set(inputs))
    if unknown:
        return f"--input_shape names {unknown}, which are not graph inputs"
    for name, value in inputs.items():
        dims = value.type.tensor_type.shape.dim
        dynamic = [i for i, d in enumerate(dims) if not d.HasField("dim_value")]
        if dynamic and name not in listed:
            return f"input '{name}' has dynamic dims and is not in --input_shape"
        if name in listed:
            given = listed[name]
            if len(given) != len(dims):
                return f"input '{name}': {len(given)} dims in --input_shape, the graph has {len(dims)}"
            clash = [i for i, d in enumerate(dims) if d.HasField("dim_value") and given[i] != d.dim_value]
            if clash:
                return f"input '{name}': dims {clash} differ from the graph's static sizes"
    return None


def _gears(cmd: Command) -> str | None:
    flags = cmd.flags()
    if "--dynamic_dims" not in flags:
        return None
    if "--input_shape" not in flags or flags.get("--input_format") != "ND":
        return "--dynamic_dims needs --input_shape and --input_format=ND"
    both = [f for f in _EXCLUSIVE_WITH_DIMS if f in flags]
    if both:
        return f"--dynamic_dims is mutually exclusive with {both}"
    try:
        gears = parse_dynamic_dims(flags["--dynamic_dims"])
        minus = sum(d == -1 for _, dims in _listed(cmd) for d in dims)
    except ValueError as e:
        return f"not integers: {e}"
    if not MIN_GEARS <= len(gears) <= MAX_GEARS:
        return f"{len(gears)} gears; --dynamic_dims takes {MIN_GEARS}..{MAX_GEARS}"
    wrong = [i for i, g in enumerate(gears) if len(g) != minus]
    if wrong:
        return f"gear {wrong[0]} has {len(gears[wrong[0]])} values, --input_shape has {minus} -1 dims"
    if any(v < 1 for g in gears for v in g):
        return "gear values must be positive"
    if len({tuple(g) for g in gears}) != len(gears):
        return "duplicate gears"
    return None


def _dim_count(cmd: Command) -> str | None:
    try:
        total = sum(len(dims) for _, dims in _listed(cmd))
    except ValueError as e:
        return f"--input_shape: {e}"
    if "--dynamic_dims" in cmd.flags() and total > MAX_DIM_CNT:
        return (f"the inputs in --input_shape have {total} dims in all; a gear's dims list (static dims included) "
                f"holds at most {MAX_DIM_CNT}: list only inputs with -1 dims")
    return None


def _fusion_switch(cmd: Command) -> str | None:
    path = cmd.path("--fusion_switch_file")
    if path is None:
        return None
    if not path.is_file():
        return f"--fusion_switch_file {path} does not exist"
    text = path.read_text()
    try:
        data = json.loads(text)
    except ValueError:
        bad = [ln for ln in text.splitlines() if ln.strip() and not re.fullmatch(r"\s*[\w.-]+\s*:\s*(on|off)\s*", ln)]
        return f"lines that are neither JSON nor 'PassName:on|off': {bad[:3]}" if bad else None
    if not isinstance(data, dict):
        return "the JSON form is an object"
    extra = sorted(set(data) - set(SWITCH_KEYS))
    return f"first-level keys {extra}: only {'/'.join(SWITCH_KEYS)} are allowed" if extra else None


def _output(cmd: Command) -> str | None:
    value = cmd.flags().get("--output")
    if not value:
        return "no --output"
    return f"--output={value} is a prefix: ATC appends .om itself" if value.endswith(".om") else None


def _precision(cmd: Command) -> str | None:
    flags = cmd.flags()
    if "--precision_mode" in flags and "--precision_mode_v2" in flags:
        return "--precision_mode and --precision_mode_v2 are mutually exclusive"
    value = flags.get("--precision_mode")
    if value is None or value in PRECISION_MODES:
        return None
    return f"--precision_mode={value} is not one of {PRECISION_MODES}"


def _soc(cmd: Command) -> str | None:
    value = cmd.flags().get("--soc_version", "")
    return None if re.fullmatch(r"Ascend[A-Za-z0-9_]+", value) else f"--soc_version={value!r} is not 'Ascend<chip>'"


def _log(cmd: Command) -> str | None:
    value = cmd.flags().get("--log")
    return None if value is None or value in LOG_LEVELS else f"--log={value} is not one of {LOG_LEVELS}"


RULES: tuple[tuple[str, str, Rule], ...] = (
    ("--framework=5 for ONNX (none for the RefData builder)",
     "ATC docs atlasag_25_0080 (§1.1); hicann/ge inc/parser/external/parser/onnx_parser.h:34", _framework),
    ("every RefData builder flag is an IR build option",
     "hicann/ge inc/graph_metadef/external/ge_common/ge_common_api_types.h:614-683, 699-803 (ir_option, "
     "ir_builder_suppported_options, global_options)", _builder_flags),
    ("--ref_inputs: static graph inputs, each once, none a graph output (builder only)",
     "hicann/ge parser/parser/onnx/onnx_parser.cc:293-357 (a Data per graph input); "
     "mem_layout_conflict_util.cc:1246-1251 (a ref output at NetOutput is copied)", _ref_inputs),
    ("--tiling_schedule_optimize=1: Atlas A2/A3/310P, static shapes per gear",
     "hicann/ge docs/zh/user_guides/atc_tools/CLI_options/--tiling_schedule_optimize.md:3-42", _tiling_sink),
    ("--model exists", "ATC docs atlasag_25_0080 (§1.1)", _model),
    ("--soc_version names a chip", "ATC docs atlasag_25_0080 (§1.2)", _soc),
    ("one opset_import", "Ascend/parser parser/onnx/onnx_parser.cc, E16005 (§1.6)", _one_opset_import),
    (f"default-domain opset <= {MAX_ONNX_OPSET}", "CANN ONNX operator list, operatorlist_00177 (§1.6)", _opset),
    ("every op, attribute form and input dtype has a row of the CANN matrix",
     "compile/ascend/cann_matrix.py: hicann/ge onnx_parser.cc + onnx_constant_parser.cc, the ONNX plugins and op "
     "prototypes of hicann/ops-math, ops-nn, ops-transformer (docs/ascend-conformance.md)", _matrix),
    ("every op's kernel ships for --soc_version",
     "passes/ascend/kernels.py KERNELS: AddConfig(\"<soc>\") in each op's op_host/*_def.cpp of hicann/ops-nn, "
     "ops-math, ops-transformer (reference/ascend.md §5.2, §5.3)", _kernels_ship),
    ("--input_shape syntax", "ATC docs atlasatcparam_16_0016 (§1.3)", _input_shape_syntax),
    ("every input with a dynamic dim is listed, static sizes agree",
     "hicann/ge CheckAndParseDynamicData: 'All dynamic nodes must be set in --input_shape' (§3.4)",
     _dynamic_inputs_listed),
    (f"{MIN_GEARS}..{MAX_GEARS} gears, one value per -1", "ATC docs atlasatcparam_16_0020 (§1.3)", _gears),
    (f"dims of the listed inputs <= {MAX_DIM_CNT}",
     "hicann/ge multi_batch_clone_pass.cc, model_om2.cpp ACL_MAX_DIM_CNT (§3.4)", _dim_count),
    ("fusion switch file: only Switch / Priority", "hicann/ge fusion_config_parser.cc (§1.5)", _fusion_switch),
    ("--output is a prefix (the .om may gain _<os>_<cpu>)", "hicann/ge model_helper.cc (§5.1)", _output),
    ("--precision_mode is documented", "ATC docs atlasatcparam_16_0069 (§1.4)", _precision),
    ("--log level", "ATC docs atlasag_25_0080 (§1.1)", _log),
)
"""Every rule: (name, source, check)."""


def check_command(argv: Sequence[str], cwd: Path) -> list[RuleResult]:
    """Every rule over one OM build command (``argv[0]`` is ``atc``, or the RefData builder of an in-place bundle:
    :mod:`.refdata_build`), relative paths resolved from ``cwd``."""
    cmd = Command(tuple(argv), Path(cwd))
    results = []
    for name, source, rule in RULES:
        detail = rule(cmd)
        results.append(RuleResult(name, source, detail is None, detail or ""))
    return results


def check_bundle(bundle: Path) -> dict[str, list[RuleResult]]:
    """Every rule over each command of an ascend bundle's ``ascend/atc_commands.txt`` (run from ``ascend/``),
    keyed by the command's ``--output``. Raises ``FileNotFoundError`` when the bundle has no ATC step."""
    asc = Path(bundle) / "ascend"
    out = {}
    for line in (asc / "atc_commands.txt").read_text().splitlines():
        if line.strip():
            argv = shlex.split(line)
            out[Command(tuple(argv), asc).flags().get("--output", line[:40])] = check_command(argv, asc)
    return out
