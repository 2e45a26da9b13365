"""``omforge verify BUNDLE --recipe RECIPE``: the first-run check of an ascend bundle on an NPU.

Loads the bundle's OM through the AscendCL executor (the serving path: memory check, config-handle load, description
check), then runs EVERY compiled gear once on deterministic inputs (seeded tokens, block tables and pool contents, a
context that fills the gear's blocks) and compares the OM's ``logits`` and new KV rows (``kv_new``) with the plain
twin of the same step graph on onnxruntime's CPU provider: ``lower_step_graph(plain=True)``, every fused op as
standard ONNX with the lowering's numerics (what the tests' FAKE pyACL runs). Prints pass/fail per gear and the
device memory the load actually took against the need checked before it and the manifest's plan; exit 0 when every
gear passes, 1 otherwise.

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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from omforge.contract.ascend import KV_NEW, KV_POOL
from omforge.contract.buckets import STEP_DIMS, Choice
from omforge.contract.manifest import Manifest, load_manifest
from omforge.errors import OmforgeError

TOLERANCE = {"float32": 1e-3, "float16": 2e-2}
"""Allowed ``max |Δ| / max(1, max |twin|)`` per output, by the step graph's float type. [unverified]"""

SEED = 0


@dataclass(frozen=True)
class GearCheck:
    """One gear's comparison: the largest relative difference of each output, and the verdict."""

    gear: tuple[int, ...]
    profile: str
    errors: dict[str, float]
    tolerance: float

    @property
    def ok(self) -> bool:
        return all(e <= self.tolerance for e in self.errors.values())

    def line(self) -> str:
        dims = ", ".join(f"{d}={v}" for d, v in zip(STEP_DIMS, self.gear))
        diffs = ", ".join(f"{name} {e:.2e}" for name, e in self.errors.items())
        return f"{'pass' if self.ok else 'FAIL'}  {self.profile:7s} {dims}: max rel |Δ| {diffs} (tol {self.tolerance})"


def build_twin(bundle: Path, manifest: Manifest, recipe_path: Path, out: Path) -> Path:
    """The plain-op twin of the bundle's step graph in ``out``; refuses, in one line, a recipe that is not the one
    the bundle was compiled from."""
    from omforge.compile.ascend import lower_step_graph
    from omforge.compile.atc import graph_interface
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
    lower_step_graph(export, out, recipe, manifest.kv.block_size, plain=True)
    ours, theirs = graph_interface(out / "step.onnx"), graph_interface(bundle / "ascend" / "step.onnx")
    if ours != theirs:
        diff = next(f"{a} vs the bundle's {b}" for a, b in zip(ours + [None], theirs + [None]) if a != b)
        raise OmforgeError(f"--recipe {recipe_path}: not the recipe {bundle} was compiled from (its step graph "
                           f"differs: {diff})")
    return out / "step.onnx"



def _profiles(manifest: Manifest) -> dict[tuple[int, ...], tuple[str, tuple[int, ...]]]:
    """The profile (prefill, decode) of each OM gear, and the gear in that profile's dims."""
    return {p.padded(g): (p.name, tuple(g)) for p in manifest.buckets.profiles for g in p.gears or ()}


def gear_step(gear: tuple[int, ...], profile: tuple[str, tuple[int, ...]], num_blocks: int, block_size: int,
              rng: np.random.Generator) -> tuple[Any, list[Any]]:
    """A step that fills ``gear`` exactly, every row real: prefill, one sequence whose chunk ends at its last block;
    decode, ``num_seqs`` sequences each at the last position of its blocks less its index."""
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
    work, pieces = [], []
    for i in range(b):
        table = [int(x) for x in rng.integers(0, num_blocks, m)]
        start = max(m * block_size - 1 - i, 0)
        work.append(SeqWork([int(rng.integers(3, 200))], start, table, needs_logits=True))
        pieces.append(Piece(i, start, 1, True))
    return Run(choice, tuple(pieces)), work


def verify(bundle: Path, recipe_path: Path, *, device: int = 0, acl: Any = None,
           say: Callable[[str], None] = print) -> bool:
    """Run every gear of ``bundle`` on the NPU (``acl``: pyACL, or a fake in tests) against the plain twin; report
    through ``say``; True when every gear is within tolerance."""
    import onnxruntime as ort

    from omforge.contract.buckets import om_gear
    from omforge.runtime.ascend.acl_executor import AclExecutor
    from omforge.runtime.ascend.acl_plan import pack_run

    bundle = Path(bundle)
    manifest = load_manifest(bundle)
    if manifest.ascend is None:
        raise OmforgeError(f"{bundle}: not an ascend bundle (target {manifest.target}); verify checks an OM")
    if manifest.pooling is not None:
        raise OmforgeError(f"{bundle}: a pooling bundle (task {manifest.task}); verify runs a generate bundle's "
                           "gears (no ACL executor for pooling graphs yet)")
    layout = manifest.kv.paged_layout
    dtype = np.dtype(layout.kv_dtype)
    tol = TOLERANCE[dtype.name]
    profiles = _profiles(manifest)
    with tempfile.TemporaryDirectory(prefix="omforge-verify-") as tmp:
        twin = ort.InferenceSession(str(build_twin(bundle, manifest, recipe_path, Path(tmp))),
                                    providers=["CPUExecutionProvider"])
        twin_types = {i.name: i.type for i in twin.get_inputs()}
        with AclExecutor(bundle, manifest, device=device, acl=acl) as ex:
            rng = np.random.default_rng(SEED)
            pool = np.zeros((ex.num_slots, layout.num_layers, 2, layout.kv_heads, layout.head_dim), dtype)
            checks = []
            for gear in manifest.ascend.gears:
                run, work = gear_step(gear, profiles[gear], ex.num_blocks, layout.block_size, rng)
                _fill_blocks(ex, pool, {b for w in work for b in w.block_table}, layout.block_size, rng)
                packed = pack_run(run, work, layout.block_size)
                dims = dict(zip(STEP_DIMS, om_gear(run.choice)))
                shapes = {t.name: tuple(d if isinstance(d, int) else dims[d] for d in t.shape)
                          for t in manifest.abi.outputs}
                got = ex.run_gear(om_gear(run.choice), packed.inputs, shapes)
                feeds = {n: v.astype(np.int32 if twin_types[n] == "tensor(int32)" else np.int64)
                         for n, v in packed.inputs.items()}
                want = dict(zip([o.name for o in twin.get_outputs()], twin.run(None, {**feeds, KV_POOL: pool})))
                errors = {n: _rel_error(got[n], want[n]) for n in ("logits", KV_NEW)}
                checks.append(GearCheck(tuple(gear), profiles[gear][0], errors, tol))
                say(checks[-1].line())
            used = ex.free_at_open - ex.rt.free_device_memory()[0]
            need, plan = ex.need.total, manifest.ascend.memory.total_bytes
    passed = sum(c.ok for c in checks)
    say(f"device memory: {_gib(used)} used by the loaded bundle; {_gib(need)} needed by the check before load "
        f"({'aclmdlQuerySize' if ex.need.measured else 'estimate'}), {_gib(plan)} in the manifest's plan")
    say(f"{passed}/{len(checks)} gears within tolerance ({tol} × max |twin|, {dtype.name} graph) against the ORT "
        "plain twin")
    return passed == len(checks)


def _fill_blocks(ex: Any, pool: np.ndarray, blocks: set[int], block_size: int, rng: np.random.Generator) -> None:
    """Seeded values in ``blocks`` of the host pool and of the device pool (through the executor's swap-in)."""
    ex.allocate_host(1)
    for b in sorted(blocks):
        rows = pool[b * block_size:(b + 1) * block_size]
        rows[...] = rng.standard_normal(rows.shape).astype(pool.dtype)
        ex.host_pool[0] = np.frombuffer(rows.tobytes(), np.uint8)
        ex.swap_in([(0, b)])


def _rel_error(got: np.ndarray, want: np.ndarray) -> float:
    if got.shape != want.shape:
        return float("inf")
    diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
    return float(diff.max() / max(1.0, float(np.abs(want.astype(np.float64)).max())))


def _gib(n: int) -> str:
    return f"{n / 2**30:.3f} GiB"
