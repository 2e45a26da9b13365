"""The AscendCL executor: runs an ascend bundle's OM as an :class:`~omforge.runtime.executor.Executor`
(``execute(work) -> logits``, ``copy_blocks``, ``swap_out``, ``swap_in``, ``close``, ``capabilities``).

Set-up (reference/ascend.md §3.2–3.4): ``acl.init``, device, context, stream; the load configured (the config-handle
load with ``ACL_MDL_WORKSPACE_MEM_OPTIMIZE``, manifest ``ACL_LOAD_PATH``: GE keeps no copy of the inputs and outputs,
so the KV pool is on the device once, reference §5.2; when ACL refuses the option the executor says so in one line
and falls back to ``load_from_file``, whose plan counts the pool twice); the device memory need
(:func:`acl_plan.device_need`) checked against the device's free HBM (``acl.rt.get_mem_info``; a need that does not
fit is refused in one line); the bundle's ONE OM loaded (its gears cover prefill and decode, so the weights are on
the device once), what the load reserved compared with the plan (an input GE copies in — zero copy lost — is named
in one line), its description read and checked against what the executor binds (:func:`acl_plan.check_desc`:
inputs in order, outputs by index in ACL's ``op:edge:name`` form, gears, pool sizes); the KV pools allocated once
in device memory (zeroed) and put, as the same buffers, into the input dataset — resident, never copied whole; one
device buffer per step input and output, sized for the largest gear; one pinned host buffer for logits.

Three modes (two pool layouts), by manifest ``ascend.paged_attention``:

- ``gather``: one pool ``kv_cache [num_slots, num_layers, 2, kv_heads, head_dim]``. Each run of a step
  (:func:`acl_plan.plan_runs`): the padded step inputs go host → device, the gear is selected through the
  dynamic-dims input, the model executes, the logits rows that are needed come device → host, and the new rows of
  every layer (``kv_new``, slot-major like the pool) are queued device → device into the pool with ONE
  ``memcpy_async`` per run of consecutive slots, then one ``synchronize_stream``.
- ``inplace``: per-layer pools ``key_cache.N`` / ``value_cache.N`` ``[num_blocks, block_size, kv_heads·head_dim]``,
  carved from one device allocation (each sub-buffer 64-byte aligned) and bound as the OM's RefData inputs: the
  graph writes the step's rows into them (ScatterPaKvCache / ScatterNdUpdate) and its paged kernel reads them. A run
  copies its step inputs in (``slot_mapping`` with the padding rows at distinct scratch slots, the actual lengths)
  and its logits out — nothing else: no ``kv_new``, no row copies. The pool's last ``ascend.scratch_blocks`` blocks
  are scratch and never handed to the scheduler. A block is ``2 × num_layers`` pieces (one per pool) for
  copy-on-write and swapping.
- ``readonly``: the same per-layer pools, bound as plain inputs the graph only reads (FIA over the pool as it was,
  passes/ascend/readonly.py); the step's rows come out as ``kv_new [num_layers, 2, num_tokens, kv, D]`` (layer-major)
  and, after each run, are queued device → device into the pools with ONE ``memcpy_async`` per run of consecutive
  slots PER POOL (2L per run), then one ``synchronize_stream``. Padding rows are never copied: no scratch blocks.

LoRA (a bundle compiled with ``compile.lora``, docs/lora.md): the adapter pools ``lora_a.*`` / ``lora_b.*`` (static
shapes, the graph's float type) are device buffers allocated and zeroed once and bound as the OM's inputs like the KV
pools; their host mirrors are the ``lora_pools`` capability, which the plan's adapter loads write
(runtime/executor.py ``run_plan``); before the next execute the executor copies the slots written since (one
host-to-device copy per slot) — never a whole pool per step. Each run's ``lora_slots [1, num_tokens]`` holds every
real token's adapter slot and 0 (the base model) for the padding rows.

Teardown runs in reverse order of set-up, also when set-up fails half way, and goes on past a failing release (the
first error is raised at the end).

NOT RUN ON HARDWARE: written from the reference; tested against ``tests/fake_acl.py`` only (a fake ``acl`` that
runs the plain-op twin of the step graph on onnxruntime and enforces CANN's documented rules). What needs an NPU
to confirm is marked [unverified].
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from omforge.contract import cdiv
from omforge.contract.ascend import KV_NEW, KV_POOL, OmNameClash, find_om, key_cache, value_cache
from omforge.contract.buckets import om_gear
from omforge.contract.lora import SLOTS_INPUT
from omforge.contract.manifest import BundleError, Manifest
from omforge.errors import OmforgeError
from omforge.runtime.ascend.acl_api import AclRuntime, AclUnavailable, import_acl
from omforge.runtime.ascend.acl_plan import (
    ACL_DTYPES,
    COPY_ALIGN,
    DESC_SIZE_SLACK,
    INPLACE_STEP_INPUTS,
    READONLY_STEP_INPUTS,
    STEP_GRAPH_INPUTS,
    AclModelMismatch,
    ModelDesc,
    Scratch,
    SlotPool,
    as_dtype,
    check_desc,
    check_slot_alignment,
    device_need,
    gear_dims,
    max_prompt_len,
    pack_lora_slots,
    pack_run,
    plan_runs,
    slot_copy_plan,
)
from omforge.runtime.ascend.acl_session import AclSession
from omforge.runtime.executor import ExecutorCapabilities
from omforge.runtime.step import SeqWork

LORA_POOL_PREFIXES = ("lora_a.", "lora_b.")
"""The adapter pool inputs' names (contract/lora.py ``pool_a`` / ``pool_b``)."""


class OmModelsMissing(OmforgeError):
    """The bundle's OM was never built (its ATC step is left)."""


class DeviceMemoryTooSmall(OmforgeError):
    """The bundle's device memory plan does not fit the NPU's free memory."""


@dataclass
class _Model:
    model_id: int
    desc: ModelDesc
    in_ptr: dict[str, int] = field(default_factory=dict)
    in_size: dict[str, int] = field(default_factory=dict)
    out_ptr: dict[str, int] = field(default_factory=dict)
    out_size: dict[str, int] = field(default_factory=dict)
    in_dataset: Any = None
    out_dataset: Any = None


def check_bundle(bundle: Path, manifest: Manifest) -> Path:
    """The OM of an ascend bundle (``<prefix>.om`` or ``<prefix>_<os>_<cpu>.om``); :class:`OmModelsMissing` (one
    line) when it was not built. (A bundle from before the one-OM layout is refused when its manifest is read.)"""
    if manifest.ascend is None:
        raise BundleError(f"{bundle}: not an ascend bundle (target {manifest.target})")
    prefix = manifest.ascend.model
    try:
        om = find_om(bundle / prefix)
    except OmNameClash as e:
        raise OmModelsMissing(str(e)) from None
    if om is None:
        raise OmModelsMissing(f"{bundle}: the OM model was not built ({bundle / prefix}*.om is missing): the "
                              f"ATC step is left; run `bash {bundle}/ascend/build.sh` where CANN is installed")
    return om


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


class AclExecutor(AclSession):
    """One ascend bundle on one NPU. ``acl``: the pyACL module (default ``import acl``; tests pass a fake).
    ``notes``: the one-line notices set-up printed (a refused load option, an input GE copies)."""

    def __init__(self, bundle: Path, manifest: Manifest, *, device: int = 0, acl: Any = None,
                 num_host_blocks: int = 0):
        bundle = Path(bundle)
        if acl is None:
            try:
                acl = import_acl()
            except AclUnavailable as e:
                try:
                    check_bundle(bundle, manifest)
                except OmModelsMissing as missing:
                    raise AclUnavailable(f"{e}; and {missing}") from None
                raise
        self.om = check_bundle(bundle, manifest)
        self._start_session(AclRuntime(acl), device)
        asc = manifest.ascend
        assert asc is not None  # check_bundle refused a manifest without it
        self.layout = manifest.kv.paged_layout
        self.plan = manifest.buckets
        self.mode = asc.paged_attention
        if self.mode not in ("gather", "inplace", "readonly"):
            raise BundleError(f"{bundle}: ascend.paged_attention '{self.mode}' is not built yet (this executor runs "
                              "'inplace', 'readonly' and 'gather' bundles); recompile with compile.paged_attention: "
                              "auto")
        self.inplace = self.mode == "inplace"
        self.readonly = self.mode == "readonly"
        self.per_layer = self.mode != "gather"  # per-layer pools key_cache.N / value_cache.N
        self.num_slots = asc.num_slots
        bs = self.layout.block_size
        total_blocks = self.num_slots // bs
        self.scratch = Scratch(total_blocks - asc.scratch_blocks, asc.scratch_blocks, bs) if self.inplace else None
        self.num_blocks = total_blocks - (asc.scratch_blocks if self.inplace else 0)  # what the scheduler may use
        self.max_prompt_len = max_prompt_len(self.plan, self.per_layer)  # padding rows never enter a context
        # plan_runs splits a step into decode-gear and prefill-gear executions anyway: no mixed batches, the
        # scheduler alternates decode and prefill steps; the pool size is compiled into the OM models
        self.capabilities = ExecutorCapabilities(supports_mixed_batches=False, max_prompt_len=self.max_prompt_len,
                                                 num_blocks=self.num_blocks)
        self.vocab = manifest.model.config.vocab_size
        self.inputs = [t.name for t in manifest.abi.inputs]
        self.outputs = [t.name for t in manifest.abi.outputs]
        self.pool_names = ([n for i in range(self.layout.num_layers) for n in (key_cache(i), value_cache(i))]
                           if self.per_layer else [KV_POOL])
        self.lora_inputs = [n for n in self.inputs if n.startswith(LORA_POOL_PREFIXES)]  # adapter pools: resident
        self.step_inputs = [n for n in self.inputs if n not in self.pool_names and n not in self.lora_inputs]
        made = (*(INPLACE_STEP_INPUTS if self.inplace else READONLY_STEP_INPUTS if self.readonly
                  else STEP_GRAPH_INPUTS), *((SLOTS_INPUT,) if self.lora_inputs else ()))
        if set(self.step_inputs) - set(made) or (self.inplace and KV_NEW in self.outputs) \
                or (self.readonly and KV_NEW not in self.outputs):
            raise BundleError(f"{bundle}: the step graph's inputs {self.step_inputs} / outputs {self.outputs} are "
                              f"not those of a '{self.mode}' bundle this executor feeds ({list(made)})")
        self.input_shape = asc.input_shape  # what ATC's --input_shape listed
        self.om_gears = asc.gears
        if self.scratch is not None:
            most = max(g[0] for g in self.om_gears) - 1  # num_tokens less one real row
            if most > self.scratch.blocks * bs:
                raise BundleError(f"{bundle}: a gear pads up to {most} rows and ascend.scratch_blocks "
                                  f"({self.scratch.blocks}) holds {self.scratch.blocks * bs} distinct scratch slots")
        self.memory = asc.memory
        self._lock = threading.Lock()  # a model must not execute on two threads at once (§3.3)
        self._open_or_close()
        if self.lora_pools:
            self.capabilities = replace(self.capabilities, lora_pools=self.lora_pools)
        self.allocate_host(num_host_blocks)

    # --- set-up and teardown ------------------------------------------------------------------------------

    def _open(self) -> None:
        rt = self.rt
        self._open_device()
        self.stream = rt.create_stream()
        self._push("acl.rt.destroy_stream", lambda: rt.destroy_stream(self.stream))
        lay = self.layout
        self.pool_dtype = np.dtype(lay.kv_dtype)  # float32, or float16 for an fp16 graph; checked against the OM
        self.slot_bytes = lay.num_layers * 2 * lay.kv_heads * lay.head_dim * self.pool_dtype.itemsize
        if self.per_layer:
            self.row_bytes = lay.kv_heads * lay.head_dim * self.pool_dtype.itemsize  # one slot of one pool
            self.piece_bytes = lay.block_size * self.row_bytes
            check_slot_alignment(self.row_bytes if self.readonly else self.piece_bytes)  # memcpy_async addresses
            self.one_pool_bytes = self.num_slots // lay.block_size * self.piece_bytes
        else:
            check_slot_alignment(self.slot_bytes)  # slots and kv_new rows are memcpy_async addresses
        self.pool_bytes = self.num_slots * self.slot_bytes  # every pool together
        handle, refused = rt.open_load_config(str(self.om))
        if handle is None:
            self._say(f"{self.om}: ACL refused ACL_MDL_WORKSPACE_MEM_OPTIMIZE (code {refused}); loading with "
                      "acl.mdl.load_from_file instead: GE reserves the model's inputs and outputs again, so the KV "
                      "pool counts twice in the memory plan")
        try:
            self._check_memory(optimized=handle is not None)
            self._allocate_pools()
            self.model = self._load(self.om, handle)
        except BaseException:
            if handle is not None:
                rt.destroy_config(handle, check=False)  # the first failure is the one raised
            raise
        if handle is not None:  # once the model is loaded (aclpythondevg_01_0162's call order)
            rt.destroy_config(handle)
        self.host_logits_size = self.model.out_size["logits"]
        self.host_logits = rt.malloc_host(self.host_logits_size)
        self._push("acl.rt.free_host", lambda: rt.free_host(self.host_logits))
        self.block_bytes = lay.block_size * self.slot_bytes  # every pool's share of one block
        staging = self.piece_bytes if self.per_layer else self.block_bytes
        self.host_block = rt.malloc_host(staging)
        self._push("acl.rt.free_host", lambda: rt.free_host(self.host_block))

    def _allocate_pools(self) -> None:
        """The pools in one device allocation, zeroed (masked slots must not be NaN). In place: one sub-buffer per
        pool, each starting at a multiple of :data:`COPY_ALIGN` and with room for the OM's described size."""
        if not self.per_layer:
            self.pool = self._malloc(self.pool_bytes + DESC_SIZE_SLACK)  # the OM may describe it a little larger
            self.rt.memset(self.pool, self.pool_bytes)
            self.pool_ptr = {KV_POOL: self.pool}
            return
        stride = cdiv(self.one_pool_bytes + DESC_SIZE_SLACK, COPY_ALIGN) * COPY_ALIGN
        self.pool = self._malloc(stride * len(self.pool_names))
        self.rt.memset(self.pool, stride * len(self.pool_names))
        self.pool_ptr = {name: self.pool + i * stride for i, name in enumerate(self.pool_names)}

    def _check_memory(self, optimized: bool) -> None:
        """Refuse, in one line, a device memory need above the NPU's free HBM (:func:`acl_plan.device_need`, on
        the load path used: with ``ACL_LOAD_PATH`` the pool and step buffers counted once, on the fallback twice).
        ATC's own figures for the OM (``aclmdlQuerySize``) replace the compile-time estimate when ACL gives them.
        Keeps the need and the free memory it saw (``need``, ``free_at_open``) for ``omforge verify``."""
        plan = self.memory
        self.queried = self.rt.query_size(str(self.om))
        need = device_need(plan.weights_bytes, plan.workspace_bytes_estimate, plan.io_bytes, self.pool_bytes,
                           self.queried, optimized)
        free, total = self.rt.free_device_memory()
        self.need, self.free_at_open = need, free
        if need.total > free:
            load = ("loaded with ACL_MDL_WORKSPACE_MEM_OPTIMIZE" if optimized else
                    "loaded with load_from_file: the pool and step buffers counted twice")
            raise DeviceMemoryTooSmall(
                f"{self.om}: the bundle needs {_gib(need.total)} of device memory (weights {_gib(need.weights)}, KV "
                f"pool {_gib(need.pool)}, step buffers {_gib(need.io)}, workspace {_gib(need.work)}"
                f"{'' if need.measured else ' estimated'}; {load}) and NPU "
                f"{self.device} has {_gib(free)} free of {_gib(total)}: compile with a smaller serve.num_kv_blocks "
                "(or max_batch_size / max_seq_len)")

    def _load(self, path: Path, handle: Any) -> _Model:
        rt = self.rt
        free_before = rt.free_device_memory()[0]
        model_id = rt.load_with_config(handle, str(path)) if handle is not None else rt.load_from_file(str(path))
        self._push("acl.mdl.unload", lambda: rt.unload_model(model_id))
        desc_handle = rt.create_desc(model_id)
        self._push("acl.mdl.destroy_desc", lambda: rt.destroy_desc(desc_handle))
        desc = rt.describe(desc_handle)
        pools = [(n, self.one_pool_bytes if self.per_layer else self.pool_bytes) for n in self.pool_names]
        check_desc(desc, self.inputs, self.outputs, self.input_shape, self.om_gears, pools)
        self._check_load_reservation(desc, free_before - rt.free_device_memory()[0], handle is not None)
        m = _Model(model_id, desc)
        for t in desc.inputs:
            if t.name in self.pool_ptr:
                if ACL_DTYPES.get(t.dtype) != self.pool_dtype:
                    raise AclModelMismatch(f"OM: pool input {t.name} is aclDataType {t.dtype}, the pool is "
                                           f"{self.pool_dtype}")
                m.in_ptr[t.name], m.in_size[t.name] = self.pool_ptr[t.name], t.size  # check_desc: within slack
            else:  # a step input, or the dynamic-dims input (allocated, never written: §3.4)
                m.in_ptr[t.name], m.in_size[t.name] = self._malloc(t.size), t.size
        for name, t in zip(self.outputs, desc.outputs):  # outputs by index: ACL names them op:edge:name
            m.out_ptr[name], m.out_size[name] = self._malloc(t.size), t.size
        self.lora_pools = self._lora_pools(m)
        m.in_dataset, in_bufs = rt.create_dataset([(m.in_ptr[t.name], m.in_size[t.name]) for t in desc.inputs])
        self._push("acl.mdl.destroy_dataset", lambda: rt.destroy_dataset(m.in_dataset, in_bufs))
        m.out_dataset, out_bufs = rt.create_dataset([(m.out_ptr[n], m.out_size[n]) for n in self.outputs])
        self._push("acl.mdl.destroy_dataset", lambda: rt.destroy_dataset(m.out_dataset, out_bufs))
        return m

    def _lora_pools(self, m: _Model) -> dict[str, SlotPool]:
        """The LoRA adapter pools (docs/lora.md; ``lora_a.*`` / ``lora_b.*`` inputs of static shape, the graph's
        float type): each a device buffer, zeroed (slot 0 is the base model), bound as the OM's input once like the
        KV pools, and a host :class:`SlotPool` of the same shape — the ``lora_pools`` capability the plan's adapter
        loads write; :meth:`_sync_lora` copies the slots they wrote to the device before the next execute."""
        pools = {}
        for name in self.lora_inputs:
            t = m.desc.input(name)
            dtype = ACL_DTYPES.get(t.dtype)
            if dtype is None or dtype.kind != "f" or any(d < 1 for d in t.dims) or \
                    int(np.prod(t.dims)) * dtype.itemsize > t.size:
                raise AclModelMismatch(f"OM: LoRA pool input {name} is aclDataType {t.dtype} dims {list(t.dims)} "
                                       f"({t.size} bytes): expected a float tensor of static shape")
            self.rt.memset(m.in_ptr[name], t.size)
            pools[name] = SlotPool(t.dims, dtype)
        return pools

    def _sync_lora(self) -> None:
        """Copy every LoRA pool slot written on the host since the last execute to the device (one host-to-device
        copy per slot: a slot is contiguous, the pool's leading dim)."""
        m = self.model
        for name, pool in self.lora_pools.items():
            slot_bytes = pool[0].nbytes
            for s in sorted(pool.dirty):
                off = s * slot_bytes
                self.rt.host_to_device(m.in_ptr[name] + off, m.in_size[name] - off, np.asarray(pool[s]).tobytes())
            pool.dirty.clear()

    def _check_load_reservation(self, desc: ModelDesc, reserved: int, optimized: bool) -> None:
        """Compare what the load took of the device with the plan: weights and work (aclmdlQuerySize, less the
        model's inputs and outputs when ``optimized``; the manifest's estimate otherwise). An excess the size of an
        input means GE copies that input in on every execute — zero copy lost (hicann/ge ``davinci_model.cc:2282-2290``,
        decided at build time in ``block_mem_zero_copy.cc:38-55, 217-242``; reference §5.3): said in one line
        naming the pool input (in place the pools are alike: how many of them). [unverified: a real load may reserve
        other memory the plan does not know]"""
        io = sum(t.size for t in desc.inputs) + sum(t.size for t in desc.outputs)
        if self.queried is not None:
            work, weights = self.queried
            expected, how = weights + work - (io if optimized else 0), "aclmdlQuerySize"
        else:
            plan = self.memory
            expected = plan.weights_bytes + plan.workspace_bytes_estimate + (0 if optimized else io)
            how = "the manifest's estimate"
        excess = reserved - expected
        pools = [t for t in desc.inputs if t.name in self.pool_ptr]
        size = min(t.size for t in pools)
        if excess + DESC_SIZE_SLACK < size:
            return
        names = [t.name for t in pools]
        which = f"input '{names[0]}'" if len(names) == 1 else \
            f"{round(excess / size)} of the pool inputs {names[0]} … {names[-1]} ({size} bytes each)"
        self._say(f"{self.om}: the load took {excess} bytes more than {how} plans, the size of {which}: GE copies it "
                  "in on every execute (zero copy lost, davinci_model.cc:2282-2290) and the device holds it twice")

    @contextmanager
    def _on_device(self) -> Iterator[None]:
        """One caller at a time (a model must not execute on two threads at once, §3.3), in the executor's context
        (the engine thread is not the thread that loaded the model)."""
        with self._lock:
            self.rt.set_context(self.context)
            yield

    # --- steps --------------------------------------------------------------------------------------------

    def execute(self, work: list[SeqWork]) -> np.ndarray:
        """Run one scheduler step (split into gear runs); returns logits ``[items needing logits, vocab]``."""
        needing = [i for i, w in enumerate(work) if w.needs_logits]
        row_of = {item: r for r, item in enumerate(needing)}
        out = np.empty((len(needing), self.vocab), np.float32)
        with self._on_device():
            self._sync_lora()
            for run in plan_runs(work, self.plan, self.per_layer):
                packed = pack_run(run, work, self.layout.block_size, self.scratch, readonly=self.readonly)
                if self.lora_inputs:
                    packed.inputs[SLOTS_INPUT] = pack_lora_slots(run, work, run.choice.num_tokens)
                self._run(om_gear(run.choice), packed.inputs)
                if packed.logit_rows:
                    logits = self._logits(run.choice.num_logits)
                    for model_row, item in packed.logit_rows:
                        out[row_of[item]] = logits[model_row]
                if self.readonly:
                    self._store_pool_rows(packed.slots, run.choice.num_tokens)
                elif not self.inplace:  # in place, the graph wrote the rows into the pools itself
                    self._store_rows(packed.slots)
        return out

    def _run(self, gear: tuple[int, ...], inputs: dict[str, np.ndarray]) -> None:
        rt, m = self.rt, self.model
        for name in self.step_inputs:
            t = m.desc.input(name)
            data = as_dtype(inputs[name], t.dtype, name).tobytes()
            rt.host_to_device(m.in_ptr[name], m.in_size[name], data)
        rt.set_dynamic_dims(m.model_id, m.in_dataset, m.desc.dynamic_index, gear_dims(gear, self.input_shape))
        rt.execute(m.model_id, m.in_dataset, m.out_dataset)

    def run_gear(self, gear: tuple[int, ...], inputs: dict[str, np.ndarray],
                 shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
        """Execute one compiled gear (its step dims, :func:`~omforge.contract.buckets.om_gear`) on the step graph's
        ``inputs`` at that gear's shapes and return every output at ``shapes``, copied to the host (``omforge
        verify``). A gather pool is only read; in place, the graph also writes the run's rows at its slots."""
        out: dict[str, np.ndarray] = {}
        with self._on_device():
            self._sync_lora()
            self._run(gear, inputs)
            for name, t in zip(self.outputs, self.model.desc.outputs):
                dtype = ACL_DTYPES[t.dtype]
                count = int(np.prod(shapes[name])) * dtype.itemsize
                host = self.rt.malloc_host(count)
                try:
                    raw = self.rt.device_to_host(host, count, self.model.out_ptr[name], count)
                finally:
                    self.rt.free_host(host)
                out[name] = np.frombuffer(raw, dtype).reshape(shapes[name]).copy()
        return out

    def _logits(self, rows: int) -> np.ndarray:
        t = self.model.desc.outputs[self.outputs.index("logits")]
        dtype = ACL_DTYPES[t.dtype]
        count = rows * self.vocab * dtype.itemsize
        raw = self.rt.device_to_host(self.host_logits, self.host_logits_size, self.model.out_ptr["logits"], count)
        return np.frombuffer(raw, dtype).reshape(rows, self.vocab).astype(np.float32)

    def _store_rows(self, slots: np.ndarray) -> None:
        """The new rows of every layer into the pool at their slots: one async D2D copy per run of consecutive
        slots (a slot holds all layers' K and V rows, in the pool and in ``kv_new`` alike), one synchronize."""
        sb, src = self.slot_bytes, self.model.out_ptr[KV_NEW]
        for copy in slot_copy_plan(slots):
            dst_off = copy.dst_slot * sb
            self.rt.device_to_device_async(self.pool + dst_off, self.pool_bytes - dst_off, src + copy.src_row * sb,
                                           copy.rows * sb, self.stream)
        self.rt.synchronize(self.stream)  # the next run reads the pool

    def _store_pool_rows(self, slots: np.ndarray, num_tokens: int) -> None:
        """Readonly: ``kv_new [L, 2, num_tokens, kv, D]`` (``num_tokens``: the run's gear) into the per-layer pools:
        pool ``2N + kind`` (K0 V0 K1 V1 …) takes ``kv_new[N, kind]``, one async D2D copy per run of consecutive slots
        per pool (2L copies per run), then one synchronize (the next run reads the pools)."""
        rb, src = self.row_bytes, self.model.out_ptr[KV_NEW]
        for copy in slot_copy_plan(slots):
            dst_off = copy.dst_slot * rb
            for i, name in enumerate(self.pool_names):
                self.rt.device_to_device_async(self.pool_ptr[name] + dst_off, self.one_pool_bytes - dst_off,
                                               src + (i * num_tokens + copy.src_row) * rb, copy.rows * rb,
                                               self.stream)
        self.rt.synchronize(self.stream)

    # --- block copies: copy-on-write and the host swap tier -----------------------------------------------

    def _pieces(self, block: int) -> list[tuple[int, int, int]]:
        """Block ``block`` as ``(address, bytes left in its pool from there, bytes)`` per pool: one piece holding
        every layer (gather: the block's slots are contiguous) or ``2 × num_layers`` (in place, K0 V0 K1 V1 …)."""
        if not self.per_layer:
            off = block * self.block_bytes
            return [(self.pool + off, self.pool_bytes - off, self.block_bytes)]
        off = block * self.piece_bytes
        return [(self.pool_ptr[n] + off, self.one_pool_bytes - off, self.piece_bytes) for n in self.pool_names]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks ``src → dst`` (device to device, in every layer's K and V), one sync at the end."""
        if not pairs:
            return
        with self._on_device():
            for src, dst in pairs:
                for (d, d_max, n), (s, _, _) in zip(self._pieces(dst), self._pieces(src)):
                    self.rt.device_to_device_async(d, d_max, s, n, self.stream)
            self.rt.synchronize(self.stream)

    def allocate_host(self, num_host_blocks: int) -> None:
        """The host swap tier: ``num_host_blocks`` blocks, in host memory (a block: its pieces end to end)."""
        self.host_pool = np.zeros((num_host_blocks, self.block_bytes), np.uint8)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Device blocks to host blocks, ``(device, host)`` pairs (through the pinned staging buffer)."""
        if not pairs:
            return
        with self._on_device():
            for dev, h in pairs:
                at = 0
                for src, _, n in self._pieces(dev):
                    raw = self.rt.device_to_host(self.host_block, n, src, n)
                    self.host_pool[h, at:at + n] = np.frombuffer(raw, np.uint8)
                    at += n

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Host blocks back to device blocks, ``(host, device)`` pairs."""
        if not pairs:
            return
        with self._on_device():
            for h, dev in pairs:
                at = 0
                for dst, d_max, n in self._pieces(dev):
                    self.rt.host_to_device(dst, d_max, self.host_pool[h, at:at + n].tobytes())
                    at += n
