"""The ascend target's compile stages: the lowered, simplified step graph, then everything the ATC step needs.

``lower_step_graph`` (cached with the passes): fusions → paged KV → Ascend lowering → onnxsim → every Constant in
the ``value`` form ATC reads (:mod:`omforge.compile.ascend.atc_forms`) → ``step.onnx``.
``prepare_and_run`` (in the bundle): ONE ATC model whose gears cover both bucket profiles (prefill, decode), with
its exact command line, plugin sources for our own op types, ``build.sh``; then ``atc`` is run when it is on PATH.
Without it, :class:`AtcMissing` names the step left and the command: never a fake .om. ``memory_plan``: what the
bundle needs of the device (weights once, the KV pool, step buffers, a workspace estimate).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import onnx
import onnx_ir as ir

from omforge.compile.ascend.atc import (
    AtcError,
    AtcModelSpec,
    atc_command,
    find_om,
    input_shapes_from_onnx,
    output_prefix,
    render_command,
    run_atc,
)
from omforge.compile.ascend.atc_forms import rewrite_file
from omforge.compile.ascend.atc_plugins import render_plugins
from omforge.compile.ascend.build_script import render_build_script
from omforge.compile.ascend.refdata_build import refdata_command, render_builder
from omforge.compile.pass_report import AscendPassInfo, PassReport
from omforge.contract import cdiv
from omforge.contract.ascend import OM_MODEL
from omforge.contract.buckets import STEP_DIMS, BucketPlan, om_gears
from omforge.contract.manifest import ACL_LOAD_PATH, DeviceMemoryPlan, StepAbi, Weights
from omforge.errors import OmforgeError
from omforge.passes.ascend import kernels as ascend_kernels
from omforge.passes.ascend.lower import PoolTooLarge
from omforge.passes.ascend.w8a16 import lowering_note
from omforge.passes.options import AscendLoweringOptions, LoraOptions, PoolingOptions, QuantizeOptions
from omforge.passes.pipeline import Pipeline, histogram, interface
from omforge.recipe import Recipe


def lower_step_graph(export_dir: Path, out: Path, recipe: Recipe, block_size: int, plain: bool = False,
                     pooling: PoolingOptions | None = None, lora: LoraOptions | None = None) -> PassReport:
    """``plain``: every op as standard ONNX with the lowering's numerics (``lower_ascend.lower(plain=True)``), a
    graph any ONNX runtime can run — what the tests' fake pyACL executes in place of the OMs. ``pooling``: a
    pooling bundle's step graph (no KV pool) in place of the paged one. ``lora``: the LoRA options the compile built
    (compile/options.py ``lora_options``; None: no LoRA)."""
    model = ir.load(export_dir / "model.onnx")
    c = recipe.compile
    quantize = QuantizeOptions(bits=8, group_size=c.quantization.group_size, matrices=tuple(c.quantization.matrices)) \
        if c.weights == "int8" else None
    mode, note = paged_attention(recipe, block_size)
    if pooling is None and not plain:
        print(f"[compile] paged attention: {note}", file=sys.stderr)
    lowering = AscendLoweringOptions(paged_attention=mode if pooling is None else "gather", plain=plain,
                                     num_slots=num_slots(recipe, block_size), soc_version=c.soc_version)
    try:
        run = Pipeline("ascend", c.fusions, block_size, lowering, quantize=quantize, float16=c.weights != "float32",
                       pooling=pooling, lora=lora).run(model)
    except ir.passes.PassError as error:  # onnx-ir's pass manager wraps what a pass raises
        e = error.__cause__
        while e is not None and not isinstance(e, PoolTooLarge):
            e = e.__cause__
        if e is None:
            raise
        # the pool is static in the graph: its size is the recipe's
        key = "serve.num_kv_blocks" if recipe.serve.num_kv_blocks else "compile.max_batch_size x max_seq_len"
        raise OmforgeError(f"{recipe.path}: {key}: {e} ({e.max_slots // block_size:,} blocks of {block_size})") \
            from None
    counts, layout, record = run.fusion_counts, run.layout, run.lowering.result
    ir.save(model, out / "step.onnx", external_data="step.onnx.data")
    simplified = _onnxsim(out / "step.onnx")
    constants = rewrite_file(out / "step.onnx")  # after onnxsim or without it (> ONNXSIM_LIMIT): the file ATC reads
    final = ir.load(out / "step.onnx")
    weights = Weights(c.weights, run.quantized, None,
                      graph="float16 (float32 islands: RMSNorm statistics, softmax, rotary angles)"
                      if c.weights != "float32" else "float32",
                      w8a16=lowering_note(c.quantization.group_size) if c.weights == "int8" else None)
    info = AscendPassInfo(record.to_dict(), mode if pooling is None else None, note if pooling is None else None,
                          simplified, constants)
    return PassReport("step.onnx", counts, len(list(final.graph)), histogram(final),
                      StepAbi.from_dict(interface(final), "abi"), layout, weights, pooled_width=run.pooled_width,
                      lora=run.lora, ascend=info)


ONNXSIM_LIMIT = 2**31 - 2**26
"""Above this many bytes of weights onnxsim is not run: it loads the whole model into one protobuf (< 2 GiB)."""


def _onnxsim(path: Path) -> str:
    """Simplify in place with onnxsim (constant folding, dead code); keep the input graph if onnxsim cannot
    handle it (our own op types are unknown to its ORT-based folding) and say why."""
    import onnxsim

    data = path.with_name(path.name + ".data")
    if data.is_file() and data.stat().st_size > ONNXSIM_LIMIT:
        reason = f"skipped: {data.stat().st_size / 2**30:.1f} GiB of weights (onnxsim holds one protobuf, < 2 GiB)"
        print(f"[compile] onnxsim {reason}", file=sys.stderr)
        return reason
    try:
        proto = onnx.load(str(path))
        simplified, ok = onnxsim.simplify(proto, check_n=0, skip_shape_inference=True)
    except Exception as e:  # onnxsim raises anything from ORT / onnx; the unsimplified graph is still valid
        print(f"[compile] onnxsim skipped: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
        return f"skipped: {type(e).__name__}"
    if not ok:
        return "skipped: check failed"
    data.unlink(missing_ok=True)
    onnx.save(simplified, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=data.name)
    return f"simplified: {len(proto.graph.node)} → {len(simplified.graph.node)} nodes"


def paged_attention(recipe: Recipe, block_size: int) -> tuple[str, str]:
    """The bundle's paged-attention mode and why (``compile.paged_attention`` resolved for the SoC, the graph dtype
    and the block size: :func:`omforge.passes.ascend.kernels.paged_attention_mode`); a recipe asking for what
    cannot be built is an OmforgeError naming the key."""
    c = recipe.compile
    try:
        return ascend_kernels.paged_attention_mode(c.paged_attention, c.soc_version,
                                                   "float32" if c.weights == "float32" else "float16", block_size)
    except ValueError as e:
        raise OmforgeError(f"{recipe.path}: compile.paged_attention: {e}") from None


def scratch_blocks(recipe: Recipe, block_size: int) -> int:
    """The in-place pools' last blocks where a gear's padding rows are written (ScatterPaKvCache wants every slot
    unique and in range): enough for the largest gear's tokens, ``ceil(max_num_tokens / block_size)``; 0 for the
    gather mode (its padding rows are never written)."""
    if paged_attention(recipe, block_size)[0] != "inplace":
        return 0
    return cdiv(recipe.compile.max_num_tokens, block_size)


def num_slots(recipe: Recipe, block_size: int) -> int:
    """The pool size ATC compiles in (a static dim of every cache input): ``serve.num_kv_blocks`` blocks, or
    enough for ``max_batch_size`` sequences of ``max_seq_len`` tokens, plus the :func:`scratch_blocks`."""
    blocks = recipe.serve.num_kv_blocks or recipe.compile.max_batch_size * cdiv(recipe.compile.max_seq_len, block_size)
    return (blocks + scratch_blocks(recipe, block_size)) * block_size


def prepare_and_run(bundle: Path, recipe: Recipe, plan: BucketPlan, lowering: dict[str, Any]) -> list[Path]:
    """Write the ATC step into ``bundle/ascend`` and run it when ``atc`` is on PATH; returns the files written.
    ``lowering``: the ascend lowering's record (the passes report's ``ascend.lowering``).

    Raises :class:`AtcMissing` (after writing everything) when ``atc`` is not on PATH, naming ``build.sh`` and
    the commands; :class:`AtcError` when a run fails (its log is kept under ``ascend/logs``)."""
    asc = bundle / "ascend"
    spec = step_spec(asc / "step.onnx", plan)
    ref_inputs = tuple(lowering.get("ref_inputs") or ())  # the in-place pools: the RefData builder's OM
    commands = [refdata_command(spec, recipe.compile, Path("om"), ref_inputs) if ref_inputs
                else atc_command(spec, recipe.compile, Path("om"))]
    if ref_inputs:
        render_builder(asc)
    plugins = render_plugins(lowering, asc / "plugins")
    script = render_build_script(commands, asc / "build.sh", plugins)
    (asc / "atc_commands.txt").write_text("".join(render_command(c) + "\n" for c in commands))
    written = [p for p in asc.rglob("*") if p.is_file()]
    if (plugins is not None or ref_inputs) and shutil.which("atc") is not None:  # build.sh compiles what they need
        log = asc / "logs" / "build.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("wb") as f:  # our plugins must be built and installed before atc can parse our op types
            rc = subprocess.run(["bash", str(script)], cwd=asc, stdout=f, stderr=subprocess.STDOUT).returncode
        if rc != 0:
            raise AtcError(f"{script} failed (exit {rc}); see {log}")
        oms = [find_om(asc / output_prefix(c)) for c in commands]
        if None in oms:
            raise AtcError(f"{script} finished but wrote no {OM_MODEL}*.om; see {log}")
    else:
        oms = run_atc(commands, asc / "logs", cwd=asc, script=script)
    return sorted(set(written + [o for o in oms if o is not None]
                      + [p for p in (asc / "logs").rglob("*") if p.is_file()]))


def step_spec(step_onnx: Path, plan: BucketPlan) -> AtcModelSpec:
    """The one OM of the bundle: the graph inputs with a dynamic dim (every step dim is a gear dim; the KV pool is
    static and not listed, reference/ascend.md §3.4), the gears of every profile over the common step dims."""
    shapes = input_shapes_from_onnx(step_onnx, {d: d for d in STEP_DIMS})
    listed = {name: dims for name, dims in shapes.items() if any(isinstance(d, str) for d in dims)}
    used = [d for d in STEP_DIMS if any(d in dims for dims in listed.values())]  # a pooling graph: two of them
    at = [STEP_DIMS.index(d) for d in used]
    gears = sorted({tuple(g[i] for i in at) for g in om_gears(plan)})
    return AtcModelSpec(OM_MODEL, Path(step_onnx.name), listed, gears, used)


def moe_workspace(recipe: Recipe, config: dict[str, Any], tokens: int, itemsize: int) -> int:
    """One MoE layer's activations for ``tokens`` tokens (0 for a dense model): CANN's chain keeps ``T·k`` expanded
    rows (x, gate/up, SwiGLU, down: ``2H + 3F`` each); the plain MoE (passes/ascend/moe.py, where a kernel of the
    chain does not ship) runs every expert on every token (``E·T`` rows of ``H + 3F``)."""
    experts = config.get("num_experts") or 0
    if not experts:
        return 0
    hidden, width = config["hidden_size"], config["moe_intermediate_size"]
    if all(ascend_kernels.ships(k, recipe.compile.soc_version) for k in ascend_kernels.MOE_KERNELS):
        return tokens * config["num_experts_per_tok"] * (2 * hidden + 3 * width) * itemsize
    return experts * tokens * (hidden + 3 * width) * itemsize


def memory_plan(recipe: Recipe, plan: BucketPlan, step_dir: Path, layout: dict[str, Any] | None,
                config: dict[str, Any]) -> DeviceMemoryPlan:
    """What the bundle needs of the device, in bytes: the weights (once: one OM), the KV pool and the step's input
    and output buffers at the largest gear (each once: the OM is loaded with ACL_MDL_WORKSPACE_MEM_OPTIMIZE,
    :data:`ACL_LOAD_PATH`, so GE keeps no copy of them), and an estimate of the OM's own workspace (the largest
    gear's activations of one layer, twice; ATC's real figure is ``aclmdlQuerySize``'s, less the I/O it includes,
    which ``omforge serve`` reads when it can). ``omforge serve`` refuses a need above the device's free memory
    (``acl.rt.get_mem_info``). Never measured on hardware."""
    itemsize = 2 if recipe.compile.weights != "float32" else 4
    weights = sum(f.stat().st_size for f in step_dir.iterdir() if f.name.startswith("step.onnx"))
    gears = om_gears(plan)
    vocab_size, hidden = config["vocab_size"], config["hidden_size"]
    if layout is None:  # a pooling bundle: no pool; ids, positions and the pooled rows; a layer's activations
        inter, heads = config["intermediate_size"], config["num_attention_heads"]
        io = max(8 * (2 * t + b) + 4 * b * hidden for t, b, q, _, _ in gears)
        work = max(t * (4 * hidden + 2 * inter) * itemsize + 4 * b * heads * q * q
                   + moe_workspace(recipe, config, t, itemsize) for t, b, q, _, _ in gears) * 2
        return DeviceMemoryPlan(
            soc_version=recipe.compile.soc_version, om_models=1, gears=len(gears), weights_bytes=weights,
            kv_pool_bytes=0, io_bytes=io, workspace_bytes_estimate=work, total_bytes=weights + io + work,
            note="a pooling bundle (no KV pool): weights once, step buffers once (see load); the workspace is an "
                 "estimate until the OM is built; not measured on hardware", load=ACL_LOAD_PATH)
    slot = layout["num_layers"] * 2 * layout["kv_heads"] * layout["head_dim"] * itemsize
    mode = paged_attention(recipe, plan.block_size)[0]  # inplace: no kv_new; in/readonly: two [B] int64 lengths
    io = max(8 * (3 * t + b * m + b * q + n) + 4 * n * vocab_size + (16 * b if mode != "gather" else 0)
             + (t * slot if mode != "inplace" else 0) for t, b, q, n, m in gears)
    inter, heads = config["intermediate_size"], config["num_attention_heads"]
    bs = plan.block_size
    work = max(t * (4 * hidden + 2 * inter) * itemsize + 4 * b * heads * q * m * bs + 2 * b * m * bs * slot
               // layout["num_layers"] + moe_workspace(recipe, config, t, itemsize) for t, b, q, n, m in gears) * 2
    pool = num_slots(recipe, bs) * slot
    return DeviceMemoryPlan(
        soc_version=recipe.compile.soc_version, om_models=1, gears=len(gears), weights_bytes=weights,
        kv_pool_bytes=pool, io_bytes=io, workspace_bytes_estimate=work, total_bytes=weights + pool + io + work,
        note="weights once (one OM for prefill and decode), the KV pool and step buffers once (see load); the "
             "workspace is an estimate until the OM is built (aclmdlQuerySize gives ATC's figure); not measured on "
             "hardware", load=ACL_LOAD_PATH)
