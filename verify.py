"""``omforge verify BUNDLE --recipe RECIPE``: the first-run check of an ascend bundle on an NPU.

Loads the bundle's OM through its AscendCL executor (the serving path: memory check, config-handle load, description
check), then runs EVERY compiled gear once on deterministic inputs and compares what the OM computed with the plain
twin of the same step graph on onnxruntime's CPU provider: ``lower_step_graph(plain=True)``, every fused op as
standard ONNX with the lowering's numerics (what the tests' FAKE pyACL runs). Per mode (manifest
``ascend.paged_attention``, printed first with its reason):

- ``gather``: seeded tokens, block tables and pool contents, a context that fills the gear's blocks; the OM's
  ``logits`` and new KV rows (``kv_new``) against the twin's.
- ``inplace``: the same steps with the in-place inputs (``slot_mapping``, the actual lengths); the ``logits``, and
  the pool rows at the step's slots read back from the device pools (through the executor's block swap-out)
  against what the twin's ref ops wrote there (its ``<pool>`` + ``REF_SUFFIX`` outputs).
- ``readonly``: per-layer pools as plain inputs, the read-only inputs (the context before the step); the
  ``logits`` and ``kv_new`` (layer-major) against the twin's.
- a pooling bundle (task embed | score, no KV pool): every gear filled with seeded sequences; its one output.

Each gear's line gives the largest relative difference per output and the wall time of the gear's run (inputs in,
execute, outputs out). Then the device memory the load took against the need checked before it and the manifest's
plan; exit 0 when every gear passes, 1 otherwise.

The twin is built here from the recipe the bundle was compiled from (its digest must equal the manifest's) and the
unfused export in the stage cache (re-exported when missing): bundles carry no second copy of the weights. This
needs the export extra (onnx_ir, onnxscript; torch only to re-export).

Tolerance: ``max |OM − twin| ≤ tol × max(1, max |twin|)`` per output, ``tol`` from :data:`TOLERANCE` by the graph's
float type. [unverified: no NPU run has measured the drift; float16 allows for the NPU's own accumulation order]

NOT RUN ON HARDWARE: exercised only against the FAKE pyACL (tests/fake_acl.py), whose "OM" is this same twin — there
every gear matches exactly, which proves the plumbing, not the NPU.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from omforge.contract.ascend import KV_NEW, REF_SUFFIX
from omforge.contract.buckets import STEP_DIMS, Choice
from omforge.contract.manifest import Manifest, load_manifest
from omforge.errors import OmforgeError

TOLERANCE = {"float32": 1e-3, "float16": 2e-2}
"""Allowed ``max |Δ| / max(1, max |twin|)`` per output, by the step graph's float type. [unverified]"""

SEED = 0
POOL_ROWS = "pool rows"
"""The in-place check's name for the pool rows at the step's slots (every layer's K and V pool)."""


@dataclass(frozen=True)
class GearCheck:
    """One gear's comparison: the largest relative difference of each output, the run's wall time, the verdict."""

    gear: tuple[int, ...]
    profile: str
    errors: dict[str, float]
    tolerance: float
    dims: tuple[str, ...] = STEP_DIMS
    ms: float | None = None

    @property
    def ok(self) -> bool:
        return all(e <= self.tolerance for e in self.errors.values())

    def line(self) -> str:
        dims = ", ".join(f"{d}={v}" for d, v in zip(self.dims, self.gear))
        diffs = ", ".join(f"{name} {e:.2e}" for name, e in self.errors.items())
        ms = f"; {self.ms:.2f} ms" if self.ms is not None else ""
        return (f"{'pass' if self.ok else 'FAIL'}  {self.profile:7s} {dims}: max rel |Δ| {diffs} "
                f"(tol {self.tolerance}){ms}")


def build_twin(bundle: Path, manifest: Manifest, recipe_path: Path, out: Path) -> Path:
    """The plain-op twin of the bundle's step graph (the generate step, or a pooling bundle's graph) in ``out``;
    refuses, in one line, a recipe that is not the one the bundle was compiled from."""
    from omforge.compile.ascend.atc import graph_interface
    from omforge.compile.cache import cache_root
    from omforge.export.onnx_export import cached_export, recipe_digest
    from omforge.recipe import load_recipe, retarget

    recipe = retarget(load_recipe(recipe_path), manifest.target)  # as compile --target read it
    if recipe_digest(recipe) != manifest.export.recipe_digest:
        raise OmforgeError(f"--recipe {recipe_path}: not the recipe {bundle} was compiled from (digest "
                           f"{recipe_digest(recipe)[:12]}, the manifest's {manifest.export.recipe_digest[:12]})")
    export = Path(manifest.export.dir)
    if not (export / "model.onnx").is_file():
        export = cached_export(recipe, cache_root() / "exports", quiet=True, isolated=True)
    twin = plain_twin(export, recipe, manifest, out)
    ours = graph_interface(twin, drop_ref_outputs=True)
    theirs = graph_interface(bundle / "ascend" / "step.onnx")
    if ours != theirs:
        diff = next(f"{a} vs the bundle's {b}" for a, b in zip(ours + [None], theirs + [None]) if a != b)
        raise OmforgeError(f"--recipe {recipe_path}: not the recipe {bundle} was compiled from (its step graph "
                           f"differs: {diff})")
    return twin


def plain_twin(export: Path, recipe: Any, manifest: Manifest, out: Path) -> Path:
    """``lower_step_graph(plain=True)`` of ``export`` as the bundle's compile ran it (a pooling bundle with its
    pooling options, a LoRA bundle with its LoRA options) into ``out``; returns the graph's path. ``recipe``: the
    loaded recipe, retargeted."""
    from omforge.compile.ascend.stages import lower_step_graph
    from omforge.compile.options import lora_options, pooling_options

    config = manifest.model.config  # the export's, as the compile read it
    pooling = pooling_options(recipe, export, config) if manifest.pooling is not None else None
    out.mkdir(parents=True, exist_ok=True)
    lower_step_graph(export, out, recipe, manifest.buckets.block_size, plain=True, pooling=pooling,
                     lora=lora_options(recipe, config))
    return out / "step.onnx"


def _profiles(manifest: Manifest) -> dict[tuple[int, ...], tuple[str, tuple[int, ...]]]:
    """The profile (prefill, decode) of each OM gear, and the gear in that profile's dims."""
    return {p.padded(g): (p.name, tuple(g)) for p in manifest.buckets.profiles for g in p.gears or ()}


def gear_step(gear: tuple[int, ...], profile: tuple[str, tuple[int, ...]], num_blocks: int, block_size: int,
              rng: np.random.Generator) -> tuple[Any, list[Any]]:
    """A step that fills ``gear`` exactly, every row real: prefill, one sequence whose chunk ends at its last block;
    decode, ``num_seqs`` sequences each at the last position of its blocks less its index. Blocks are distinct
    across the step wherever the pool holds enough (slots must be unique for an in-place write)."""
    from omforge.runtime.ascend.acl_plan import Piece, Run
    from omforge.runtime.step import SeqWork

    dims = dict(zip(STEP_DIMS, gear))
    t, b, m = dims["num_tokens"], dims["num_seqs"], dims["max_blocks"]
    choice = Choice(profile[0], t, b, dims["max_query_len"], dims["num_logits"], m, profile[1])
    if profile[0] == "prefill":
        table = [int(x) for x in rng.choice(num_blocks, m, replace=num_blocks < m)]
        start = m * block_size - t
        work = [SeqWork([int(x) for x in rng.integers(3, 200, t)], start, table, needs_logits=True)]
        return Run(choice, (Piece(0, start, t, True),)), work
    blocks = rng.choice(num_blocks, b * m, replace=num_blocks < b * m).reshape(b, m)
    work, pieces = [], []
    for i in range(b):
        start = max(m * block_size - 1 - i, 0)
        work.append(SeqWork([int(rng.integers(3, 200))], start, [int(x) for x in blocks[i]], needs_logits=True))
        pieces.append(Piece(i, start, 1, True))
    return Run(choice, tuple(pieces)), work


def verify(bundle: Path, recipe_path: Path, *, device: int = 0, acl: Any = None,
           say: Callable[[str], None] = print) -> bool:
    """Run every gear of ``bundle`` on the NPU (``acl``: pyACL, or a fake in tests) against the plain twin; report
    through ``say`` (the mode first, one line per gear, the memory, the verdict); True when every gear is within
    tolerance."""
    import onnxruntime as ort

    bundle = Path(bundle)
    manifest = load_manifest(bundle)
    asc = manifest.ascend
    if asc is None:
        raise OmforgeError(f"{bundle}: not an ascend bundle (target {manifest.target}); verify checks an OM")
    if manifest.pooling is not None:
        mode = f"pooling (task {manifest.task})"
        say(f"mode: {mode}: no KV pool; each gear's '{manifest.pooling.output}' against the twin")
    else:
        mode = f"paged attention {asc.paged_attention}"
        note = asc.paged_attention_note or "a bundle from before the modes"
        if not note.startswith(asc.paged_attention):
            note = f"{asc.paged_attention}: {note}"
        say(f"mode: paged attention {note}")
    with tempfile.TemporaryDirectory(prefix="omforge-verify-") as tmp:
        twin = ort.InferenceSession(str(build_twin(bundle, manifest, recipe_path, Path(tmp))),
                                    providers=["CPUExecutionProvider"])
        if manifest.pooling is not None:
            checks, dtype, memory = _verify_pooling(bundle, manifest, twin, device, acl, say)
        else:
            checks, dtype, memory = _verify_generate(bundle, manifest, twin, device, acl, say)
    used, need, measured = memory
    plan = asc.memory.total_bytes
    passed = sum(c.ok for c in checks)
    say(f"device memory: {_gib(used)} used by the loaded bundle; {_gib(need)} needed by the check before load "
        f"({'aclmdlQuerySize' if measured else 'estimate'}), {_gib(plan)} in the manifest's plan")
    say(f"{passed}/{len(checks)} gears within tolerance ({TOLERANCE[dtype]} × max |twin|, {dtype} graph) against "
        f"the ORT plain twin; {mode}")
    return passed == len(checks)


def _twin_feeds(twin: Any, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The executor's integer inputs in the twin's index types (int32 where the graph says so)."""
    types = {i.name: i.type for i in twin.get_inputs()}
    return {n: v.astype(np.int32 if types[n] == "tensor(int32)" else np.int64) for n, v in inputs.items()
            if n in types}


def _verify_generate(bundle: Path, manifest: Manifest, twin: Any, device: int, acl: Any,
                     say: Callable[[str], None]) -> tuple[list[GearCheck], str, tuple[int, int, bool]]:
    """Every gear of a generate bundle (gather or in place: see the module docstring)."""
    from omforge.contract.buckets import om_gear
    from omforge.runtime.ascend.acl_executor import AclExecutor
    from omforge.runtime.ascend.acl_plan import pack_run

    layout = manifest.kv.paged_layout
    dtype = np.dtype(layout.kv_dtype)
    tol = TOLERANCE[dtype.name]
    profiles = _profiles(manifest)
    bs = layout.block_size
    checks = []
    with AclExecutor(bundle, manifest, device=device, acl=acl) as ex:
        rng = np.random.default_rng(SEED)
        pools = _host_pools(ex, twin)
        for gear in manifest.ascend.gears:
            run, work = gear_step(gear, profiles[gear], ex.num_blocks, bs, rng)
            _fill_blocks(ex, pools, sorted({b for w in work for b in w.block_table}), rng)
            packed = pack_run(run, work, bs, ex.scratch, readonly=ex.readonly)
            dims = dict(zip(STEP_DIMS, om_gear(run.choice)))
            shapes = {t.name: tuple(d if isinstance(d, int) else dims[d] for d in t.shape)
                      for t in manifest.abi.outputs}
            t0 = time.perf_counter()
            got = ex.run_gear(om_gear(run.choice), packed.inputs, shapes)
            ms = (time.perf_counter() - t0) * 1e3
            want = dict(zip([o.name for o in twin.get_outputs()],
                            twin.run(None, {**_twin_feeds(twin, packed.inputs), **pools})))
            errors = {"logits": _rel_error(got["logits"], want["logits"])}
            if ex.inplace:
                errors[POOL_ROWS] = _pool_rows_error(ex, packed.slots, want)
            else:
                errors[KV_NEW] = _rel_error(got[KV_NEW], want[KV_NEW])
            checks.append(GearCheck(tuple(gear), profiles[gear][0], errors, tol, ms=ms))
            say(checks[-1].line())
        used = ex.free_at_open - ex.rt.free_device_memory()[0]
        memory = (used, ex.need.total, ex.need.measured)
    return checks, dtype.name, memory


def _host_pools(ex: Any, twin: Any) -> dict[str, np.ndarray]:
    """The twin's pool inputs, zeros at the twin's shapes (the host mirror of the device pools): ``kv_cache``
    (gather) or every ``key_cache.N`` / ``value_cache.N`` (in place)."""
    shapes = {i.name: i.shape for i in twin.get_inputs()}
    return {name: np.zeros(shapes[name], ex.pool_dtype) for name in ex.pool_names}


def _slot_rows(ex: Any, pool: np.ndarray) -> np.ndarray:
    """A host pool as one row per slot (gather: every layer's K and V; in place: one layer's K or V)."""
    return pool.reshape(ex.num_slots, -1)


def _fill_blocks(ex: Any, pools: dict[str, np.ndarray], blocks: list[int], rng: np.random.Generator) -> None:
    """Seeded values in ``blocks`` of the host pools and of the device pools (through the executor's swap-in: a
    block's pieces end to end, in ``ex.pool_names`` order)."""
    bs = ex.layout.block_size
    ex.allocate_host(1)
    for b in blocks:
        pieces = []
        for name in ex.pool_names:
            rows = _slot_rows(ex, pools[name])[b * bs:(b + 1) * bs]
            rows[...] = rng.standard_normal(rows.shape).astype(rows.dtype)
            pieces.append(rows.tobytes())
        ex.host_pool[0] = np.frombuffer(b"".join(pieces), np.uint8)
        ex.swap_in([(0, b)])


def _pool_rows_error(ex: Any, slots: np.ndarray, want: dict[str, np.ndarray]) -> float:
    """In place: the largest relative difference, over every pool, between the device's rows at ``slots`` (read
    back through the executor's block swap-out) and the twin's ``<pool>.ref`` rows there."""
    bs = ex.layout.block_size
    blocks = sorted({int(s) // bs for s in slots})
    ex.allocate_host(len(blocks))
    ex.swap_out([(b, h) for h, b in enumerate(blocks)])
    at = {b: h for h, b in enumerate(blocks)}
    worst = 0.0
    for i, name in enumerate(ex.pool_names):
        device = np.stack([np.frombuffer(ex.host_pool[at[int(s) // bs], i * ex.piece_bytes:(i + 1) * ex.piece_bytes]
                                         .tobytes(), ex.pool_dtype).reshape(bs, -1)[int(s) % bs] for s in slots])
        twin = _slot_rows(ex, want[name + REF_SUFFIX])[slots]
        worst = max(worst, _rel_error(device, twin))
    return worst


def _verify_pooling(bundle: Path, manifest: Manifest, twin: Any, device: int, acl: Any,
                    say: Callable[[str], None]) -> tuple[list[GearCheck], str, tuple[int, int, bool]]:
    """Every gear of a pooling bundle: ``num_seqs`` seeded sequences of ``max_query_len`` tokens."""
    from omforge.runtime.ascend.acl_pooling import AclPoolingExecutor

    dtype = "float32" if manifest.weights.precision == "float32" else "float16"
    output = manifest.pooling.output
    vocab = manifest.model.config.vocab_size
    rng = np.random.default_rng(SEED)
    checks = []
    with AclPoolingExecutor(bundle, manifest, device=device, acl=acl) as ex:
        for gear in ex.gears:
            b, q = gear
            feeds = {"input_ids": rng.integers(1, vocab, (b, q)).astype(np.int64),
                     "position_ids": np.broadcast_to(np.arange(q, dtype=np.int64), (b, q)).copy(),
                     "pool_index": np.arange(b, dtype=np.int64) * q + q - 1}
            t0 = time.perf_counter()
            got = ex.run_gear(feeds, gear)
            ms = (time.perf_counter() - t0) * 1e3
            (want,) = twin.run([output], _twin_feeds(twin, feeds))
            checks.append(GearCheck(gear, "pool", {output: _rel_error(got, want)}, TOLERANCE[dtype],
                                    ("num_seqs", "max_query_len"), ms))
            say(checks[-1].line())
        used = ex.free_at_open - ex.rt.free_device_memory()[0]
        memory = (used, ex.need.total, ex.need.measured)
    return checks, dtype, memory


def _rel_error(got: np.ndarray, want: np.ndarray) -> float:
    if got.shape != want.shape:
        return float("inf")
    diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
    return float(diff.max() / max(1.0, float(np.abs(want.astype(np.float64)).max())))


def _gib(n: int) -> str:
    return f"{n / 2**30:.3f} GiB"
