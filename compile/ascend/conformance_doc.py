"""docs/ascend-conformance.md: which rows of the CANN matrix (:mod:`omforge.compile.ascend.cann_matrix`) the ascend
bundles of the shipped recipes rely on, generated from the bundles themselves.

``python -m omforge.compile.ascend.conformance_doc`` compiles every :data:`VARIANTS` bundle (recipe × weights × SoC)
into a scratch stage cache, reads each ``ascend/step.onnx`` without its weights
(:mod:`omforge.compile.ascend.step_usage`), records what each uses in ``docs/ascend-conformance.json`` and renders
the document from the matrix and that record (:func:`render`: a pure function, so a test compares it with the
committed file). A use without a row stops it, naming the variant.

The 8B-shaped recipe is compiled as its *structure twin* (:func:`twin_recipe`): the same config but 2 layers and
narrow matrices (``head_dim`` 128, the GQA ratio, untied embeddings and the rope settings kept), the same compile
and serve sections, and onnxsim skipped as it is for the real model's 16 GB of weights (``ONNXSIM_LIMIT``). The
ops, attribute forms and dtypes of a step graph do not depend on the matrix sizes or on the layer count (each layer
repeats the same nodes; the one node whose input count follows the layer count, the Concat of ``kv_new``, is
recorded without its arity, see :mod:`omforge.compile.ascend.step_usage`), so the twin's uses are the real model's, at
~20 MB of weights instead of 32 GB of export.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from omforge.compile.ascend import cann_matrix
from omforge.compile.ascend.step_usage import Use, file_uses

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "ascend-conformance.md"
RECORD = REPO / "docs" / "ascend-conformance.json"
SOCS = ("Ascend910B3", "Ascend910_9392", "Ascend310P3", "Ascend310B1")
"""The SoCs of issue 44 item 3: Atlas A2 (910B), A3 (910_93), Atlas 300I Duo (310P), Atlas 200I/500 A2 (310B)."""
TINY = "tests/recipes/tiny-llama.yaml"
SMOLLM2 = "models/smollm2-135m.yaml"
LLAMA_8B = "models/llama-3-8b-random-ascend.yaml"
TINY_MOE = "tests/recipes/tiny-qwen3-moe.yaml"


@dataclass(frozen=True)
class Variant:
    """One ascend bundle the document covers: a recipe compiled with ``weights`` for ``soc`` (and a
    ``compile.paged_attention`` other than ``auto``: the modes auto never picks)."""

    recipe: str  # relative to the repository
    weights: str
    soc: str
    paged_attention: str = "auto"

    @property
    def name(self) -> str:
        mode = "" if self.paged_attention == "auto" else f"/{self.paged_attention}"
        return f"{Path(self.recipe).stem}/{self.weights}/{self.soc}{mode}"

    @property
    def twin(self) -> bool:
        return self.recipe == LLAMA_8B


def _int8_allowed(soc: str) -> bool:
    from omforge.passes.ascend.w8a16 import soc_refusal

    return soc_refusal(soc) is None


VARIANTS: tuple[Variant, ...] = (
    *(Variant(TINY, w, soc) for soc in SOCS for w in ("float32", "float16", "int8")
      if w != "int8" or _int8_allowed(soc)),
    Variant(TINY, "float16", "Ascend910B3", "readonly"),
    *(Variant(SMOLLM2, w, "Ascend910B3") for w in ("float32", "float16", "int8")),
    *(Variant(LLAMA_8B, w, "Ascend910B3") for w in ("float16", "int8")),
    *(Variant(TINY_MOE, w, soc) for soc, ws in (("Ascend910B3", ("float32", "float16", "int8")),
                                                ("Ascend310P3", ("float16",)), ("Ascend310B1", ("float32",)))
      for w in ws),
)
"""Every bundle of the document: the tiny recipe on each SoC in float32, float16 and W8A16 where the SoC builds
it, and in float16 on Atlas A2 with the readonly paged attention (a mode auto never picks); SmolLM2 and the
8B-shaped recipe (its twin) on Atlas A2, the SoC their recipes are written for; the tiny Qwen3-MoE with CANN's MoE
chain on Atlas A2 (every weight form) and its plain MoE on 310P (float16) and 310B (float32)."""
FAST: tuple[Variant, ...] = tuple(v for v in VARIANTS if v.recipe == TINY and (
    v.soc == "Ascend910B3" or v.weights == "float16" or v.soc == "Ascend310B1"))
"""The variants tests/test_ascend_conformance_matrix.py compiles (seconds each once the tiny export is cached): the
tiny recipe in every weight form on Atlas A2, float16 on every SoC, float32 where the most ops fall back (310B)."""


def twin_recipe(data: dict[str, Any]) -> dict[str, Any]:
    """The 8B recipe's structure twin (module docstring): 2 layers, 4 heads of 128 over 1 KV head (Llama-3-8B's
    32 / 8), hidden 512, intermediate 1024, vocabulary 1024; everything else as the recipe says."""
    config = dict(data["model"]["config"])
    config.update(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, hidden_size=512,
                  intermediate_size=1024, vocab_size=1024)
    return {**data, "model": {**data["model"], "name": data["model"]["name"] + "-twin", "config": config}}


def variant_recipe(variant: Variant, out: Path) -> Path:
    """Write the recipe of ``variant`` (the shipped one with ``compile.target: ascend``, its weights and SoC;
    the twin for the 8B recipe) into ``out``; returns its path."""
    data = yaml.safe_load((REPO / variant.recipe).read_text())
    if variant.twin:
        data = twin_recipe(data)
    compile_section = {k: v for k, v in data.get("compile", {}).items() if k not in ("dtype", "precision_mode")}
    data["compile"] = {**compile_section, "target": "ascend", "weights": variant.weights,
                       "soc_version": variant.soc,
                       **({"paged_attention": variant.paged_attention} if variant.paged_attention != "auto" else {})}
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{variant.name.replace('/', '-')}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@contextmanager
def _onnxsim_skipped(skip: bool) -> Iterator[None]:
    """As compile does for weights above ``ONNXSIM_LIMIT`` (the real 8B model's 16 GB): skip onnxsim."""
    from omforge.compile.ascend import stages as ascend

    old = ascend.ONNXSIM_LIMIT
    ascend.ONNXSIM_LIMIT = -1 if skip else old
    try:
        yield
    finally:
        ascend.ONNXSIM_LIMIT = old


def compile_uses(variant: Variant, work: Path) -> set[Use]:
    """Compile ``variant``'s bundle under ``work`` (stage cache ``work/cache``) and read its step graph's uses."""
    from omforge.compile.ascend.atc import AtcMissing
    from omforge.compile.compiler import compile_recipe
    from omforge.recipe import load_recipe

    recipe = load_recipe(variant_recipe(variant, work))
    out = work / "bundles" / variant.name.replace("/", "-")
    old = os.environ.get("OMFORGE_CACHE_DIR")
    os.environ["OMFORGE_CACHE_DIR"] = str(work / "cache")
    try:
        with _onnxsim_skipped(variant.twin):
            compile_recipe(recipe, out, target="ascend", quiet=True)
    except AtcMissing:
        pass  # no atc here: the bundle is complete up to the ATC step, its step graph written
    finally:
        if old is None:
            os.environ.pop("OMFORGE_CACHE_DIR", None)
        else:
            os.environ["OMFORGE_CACHE_DIR"] = old
    return file_uses(out / "ascend" / "step.onnx")


def collect(variants: Iterable[Variant], work: Path,
            log: Callable[[str], None] = lambda _: None) -> dict[str, list[Use]]:
    """Each variant's uses, sorted: ``{variant name: [Use]}``."""
    record = {}
    for variant in variants:
        t0 = time.perf_counter()
        record[variant.name] = sorted(compile_uses(variant, work))
        log(f"{variant.name}: {len(record[variant.name])} uses, {time.perf_counter() - t0:.0f} s")
    return record


def dump_record(record: dict[str, list[Use]]) -> str:
    """The JSON text of ``docs/ascend-conformance.json``: one line per use, variants in :data:`VARIANTS` order."""
    order = [v.name for v in VARIANTS if v.name in record]
    lines = ["{"]
    for i, name in enumerate(order):
        items = ",\n".join("    " + json.dumps(u.to_json()) for u in record[name])
        lines.append(f"  {json.dumps(name)}: [\n{items}\n  ]{',' if i < len(order) - 1 else ''}")
    lines.append("}")
    return "\n".join(lines) + "\n"


def load_record(path: Path = RECORD) -> dict[str, list[Use]]:
    return {name: [Use.from_json(u) for u in items] for name, items in json.loads(path.read_text()).items()}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


ACL_COLUMNS = ("call", "arguments", "returns", "source")
"""The columns of runtime/ascend's ``acl_call_rows()`` rows."""


def render(record: dict[str, list[Use]], acl_rows: list[tuple[str, ...]]) -> str:
    """The document: the sources read, then each matrix row with the variants that use it, then pyACL's calls
    (``acl_rows``: :func:`acl_rows`), and the uses without a row, if any."""
    broken = [f"`{name}`: {line}" for name, items in record.items() for line in cann_matrix.violations(items)]
    users: dict[cann_matrix.Row, list[str]] = {}
    for name, items in record.items():
        for row in cann_matrix.rows_for(items):
            users.setdefault(row, []).append(name)
    out = [
        "# Ascend conformance: what our ATC inputs ask of CANN, and where CANN's sources handle it",
        "",
        "<!-- generated by `python -m omforge.compile.ascend.conformance_doc` from compile/ascend/cann_matrix.py and "
        "docs/ascend-conformance.json; do not edit by hand -->",
        "",
        "Every (domain, op type, opset), attribute form and input dtype that the ascend step graph of a shipped "
        "recipe holds has a row here, each with the CANN file and line that parses it, maps it or lists the dtype. "
        "The FAKE `atc` (tests/fake_atc.py, rule \"every op, attribute form and input dtype has a row of the CANN "
        "matrix\" in compile/ascend/atc_conformance.py) refuses a graph with anything else. Passing is necessary, not "
        "sufficient: **nothing here has run on an NPU or through a real ATC.** A `Constant` is read only through "
        "`value` (hicann/ge onnx_constant_parser.cc): `value_int`, `value_ints`, `value_float(s)` and "
        "`value_string(s)` have no row on purpose.",
        "",
        "## Sources read",
        "",
        "| repository | commit |",
        "|---|---|",
        *(f"| {repo} | `{commit}` |" for repo, commit in cann_matrix.REPOSITORIES.items()),
        "",
        "## Bundles",
        "",
        "| bundle | recipe | weights | SoC |",
        "|---|---|---|---|",
        *(f"| `{v.name}` | {v.recipe}{' (structure twin)' if v.twin else ''} | {v.weights} | {v.soc} |"
          for v in VARIANTS if v.name in record),
        "",
        "## Rows",
        "",
        "| key | GE op | parsed at | attributes (form: read at) | input dtypes (listed at) | used by | note |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in cann_matrix.ROWS:
        names = users.get(row, [])
        attrs = "<br>".join(f"`{a.name}: {a.form}` ({a.read_at})" for a in row.attrs) or "none"
        dtypes = "<br>".join("(" + ", ".join(d or "—" for d in sig) + ")" for sig in row.dtypes)
        out.append("| " + " | ".join(_cell(c) for c in (
            f"`{row.key_text}`", row.ge_type, str(row.parsed_at), attrs, f"{dtypes} ({row.dtypes_at})",
            f"{len(names)} of {len(record)}: " + ", ".join(f"`{n}`" for n in names) if names else "none",
            row.note)) + " |")
    out += ["", "## Uses without a row (the FAKE atc refuses these bundles)", "",
            *([f"- {_cell(b)}" for b in broken] or ["none"]), "", "## pyACL calls", "",
            "Every `acl.*` call the executor makes (contract/acl_calls.py); the FAKE pyACL (tests/fake_acl.py) "
            "refuses any other call.", "",
            "| " + " | ".join(ACL_COLUMNS) + " |", "|" + "---|" * len(ACL_COLUMNS),
            *("| " + " | ".join(_cell(str(c)) for c in row) + " |" for row in acl_rows)]
    return "\n".join(out) + "\n"


def acl_rows() -> list[tuple[str, ...]]:
    """pyACL's call table (contract/acl_calls.py, the executor's every ``acl.*`` call)."""
    from omforge.contract.acl_calls import acl_call_rows

    return acl_call_rows()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m omforge.compile.ascend.conformance_doc",
                                description=__doc__.split("\n")[0])
    p.add_argument("--fast", action="store_true", help="recompile only the tiny variants the test compiles and keep "
                   "the recorded uses of the others")
    p.add_argument("--work", type=Path, help="scratch folder (default: a temporary one, removed afterwards)")
    args = p.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="omforge-conformance-"))
    try:
        record = load_record() if args.fast and RECORD.is_file() else {}
        record.update(collect(FAST if args.fast else VARIANTS, work, lambda s: print(s, file=sys.stderr)))
        text = render(record, acl_rows())
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    RECORD.write_text(dump_record(record))
    DOC.write_text(text)
    broken = [name for name, items in record.items() if cann_matrix.violations(items)]
    print(f"wrote {DOC.relative_to(REPO)} and {RECORD.relative_to(REPO)}"
          + (f"; uses without a row in {', '.join(broken)}" if broken else ""), file=sys.stderr)
    return 1 if broken else 0


if __name__ == "__main__":
    raise SystemExit(main())
