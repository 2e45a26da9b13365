"""The AscendCL executor: runs an ascend bundle's OM as an :class:`~omforge.runtime.executor.Executor`
(``execute(work) -> logits``, ``copy_blocks``, ``swap_out``, ``swap_in``, ``close``, ``capabilities``).

Set-up (reference/ascend.md §3.2–3.4): ``acl.init``, device, context, stream; the device memory need
(:func:`acl_plan.device_need`) checked against the device's free HBM (``acl.rt.get_mem_info``; a need that does not
fit is refused in one line); the bundle's ONE OM loaded (its gears cover prefill and decode, so the weights are on
the device once) through the config-handle load with ``ACL_MDL_WORKSPACE_MEM_OPTIMIZE`` (manifest ``ACL_LOAD_PATH``:
GE keeps no copy of the inputs and outputs, so the KV pool is on the device once, reference §5.2), its
description read and checked against the manifest (:func:`acl_plan.check_desc`: outputs by index, ACL's
``op:edge:name`` form); the KV pool ``[num_slots, num_layers, 2, kv_heads, head_dim]`` allocated once in device
memory (zeroed) and put, as the same buffer, into the input dataset — it stays resident and is never copied whole;
one device buffer per step input and output, sized for the largest gear; one pinned host buffer for logits. Each
run of a step (:func:`acl_plan.plan_runs`): the padded step inputs go host → device, the gear is selected through
the dynamic-dims input, the model executes, the logits rows that are needed come device → host, and the new rows
of every layer (``kv_new``, slot-major like the pool) are queued device → device into the pool with ONE
``memcpy_async`` per run of consecutive slots on the executor's stream, then one ``synchronize_stream`` — a decode
step of B sequences makes B copies (was 2 × layers × B synchronous ones). Teardown runs in reverse order of
set-up, also when set-up fails half way, and goes on past a failing release (the first error is raised at the end).

NOT RUN ON HARDWARE: written from the reference; tested against ``tests/fake_acl.py`` only (a fake ``acl`` that
runs the plain-op twin of the step graph on onnxruntime and enforces CANN's documented rules). What needs an NPU
to confirm is marked [unverified].
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from omforge.contract.ascend import KV_NEW, KV_POOL, OmNameClash, find_om
from omforge.contract.buckets import om_gear
from omforge.contract.manifest import BundleError, Manifest
from omforge.errors import OmforgeError
from omforge.runtime.ascend.acl_api import AclRuntime, AclUnavailable, import_acl
from omforge.runtime.ascend.acl_plan import (
    ACL_DTYPES,
    DESC_SIZE_SLACK,
    STEP_GRAPH_INPUTS,
    AclModelMismatch,
    ModelDesc,
    as_dtype,
    check_desc,
    check_slot_alignment,
    device_need,
    gear_dims,
    max_prompt_len,
    pack_run,
    plan_runs,
    slot_copy_plan,
)
from omforge.runtime.executor import ExecutorCapabilities
from omforge.runtime.step import SeqWork


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
    line) when it was not built; a BundleError for a bundle with LoRA pools (not fed here yet). (A bundle from before
    the one-OM layout is refused when its manifest is read.)"""
    if manifest.ascend is None:
        raise BundleError(f"{bundle}: not an ascend bundle (target {manifest.target})")
    if manifest.lora is not None:
        raise BundleError(f"{bundle}: compiled with compile.lora, and the ACL executor does not feed LoRA pools yet; "
                          "compile it without compile.lora, or for the ort target")
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


class AclExecutor:
    """One ascend bundle on one NPU. ``acl``: the pyACL module (default ``import acl``; tests pass a fake)."""

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
        self.rt = AclRuntime(acl)
        asc = manifest.ascend
        assert asc is not None  # check_bundle refused a manifest without it
        self.layout = manifest.kv.paged_layout
        self.plan = manifest.buckets
        self.num_slots = asc.num_slots
        self.num_blocks = self.num_slots // self.layout.block_size
        self.max_prompt_len = max_prompt_len(self.plan)
        # plan_runs splits a step into decode-gear and prefill-gear executions anyway: no mixed batches, the
        # scheduler alternates decode and prefill steps; the pool size is compiled into the OM models
        self.capabilities = ExecutorCapabilities(supports_mixed_batches=False, max_prompt_len=self.max_prompt_len,
                                                 num_blocks=self.num_blocks)
        self.vocab = manifest.model.config.vocab_size
        self.inputs = [t.name for t in manifest.abi.inputs]
        self.outputs = [t.name for t in manifest.abi.outputs]
        self.input_shape = asc.input_shape  # what ATC's --input_shape listed
        self.om_gears = asc.gears
        self.memory = asc.memory
        self.device = device
        self._undo: list[tuple[str, Callable[[], None]]] = []
        self._lock = threading.Lock()  # a model must not execute on two threads at once (§3.3)
        try:
            self._open()
        except BaseException:
            self.close()
            raise
        self.allocate_host(num_host_blocks)

    # --- set-up and teardown ------------------------------------------------------------------------------

    def _push(self, what: str, release: Callable[[], None]) -> None:
        self._undo.append((what, release))

    def _open(self) -> None:
        rt = self.rt
        rt.init()
        self._push("acl.finalize", rt.finalize)
        rt.set_device(self.device)
        self._push("acl.rt.reset_device", lambda: rt.reset_device(self.device))
        self.context = rt.create_context(self.device)
        self._push("acl.rt.destroy_context", lambda: rt.destroy_context(self.context))
        self.stream = rt.create_stream()
        self._push("acl.rt.destroy_stream", lambda: rt.destroy_stream(self.stream))
        lay = self.layout
        self.pool_dtype = np.dtype(lay.kv_dtype)  # float32, or float16 for an fp16 graph; checked against the OM
        self.slot_bytes = lay.num_layers * 2 * lay.kv_heads * lay.head_dim * self.pool_dtype.itemsize
        check_slot_alignment(self.slot_bytes)  # slots and kv_new rows are memcpy_async addresses
        self.pool_bytes = self.num_slots * self.slot_bytes
        self._check_memory()
        self.pool = self._malloc(self.pool_bytes + DESC_SIZE_SLACK)  # the OM may describe it a little larger
        rt.memset(self.pool, self.pool_bytes)  # masked slots must not be NaN
        self.model = self._load(self.om)
        self.host_logits_size = self.model.out_size["logits"]
        self.host_logits = rt.malloc_host(self.host_logits_size)
        self._push("acl.rt.free_host", lambda: rt.free_host(self.host_logits))
        self.block_bytes = lay.block_size * self.slot_bytes
        self.host_block = rt.malloc_host(self.block_bytes)
        self._push("acl.rt.free_host", lambda: rt.free_host(self.host_block))

    def _check_memory(self) -> None:
        """Refuse, in one line, a device memory need above the NPU's free HBM (:func:`acl_plan.device_need`, on
        the load path of manifest ``ACL_LOAD_PATH``: the pool and step buffers counted once). ATC's own figures for
        the OM (``aclmdlQuerySize``) replace the compile-time estimate when ACL gives them. Keeps the need and the
        free memory it saw (``need``, ``free_at_open``) for ``omforge verify``."""
        plan = self.memory
        need = device_need(plan.weights_bytes, plan.workspace_bytes_estimate, plan.io_bytes, self.pool_bytes,
                           self.rt.query_size(str(self.om)))
        free, total = self.rt.free_device_memory()
        self.need, self.free_at_open = need, free
        if need.total > free:
            raise DeviceMemoryTooSmall(
                f"{self.om}: the bundle needs {_gib(need.total)} of device memory (weights {_gib(need.weights)}, KV "
                f"pool {_gib(need.pool)} once, step buffers {_gib(need.io)}, workspace {_gib(need.work)}"
                f"{'' if need.measured else ' estimated'}; loaded with ACL_MDL_WORKSPACE_MEM_OPTIMIZE) and NPU "
                f"{self.device} has {_gib(free)} free of {_gib(total)}: compile with a smaller serve.num_kv_blocks "
                "(or max_batch_size / max_seq_len)")

    def _malloc(self, size: int) -> int:
        ptr = self.rt.malloc(size)
        self._push("acl.rt.free", lambda: self.rt.free(ptr))
        return ptr

    def _load(self, path: Path) -> _Model:
        rt = self.rt
        model_id = rt.load_model(str(path))
        self._push("acl.mdl.unload", lambda: rt.unload_model(model_id))
        desc_handle = rt.create_desc(model_id)
        self._push("acl.mdl.destroy_desc", lambda: rt.destroy_desc(desc_handle))
        desc = rt.describe(desc_handle)
        check_desc(desc, self.inputs, self.outputs, self.input_shape, self.om_gears, (KV_POOL, self.pool_bytes))
        m = _Model(model_id, desc)
        for t in desc.inputs:
            if t.name == KV_POOL:
                if ACL_DTYPES.get(t.dtype) != self.pool_dtype:
                    raise AclModelMismatch(f"OM: pool input {t.name} is aclDataType {t.dtype}, the pool is "
                                           f"{self.pool_dtype}")
                m.in_ptr[t.name], m.in_size[t.name] = self.pool, t.size  # check_desc: within DESC_SIZE_SLACK
            else:  # a step input, or the dynamic-dims input (allocated, never written: §3.4)
                m.in_ptr[t.name], m.in_size[t.name] = self._malloc(t.size), t.size
        for name, t in zip(self.outputs, desc.outputs):  # outputs by index: ACL names them op:edge:name
            m.out_ptr[name], m.out_size[name] = self._malloc(t.size), t.size
        m.in_dataset, in_bufs = rt.create_dataset([(m.in_ptr[t.name], m.in_size[t.name]) for t in desc.inputs])
        self._push("acl.mdl.destroy_dataset", lambda: rt.destroy_dataset(m.in_dataset, in_bufs))
        m.out_dataset, out_bufs = rt.create_dataset([(m.out_ptr[n], m.out_size[n]) for n in self.outputs])
        self._push("acl.mdl.destroy_dataset", lambda: rt.destroy_dataset(m.out_dataset, out_bufs))
        return m

    def close(self) -> None:
        """Release everything in reverse order of acquisition; a failing release does not stop the others (the
        first failure is raised after all ran). Idempotent."""
        first: BaseException | None = None
        while self._undo:
            _, release = self._undo.pop()
            try:
                release()
            except BaseException as e:
                first = first or e
        if first is not None:
            raise first

    def __enter__(self) -> AclExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
            for run in plan_runs(work, self.plan):
                packed = pack_run(run, work, self.layout.block_size)
                self._run(om_gear(run.choice), packed.inputs)
                if packed.logit_rows:
                    logits = self._logits(run.choice.num_logits)
                    for model_row, item in packed.logit_rows:
                        out[row_of[item]] = logits[model_row]
                self._store_rows(packed.slots)
        return out

    def _run(self, gear: tuple[int, ...], inputs: dict[str, np.ndarray]) -> None:
        rt, m = self.rt, self.model
        for name in STEP_GRAPH_INPUTS:
            t = m.desc.input(name)
            data = as_dtype(inputs[name], t.dtype, name).tobytes()
            rt.host_to_device(m.in_ptr[name], m.in_size[name], data)
        rt.set_dynamic_dims(m.model_id, m.in_dataset, m.desc.dynamic_index, gear_dims(gear, self.input_shape))
        rt.execute(m.model_id, m.in_dataset, m.out_dataset)

    def run_gear(self, gear: tuple[int, ...], inputs: dict[str, np.ndarray],
                 shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
        """Execute one compiled gear (its step dims, :func:`~omforge.contract.buckets.om_gear`) on the step graph's
        ``inputs`` at that gear's shapes and return every output at ``shapes``, copied to the host; the pool is read,
        nothing is written into it (``omforge verify``)."""
        out: dict[str, np.ndarray] = {}
        with self._on_device():
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

    # --- block copies: copy-on-write and the host swap tier -----------------------------------------------

    def _block(self, block: int) -> tuple[int, int]:
        off = block * self.block_bytes
        return self.pool + off, self.pool_bytes - off

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks ``src → dst`` (device to device; a block holds every layer: one copy each)."""
        if not pairs:
            return
        with self._on_device():
            for src, dst in pairs:
                d, d_max = self._block(dst)
                self.rt.device_to_device_async(d, d_max, self._block(src)[0], self.block_bytes, self.stream)
            self.rt.synchronize(self.stream)

    def allocate_host(self, num_host_blocks: int) -> None:
        """The host swap tier: ``num_host_blocks`` blocks, in host memory."""
        self.host_pool = np.zeros((num_host_blocks, self.block_bytes), np.uint8)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Device blocks to host blocks, ``(device, host)`` pairs (through the pinned staging block)."""
        if not pairs:
            return
        with self._on_device():
            for dev, h in pairs:
                raw = self.rt.device_to_host(self.host_block, self.block_bytes, self._block(dev)[0], self.block_bytes)
                self.host_pool[h] = np.frombuffer(raw, np.uint8)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Host blocks back to device blocks, ``(host, device)`` pairs."""
        if not pairs:
            return
        with self._on_device():
            for h, dev in pairs:
                d, d_max = self._block(dev)
                self.rt.host_to_device(d, d_max, self.host_pool[h].tobytes())
