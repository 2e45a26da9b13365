"""The AscendCL executor: runs an ascend bundle's OM models as an :class:`~omforge.runtime.executor.Executor`
(``execute(work) -> logits``, ``copy_blocks``, ``swap_out``, ``swap_in``, ``close``, ``capabilities``).

Set-up (reference/ascend.md §3.2–3.4): ``acl.init``, device, context, stream; every OM of the bundle loaded, its
description read and checked against the manifest (:func:`acl_plan.check_desc`); the per-layer K and V pools
allocated once in device memory (zeroed) and put, as the same buffers, into both models' input datasets — they
stay resident and are never copied whole; one device buffer per step input and output, sized for the largest gear;
one pinned host buffer for logits. Each run of a step (:func:`acl_plan.plan_runs`): the padded step inputs go
host → device, the gear is selected through the dynamic-dims input, the model executes, the logits rows that are
needed come device → host, and the new K/V rows are copied device → device into the pools at their slots, one
copy per run of consecutive slots (§3.6). Teardown runs in reverse order of set-up, also when set-up fails half
way, and goes on past a failing release (the first error is raised at the end).

NOT RUN ON HARDWARE: written from the reference; tested against ``tests/fake_acl.py`` only (a fake ``acl`` that
runs the plain-op twin of the step graph on onnxruntime). What needs an NPU to confirm is marked [unverified].
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from omforge.contract import PagedLayout
from omforge.contract.buckets import BucketPlan
from omforge.errors import OmforgeError
from omforge.runtime.acl_api import AclRuntime, AclUnavailable, import_acl
from omforge.runtime.acl_plan import (
    ACL_DTYPES,
    STEP_GRAPH_INPUTS,
    AclModelMismatch,
    ModelDesc,
    as_dtype,
    check_desc,
    gear_dims,
    max_prompt_len,
    pack_run,
    plan_runs,
    slot_copy_plan,
)
from omforge.runtime.executor import ExecutorCapabilities
from omforge.runtime.step import SeqWork


class OmModelsMissing(OmforgeError):
    """The bundle's OM models were never built (its ATC step is left)."""


@dataclass
class _Model:
    name: str
    model_id: int
    desc: ModelDesc
    in_ptr: dict[str, int] = field(default_factory=dict)
    in_size: dict[str, int] = field(default_factory=dict)
    out_ptr: dict[str, int] = field(default_factory=dict)
    out_size: dict[str, int] = field(default_factory=dict)
    in_dataset: Any = None
    out_dataset: Any = None


def check_bundle(bundle: Path, manifest: dict[str, Any]) -> list[Path]:
    """The OM files of an ascend bundle; :class:`OmModelsMissing` (one line) when they were not built."""
    asc = manifest.get("ascend") or {}
    paths = [bundle / p for p in (asc.get("models") or {}).values()]
    missing = [p for p in paths if not p.is_file()]
    if not paths or missing:
        raise OmModelsMissing(f"{bundle}: the OM models were not built "
                              f"({', '.join(str(p) for p in missing) or 'none listed'}"
                              f"): the ATC step is left; run `bash {bundle}/ascend/build.sh` where CANN is installed")
    return paths


class AclExecutor:
    """One ascend bundle on one NPU. ``acl``: the pyACL module (default ``import acl``; tests pass a fake)."""

    def __init__(self, bundle: Path, manifest: dict[str, Any], *, device: int = 0, acl: Any = None,
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
        check_bundle(bundle, manifest)
        self.rt = AclRuntime(acl)
        kv, asc = manifest["kv"], manifest["ascend"]
        self.layout = PagedLayout.from_manifest(kv)
        self.plan = BucketPlan.from_dict(manifest["buckets"])
        self.num_slots = int(asc["num_slots"])
        self.num_blocks = self.num_slots // self.layout.block_size
        self.max_prompt_len = max_prompt_len(self.plan)
        # plan_runs splits a step into decode-gear and prefill-gear executions anyway: no mixed batches, the
        # scheduler alternates decode and prefill steps; the pool size is compiled into the OM models
        self.capabilities = ExecutorCapabilities(supports_mixed_batches=False, max_prompt_len=self.max_prompt_len,
                                                 num_blocks=self.num_blocks)
        self.vocab = int(manifest["model"]["config"]["vocab_size"])
        abi = manifest["abi"]
        self.inputs = [(t["name"], t["shape"]) for t in abi["inputs"]]
        self.outputs = [(t["name"], t["shape"]) for t in abi["outputs"]]
        self.device = device
        self._undo: list[tuple[str, Callable[[], None]]] = []
        self._lock = threading.Lock()  # a model must not execute on two threads at once (§3.3)
        self.models: dict[str, _Model] = {}
        try:
            self._open(bundle, asc)
        except BaseException:
            self.close()
            raise
        self.allocate_host(num_host_blocks)

    # --- set-up and teardown ------------------------------------------------------------------------------

    def _push(self, what: str, release: Callable[[], None]) -> None:
        self._undo.append((what, release))

    def _open(self, bundle: Path, asc: dict[str, Any]) -> None:
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
        self.pool_dtype = np.dtype(lay.kv_dtype)  # float32, or float16 for an fp16 graph; checked against each OM
        self.row_bytes = lay.kv_heads * lay.head_dim * self.pool_dtype.itemsize
        self.pool_bytes = self.num_slots * self.row_bytes
        self.pools: dict[str, int] = {}
        for layer in range(lay.num_layers):
            for kind in ("key", "value"):
                self.pools[f"{kind}_cache.{layer}"] = self._malloc(self.pool_bytes)
                rt.memset(self.pools[f"{kind}_cache.{layer}"], self.pool_bytes)  # masked slots must not be NaN
        for name, rel in asc["models"].items():
            self.models[name] = self._load(name, bundle / rel)
        logits_bytes = max(m.out_size["logits"] for m in self.models.values())
        self.host_logits_size = logits_bytes
        self.host_logits = rt.malloc_host(logits_bytes)
        self._push("acl.rt.free_host", lambda: rt.free_host(self.host_logits))
        self.block_bytes = lay.block_size * self.row_bytes
        self.host_block = rt.malloc_host(self.block_bytes)
        self._push("acl.rt.free_host", lambda: rt.free_host(self.host_block))

    def _malloc(self, size: int) -> int:
        ptr = self.rt.malloc(size)
        self._push("acl.rt.free", lambda: self.rt.free(ptr))
        return ptr

    def _load(self, name: str, path: Path) -> _Model:
        rt = self.rt
        model_id = rt.load_model(str(path))
        self._push("acl.mdl.unload", lambda: rt.unload_model(model_id))
        desc_handle = rt.create_desc(model_id)
        self._push("acl.mdl.destroy_desc", lambda: rt.destroy_desc(desc_handle))
        desc = rt.describe(desc_handle)
        check_desc(name, desc, self.plan.profile(name), self.inputs, self.outputs, self.num_slots)
        m = _Model(name, model_id, desc)
        for t in desc.inputs:
            if t.name in self.pools:
                if ACL_DTYPES.get(t.dtype) != self.pool_dtype:
                    raise AclModelMismatch(f"OM model '{name}': pool input {t.name} is aclDataType {t.dtype}, "
                                           f"the pools are {self.pool_dtype}")
                m.in_ptr[t.name], m.in_size[t.name] = self.pools[t.name], self.pool_bytes
            else:  # a step input, or the dynamic-dims input (allocated, never written: §3.4)
                m.in_ptr[t.name], m.in_size[t.name] = self._malloc(t.size), t.size
        for t in desc.outputs:
            m.out_ptr[t.name], m.out_size[t.name] = self._malloc(t.size), t.size
        m.in_dataset, in_bufs = rt.create_dataset([(m.in_ptr[t.name], m.in_size[t.name]) for t in desc.inputs])
        self._push("acl.mdl.destroy_dataset", lambda: rt.destroy_dataset(m.in_dataset, in_bufs))
        m.out_dataset, out_bufs = rt.create_dataset([(m.out_ptr[t.name], m.out_size[t.name]) for t in desc.outputs])
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

    # --- steps --------------------------------------------------------------------------------------------

    def execute(self, work: list[SeqWork]) -> np.ndarray:
        """Run one scheduler step (split into gear runs); returns logits ``[items needing logits, vocab]``."""
        needing = [i for i, w in enumerate(work) if w.needs_logits]
        row_of = {item: r for r, item in enumerate(needing)}
        out = np.empty((len(needing), self.vocab), np.float32)
        with self._lock:
            self.rt.set_context(self.context)  # the engine thread is not the thread that loaded the models
            for run in plan_runs(work, self.plan):
                packed = pack_run(run, work, self.layout.block_size)
                m = self.models[run.choice.model]
                self._run(m, run.choice.gear, packed.inputs)
                if packed.logit_rows:
                    logits = self._logits(m, run.choice.num_logits)
                    for model_row, item in packed.logit_rows:
                        out[row_of[item]] = logits[model_row]
                self._store_rows(m, packed.slots)
        return out

    def _run(self, m: _Model, gear: tuple[int, ...], inputs: dict[str, np.ndarray]) -> None:
        rt = self.rt
        for name in STEP_GRAPH_INPUTS:
            t = m.desc.input(name)
            data = as_dtype(inputs[name], t.dtype, name).tobytes()
            rt.host_to_device(m.in_ptr[name], m.in_size[name], data)
        dims = gear_dims(self.plan.profile(m.name), gear, self.inputs, self.num_slots)
        rt.set_dynamic_dims(m.model_id, m.in_dataset, m.desc.dynamic_index, dims)
        rt.execute(m.model_id, m.in_dataset, m.out_dataset)

    def _logits(self, m: _Model, rows: int) -> np.ndarray:
        t = next(o for o in m.desc.outputs if o.name == "logits")
        dtype = ACL_DTYPES[t.dtype]
        count = rows * self.vocab * dtype.itemsize
        raw = self.rt.device_to_host(self.host_logits, self.host_logits_size, m.out_ptr["logits"], count)
        return np.frombuffer(raw, dtype).reshape(rows, self.vocab).astype(np.float32)

    def _store_rows(self, m: _Model, slots: np.ndarray) -> None:
        """The new K/V rows of every layer into the pools at their slots, one D2D copy per consecutive run."""
        rb = self.row_bytes
        for copy in slot_copy_plan(slots):
            dst_off, src_off, count = copy.dst_slot * rb, copy.src_row * rb, copy.rows * rb
            for layer in range(self.layout.num_layers):
                for kind in ("key", "value"):
                    self.rt.device_to_device(self.pools[f"{kind}_cache.{layer}"] + dst_off, self.pool_bytes - dst_off,
                                             m.out_ptr[f"{kind}_new.{layer}"] + src_off, count)

    # --- block copies: copy-on-write and the host swap tier -----------------------------------------------

    def _block(self, pool: str, block: int) -> tuple[int, int]:
        off = block * self.block_bytes
        return self.pools[pool] + off, self.pool_bytes - off

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks ``src → dst`` in every pool (device to device)."""
        if not pairs:
            return
        with self._lock:
            self.rt.set_context(self.context)
            for pool in self.pools:
                for src, dst in pairs:
                    d, d_max = self._block(pool, dst)
                    self.rt.device_to_device(d, d_max, self._block(pool, src)[0], self.block_bytes)

    def allocate_host(self, num_host_blocks: int) -> None:
        """The host swap tier: ``num_host_blocks`` blocks per pool, in host memory."""
        shape = (num_host_blocks, self.block_bytes)
        self.host_pools = {pool: np.zeros(shape, np.uint8) for pool in self.pools}

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Device blocks to host blocks, ``(device, host)`` pairs (through the pinned staging block)."""
        if not pairs:
            return
        with self._lock:
            self.rt.set_context(self.context)
            for pool, host in self.host_pools.items():
                for dev, h in pairs:
                    raw = self.rt.device_to_host(self.host_block, self.block_bytes, self._block(pool, dev)[0],
                                                 self.block_bytes)
                    host[h] = np.frombuffer(raw, np.uint8)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Host blocks back to device blocks, ``(host, device)`` pairs."""
        if not pairs:
            return
        with self._lock:
            self.rt.set_context(self.context)
            for pool, host in self.host_pools.items():
                for h, dev in pairs:
                    d, d_max = self._block(pool, dev)
                    self.rt.host_to_device(d, d_max, host[h].tobytes())
