"""``omforge compile``: recipe → export → passes → lowering → target artifacts → bundle, stage by stage.

Every stage is cached by content hash (:mod:`omforge.compile.cache`): the export by the recipe's model
section and weight file; the passes by the export, the fusion switches, the block size, the target, the
source of the passes and the tool versions; the bundle is then assembled by copying from the cached stages.
A second compile with nothing changed only re-assembles and re-hashes.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from omforge.compile import bucket_plan as bucket_planner
from omforge.compile.ascend.atc import AtcMissing
from omforge.compile.bundle import file_entries, write_manifest
from omforge.compile.cache import Stage, cache_root, copy_into, stage_key
from omforge.compile.options import lora_options, pooling_options
from omforge.compile.ort import lora_kernel
from omforge.compile.pass_report import PassReport
from omforge.contract import DEFAULT_BLOCK_SIZE, PagedLayout, kernel_library
from omforge.contract.kernel_abi import ABI_VERSION
from omforge.contract.manifest import (
    AscendSection,
    ExportRef,
    Graphs,
    KvSection,
    Limits,
    Manifest,
    ModelConfig,
    ModelSection,
    PoolingSection,
    TokenizerMeta,
)
from omforge.errors import OmforgeError
from omforge.file_lock import locked
from omforge.passes.options import LoraOptions, PoolingOptions
from omforge.recipe import FUSIONS, PoolingRecipe, Recipe, retarget

TOOLS = ("onnx", "onnxruntime", "onnxscript", "onnx-ir", "onnxsim", "torch")


def tool_versions() -> dict[str, str]:
    versions = {"omforge": _version("omforge"), "python": sys.version.split()[0]}
    for tool in TOOLS:
        versions[tool] = _version(tool)
    return versions


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


_ROOT = Path(__file__).resolve().parent.parent


def stage_sources(target: str) -> list[Path]:
    """The Python sources the passes stage of ``target`` runs: its output is stale when any of them changes.
    Both: the passes (fusions, paged KV, lowering, pipeline, their options), the contract, the options built from
    the recipe (compile/options.py) and the report's cached form (compile/pass_report.py); ort: compile/ort.py;
    ascend: compile/ascend/ (ATC command lines, plugin templates and their renderer) and the bucket planner.
    Whether the kernel library is usable is part of the stage key itself."""
    files = sorted((_ROOT / "passes").rglob("*.py"))
    files += sorted((_ROOT / "contract").glob("*.py"))
    files += [_ROOT / "compile" / "options.py", _ROOT / "compile" / "pass_report.py"]
    if target == "ort":
        files.append(_ROOT / "compile" / "ort.py")
    if target == "ascend":
        files += sorted((_ROOT / "compile" / "ascend").glob("*.py")) + [_ROOT / "compile" / "bucket_plan.py"]
        files += sorted((_ROOT / "compile" / "ascend" / "templates").glob("*"))
    return files


def _source_digest(files: list[Path]) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.relative_to(_ROOT)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


@dataclass
class Progress:
    """Prints each stage with its wall time (to stderr) and records it."""

    quiet: bool = False
    timings: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def stage(self, name: str, cached: bool = False) -> Iterator[None]:
        t0 = time.perf_counter()
        if not self.quiet:
            print(f"[compile] {name}{' (cached)' if cached else ' …'}", file=sys.stderr, flush=True)
        yield
        self.timings[name] = round(time.perf_counter() - t0, 3)
        if not self.quiet and not cached:
            print(f"[compile] {name}: {self.timings[name]:.1f}s", file=sys.stderr, flush=True)


@dataclass
class CompileResult:
    bundle: Path
    manifest: Manifest
    cached: dict[str, bool]
    timings: dict[str, float]


@dataclass
class _Job:
    """One compile: the checked settings every stage reads, the passes' options built once from the recipe and the
    export (``config``: its model config), and what the stages record (cache hits, timings)."""

    recipe: Recipe
    out: Path
    target: str
    block_size: int
    kernel: bool
    quiet: bool
    root: Path
    progress: Progress
    cached: dict[str, bool] = field(default_factory=dict)
    config: ModelConfig | None = None
    pooling: PoolingOptions | None = None  # a pooling bundle (task embed | score)
    lora: LoraOptions | None = None  # compile.lora


def compile_recipe(recipe: Recipe, out: Path, target: str | None = None, quiet: bool = False) -> CompileResult:
    """Compile ``recipe`` into the bundle ``out`` (replaced). Raises OmforgeError subclasses on user errors;
    on the ascend target without ``atc`` the bundle is complete up to the ATC step and
    :class:`omforge.compile.ascend.atc.AtcMissing` is raised after it is written."""
    from omforge.export.onnx_export import recipe_digest  # the export extras, needed before any check

    target = target or recipe.compile.target
    if target not in DEFAULT_BLOCK_SIZE:
        raise OmforgeError(f"--target: '{target}' is not a target; choose one of {', '.join(DEFAULT_BLOCK_SIZE)}")
    recipe = retarget(recipe, target)  # --target: that target's defaults and checks
    job = _job(recipe, out, target, quiet)
    digest = recipe_digest(recipe)
    export_dir, export_meta = _export_stage(job)
    job.config = ModelConfig.from_dict(export_meta["config"], "config")
    job.pooling = pooling_options(recipe, export_dir, job.config)
    job.lora = lora_options(recipe, job.config)
    plan = bucket_planner.plan(recipe.compile, target=job.target, block_size=job.block_size,
                               pooling=job.pooling is not None)
    passes = _passes_stage(job, export_dir, digest)
    report = PassReport.from_dict({k: v for k, v in passes.info().items() if k not in _STAGE_FIELDS})
    files = _bundle_stage(job, export_dir, export_meta, passes)
    atc_missing = _ascend_stage(job, plan, report, files) if job.target == "ascend" else None
    manifest = _manifest(job, digest, export_dir, export_meta, plan, report, atc_missing is None, files)
    write_manifest(out, manifest)
    result = CompileResult(out, manifest, job.cached, job.progress.timings)
    if atc_missing is not None:
        raise atc_missing
    return result


def _job(recipe: Recipe, out: Path, target: str, quiet: bool) -> _Job:
    """Check what no stage can fix (the target, the KV and weight dtypes for it, the output folder) before any
    work; one-line errors naming the recipe key or the flag."""
    block_size = recipe.compile.kv_block_size or DEFAULT_BLOCK_SIZE[target]
    kernel = kernel_lowering(target, quiet)
    kv_dtype = recipe.compile.kv_cache_dtype
    if kv_dtype != "float32" and target != "ort":
        raise OmforgeError(f"{recipe.path}: compile.kv_cache_dtype: {kv_dtype} is not supported for target {target} "
                           "(allowed: float32)")
    if kv_dtype != "float32" and not kernel:
        raise OmforgeError(f"{recipe.path}: compile.kv_cache_dtype: {kv_dtype} needs omforge's CPU kernel library, "
                           f"unavailable here ({kernel_library.status().reason}); use float32")
    if out.exists() and not (out / "manifest.json").is_file() and any(out.iterdir()):
        raise OmforgeError(f"-o {out}: exists and is not a bundle; refusing to overwrite it")
    return _Job(recipe, out, target, block_size, kernel, quiet, cache_root(), Progress(quiet))


def _export_stage(job: _Job) -> tuple[Path, dict[str, Any]]:
    """The unfused export, cached by the recipe's model section and weight file: its folder and its export.json."""
    from omforge.export.onnx_export import cached_export, cached_export_dir, is_exported

    exports = job.root / "exports"
    with locked(cached_export_dir(job.recipe, exports)):  # another compile sharing the cache exports it once
        job.cached["export"] = is_exported(cached_export_dir(job.recipe, exports))
        with job.progress.stage("export", job.cached["export"]):
            export_dir = cached_export(job.recipe, exports, quiet=job.quiet, isolated=True, lock=False)
    return export_dir, json.loads((export_dir / "export.json").read_text())


def _passes_stage(job: _Job, export_dir: Path, digest: str) -> Stage:
    """Fusions, paged KV and lowering for the target, cached by everything their output depends on."""
    recipe, target, block_size = job.recipe, job.target, job.block_size
    kv_dtype, weights = recipe.compile.kv_cache_dtype, recipe.compile.weights
    passes_key = stage_key("passes", {
        "export": digest, "fusions": recipe.compile.fusions, "block_size": block_size, "target": target,
        "paged_attention": f"kernel-abi{ABI_VERSION}" if job.kernel else "plain", "kv_cache_dtype": kv_dtype,
        "weights": weights, "quantization": recipe.compile.quantization.model_dump() if weights != "float32" else None,
        # float32: the recipe's choice and the library path that "auto" decides by
        "float_gemm": [recipe.compile.float_gemm, kernel_library.status().f32] if weights == "float32" else None,
        "passes_source": _source_digest(stage_sources(target)),
        "tools": tool_versions(),
        "num_slots": _static_slots(recipe, target, block_size),
        "soc_version": recipe.compile.soc_version if target == "ascend" else None,  # which fused kernels ship
        # the ascend graph's paged-attention mode (gather and readonly bundles share every other key)
        "ascend_paged_attention": recipe.compile.paged_attention if target == "ascend" else None,
        **({"pooling": asdict(job.pooling)} if job.pooling is not None else {}),
        # compile.lora (its config is the export's), and whether the kernel library here has LoraAdd (the ort
        # lowering of the terms)
        **({"lora": [{"max_loras": job.lora.max_loras, "max_rank": job.lora.max_rank,
                      "target_modules": job.lora.target_modules}, target == "ort" and job.kernel and lora_kernel()]}
           if job.lora is not None else {}),
    })
    passes = Stage(f"passes-{target}", passes_key, job.root)
    with locked(passes.dir):  # another compile sharing the cache builds it once
        job.cached["passes"] = passes.done
        with job.progress.stage(f"passes + lowering ({target})", passes.done):
            if not passes.done:
                from omforge.passes.lora import LoraTargetMissing

                try:
                    _run_passes(export_dir, passes, job)
                except LoraTargetMissing as e:
                    raise OmforgeError(f"{recipe.path}: {e}") from None
    return passes


def _bundle_stage(job: _Job, export_dir: Path, export_meta: dict[str, Any], passes: Stage) -> list[Path]:
    """The bundle folder afresh, filled from the cached stages; returns the files written."""
    out, target = job.out, job.target
    with job.progress.stage("bundle"):
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        files: list[Path] = []
        # no second copy of the weights: the unfused export stays in the stage cache (manifest "export")
        if export_meta["tokenizer"].get("file"):
            copy_into(export_dir / "tokenizer.json", out / "tokenizer.json")
            files.append(out / "tokenizer.json")
        for f in sorted(p for p in passes.dir.iterdir() if p.name != "stage.json"):
            copy_into(f, out / target / f.name)
            files.append(out / target / f.name)
    return files


def _ascend_stage(job: _Job, plan: bucket_planner.BucketPlan, report: PassReport,
                  files: list[Path]) -> AtcMissing | None:
    """ATC over the step graph (its files appended to ``files``); without ``atc`` everything else is written and
    the AtcMissing returned, to be raised once the manifest is."""
    from omforge.compile.ascend import stages as ascend

    with job.progress.stage("ascend toolchain (ATC)"):
        try:
            assert report.ascend is not None
            files += ascend.prepare_and_run(job.out, job.recipe, plan, report.ascend.lowering)
        except AtcMissing as e:  # everything else is written; say what is left after the manifest
            files += [p for p in (job.out / "ascend").rglob("*") if p.is_file() and p not in files]
            return e
    return None


def _manifest(job: _Job, digest: str, export_dir: Path, export_meta: dict[str, Any], plan: bucket_planner.BucketPlan,
              report: PassReport, atc_built: bool, files: list[Path]) -> Manifest:
    """The bundle's manifest.json: what the runtime needs to load it, and where each part came from."""
    recipe, target, out, config = job.recipe, job.target, job.out, job.config
    assert config is not None
    tokenizer = TokenizerMeta.from_dict(export_meta["tokenizer"], "tokenizer")
    layout, weights = report.layout, report.weights
    return Manifest(
        omforge_version=_version("omforge"),
        model=ModelSection(recipe.model.name, config),
        tokenizer=replace(tokenizer, file="tokenizer.json" if tokenizer.file else None),
        target=target,
        abi=report.abi,
        paged_attention=report.paged_attention or "plain",  # ascend: its own (the ascend section's)
        kernels=kernel_library.status().manifest_entry(weight_layout=weights.gemm in _OUR_GEMMS)
        if report.paged_attention == "kernel" or weights.gemm in _OUR_GEMMS else None,
        kv=KvSection.of(layout, write=_kv_write(recipe, target, plan.block_size))
        if job.pooling is None and layout is not None else None,
        pooling=pooling_section(recipe, job.pooling, report.pooled_width, config)
        if job.pooling is not None and report.pooled_width is not None else None,
        lora=report.lora,
        limits=Limits(recipe.compile.max_seq_len, recipe.compile.max_batch_size, recipe.compile.max_num_tokens),
        serve=recipe.serve.model_dump(),
        buckets=plan,
        passes=report.counts,
        weights=weights,
        graphs=Graphs(f"{target}/{report.graph}"),
        export=ExportRef(digest, str(export_dir), "the unfused export is not copied into the bundle (no second "
                         "copy of the weights); it lives in the stage cache, and `omforge export RECIPE -o DIR` "
                         "rebuilds it"),
        ascend=ascend_section(recipe, plan, atc_built, out, layout, export_meta["config"])
        if target == "ascend" else None,
        toolchain=tool_versions(),
        timings=job.progress.timings,
        files=file_entries(out, files),
    )


_KV_WRITE = {
    "ort": "in place: bind key_cache_out.N to key_cache.N's buffer",
    "ascend": "out of place: one pool kv_cache [num_slots, num_layers, 2, kv_heads, head_dim]; the graph returns "
              "kv_new [num_tokens, num_layers, 2, kv_heads, head_dim]; the runtime copies each run of consecutive "
              "slots with one device copy",
}
"""The manifest's ``kv.write`` by target: how the step graph writes the new KV rows (ascend: its gather mode)."""
_KV_WRITE_INPLACE = ("in place inside the OM: per-layer pools key_cache.N / value_cache.N [num_blocks, block_size, "
                     "kv_heads, head_dim] are RefData inputs bound to the runtime's buffers; each layer's "
                     "ScatterPaKvCache writes the step's rows at slot_mapping and FusedInferAttentionScore reads them; "
                     "no kv_new output, the executor copies no rows")
"""``kv.write`` of an ascend bundle built with ``compile.paged_attention`` resolved to ``inplace``."""
_KV_WRITE_READONLY = ("out of place, per-layer pools key_cache.N / value_cache.N [num_blocks, block_size, kv_heads, "
                      "head_dim] bound as plain inputs the graph only reads; the graph returns kv_new [num_layers, 2, "
                      "num_tokens, kv_heads, head_dim]; the runtime copies each run of consecutive slots with one "
                      "device copy per pool")
"""``kv.write`` of an ascend bundle built with ``compile.paged_attention: readonly``."""


def _kv_write(recipe: Recipe, target: str, block_size: int) -> str:
    """The manifest's ``kv.write``: :data:`_KV_WRITE` by target, the in-place text for an in-place ascend bundle."""
    if target == "ascend":
        from omforge.compile.ascend import stages as ascend

        mode = ascend.paged_attention(recipe, block_size)[0]
        if mode == "inplace":
            return _KV_WRITE_INPLACE
        if mode == "readonly":
            return _KV_WRITE_READONLY
    return _KV_WRITE[target]


def ascend_section(recipe: Recipe, plan: bucket_planner.BucketPlan, built: bool, bundle: Path,
                   layout: PagedLayout | None, config: dict[str, Any]) -> AscendSection:
    """What the ACL executor needs beyond the ABI (:class:`AscendSection`), from the ascend step graph."""
    from omforge.compile.ascend import stages as ascend
    from omforge.contract.ascend import CANN_RELEASE

    spec = ascend.step_spec(bundle / "ascend" / "step.onnx", plan)
    return AscendSection(
        model=f"ascend/om/{spec.name}", input_shape=tuple((n, tuple(d)) for n, d in spec.input_shapes.items()),
        gears=tuple(tuple(g) for g in spec.gears), gear_dims=tuple(spec.dim_order),
        num_slots=ascend.num_slots(recipe, plan.block_size) if layout is not None else 0,  # 0: no KV pool
        soc_version=recipe.compile.soc_version,
        precision_mode=recipe.compile.precision_mode, atc="done" if built else "left",
        fusions={name: recipe.compile.fusions.get(name, True) for name in FUSIONS},
        memory=ascend.memory_plan(recipe, plan, bundle / "ascend", asdict(layout) if layout is not None else None,
                                  config), cann_release=CANN_RELEASE,
        **_paged_fields(recipe, plan.block_size, layout))


def _paged_fields(recipe: Recipe, block_size: int, layout: PagedLayout | None) -> dict[str, Any]:
    """AscendSection's paged-attention fields: the mode and why, the RefData pool inputs, the scratch blocks."""
    from omforge.compile.ascend import stages as ascend
    from omforge.contract.ascend import key_cache, value_cache

    if layout is None:  # a pooling bundle: no pool
        return {}
    mode, note = ascend.paged_attention(recipe, block_size)
    refs = tuple(name for n in range(layout.num_layers) for name in (key_cache(n), value_cache(n))) \
        if mode == "inplace" else ()
    return {"paged_attention": mode, "paged_attention_note": note, "ref_inputs": refs,
            "scratch_blocks": ascend.scratch_blocks(recipe, block_size)}


def _static_slots(recipe: Recipe, target: str, block_size: int) -> int | None:
    """The pool's slot count where the step graph holds it statically (ascend), else None."""
    if target != "ascend":
        return None
    from omforge.compile.ascend import stages as ascend

    return ascend.num_slots(recipe, block_size)


# weight MatMuls in the kernel library's packed layouts
_OUR_GEMMS = ("MatMulQ", "MatMulQBF16", "MatMulBF16", "MatMulF32")


def kernel_lowering(target: str, quiet: bool = False) -> bool:
    """Whether the ort step graph uses omforge's CPU kernel for paged attention: when the kernel library is
    usable in this process; otherwise the plain-op lowering, said once per process."""
    if target != "ort":
        return False
    status = kernel_library.status()
    if not status.available and not quiet:
        _say_fallback(status.reason)
    return status.available


@functools.cache
def _say_fallback(reason: str) -> None:
    print(f"[compile] omforge kernel library unavailable ({reason}): paged attention uses the plain-op "
          "lowering (slower)", file=sys.stderr, flush=True)


def pooling_section(recipe: Recipe, options: PoolingOptions, width: int, config: ModelConfig) -> PoolingSection:
    """The manifest's ``pooling`` section of a pooling bundle: last-token pooling and the recipe's settings."""
    from omforge.contract.pooling import POOLED_OUTPUT

    p = recipe.pooling or PoolingRecipe()
    task = options.task
    return PoolingSection(
        task=task, pooling="last", output=POOLED_OUTPUT[task], size=width, normalize=p.normalize and task == "embed",
        matryoshka=p.matryoshka and task == "embed",
        append_token_id=config.eos_token_ids[0] if p.append_eos else None,
        score_token_ids=options.score_token_ids, prompt_format=p.prompt_format, instruction=p.instruction)


_STAGE_FIELDS = ("kind", "key", "finished")
"""stage.json's own fields beside the report (compile/cache.py ``Stage.finish``)."""


def _run_passes(export_dir: Path, stage: Stage, job: _Job) -> None:
    """The target's passes over the export into the stage folder; the stage finished with its :class:`PassReport`."""
    from omforge.compile.ort import build

    recipe, c = job.recipe, job.recipe.compile
    out = stage.begin()
    if job.target == "ort":
        from omforge.export.onnx_export import load_source_blocks

        blocks = load_source_blocks(export_dir) if c.weights != "float32" and c.quantization.source_blocks else None
        report = build(export_dir, out / "step.onnx", fusions=c.fusions, block_size=job.block_size,
                       kernel=job.kernel, kv_cache_dtype=c.kv_cache_dtype, weights=c.weights,
                       quantization=c.quantization, blocks=blocks, float_gemm=c.float_gemm, pooling=job.pooling,
                       lora=job.lora)
    else:
        from omforge.compile.ascend import stages as ascend

        report = ascend.lower_step_graph(export_dir, out, recipe, job.block_size, pooling=job.pooling, lora=job.lora)
    stage.finish(report.to_dict())
