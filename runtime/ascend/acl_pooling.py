"""The AscendCL executor of a pooling bundle (task embed | score; contract/pooling.py): the OM runs whole, right-padded
sequences; no KV pool, no decode, nothing kept between runs. It has the ORT pooling executor's surface
(``run(inputs) -> rows``, runtime/ort/pooling_executor.py) so :class:`~omforge.runtime.pooling.PoolingEngine` drives
either.

Set-up as the generate executor's (acl_executor.py; reference/ascend.md §3.2–3.4): ``acl.init``, device, context;
the OM loaded with ``ACL_MDL_WORKSPACE_MEM_OPTIMIZE`` (the plain ``load_from_file`` when ACL refuses it, said in one
line); the device memory need (weights, step buffers, work) checked against the free HBM first; the description
checked (:func:`acl_plan.check_desc`: inputs ``input_ids, position_ids, pool_index`` in order, the one output, the
gears over ``ascend.gear_dims`` = ``(num_seqs, max_query_len)``); one device buffer per input and output, sized for
the largest gear.

A run (:func:`pooling_runs` splits the engine's batch): its sequences padded to the smallest compiled gear
``(B', Q')`` that holds them — padding tokens id 0 after each sequence (causal attention: they never reach a real
row), padding sequences one token — with ``pool_index`` recomputed for ``Q'``; the inputs host → device, the gear
selected, execute, the first ``B`` output rows device → host.

NOT RUN ON HARDWARE: tested against ``tests/fake_acl.py`` only (its "OM" is the bundle's plain-op twin).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from omforge.contract.buckets import STEP_DIMS
from omforge.contract.manifest import BundleError, Manifest
from omforge.contract.pooling import POOLING_INPUTS
from omforge.errors import OmforgeError
from omforge.runtime.ascend.acl_api import AclRuntime, import_acl
from omforge.runtime.ascend.acl_plan import ACL_DTYPES, as_dtype, check_desc, device_need, gear_dims
from omforge.runtime.ascend.acl_session import AclSession


def step_gear(gear: Sequence[int], gear_dim_names: Sequence[str]) -> tuple[int, ...]:
    """A pooling gear (values over ``ascend.gear_dims``) as the five step dims :func:`acl_plan.gear_dims` reads
    (``num_tokens = num_seqs × max_query_len``, one logits row per sequence, no blocks)."""
    v = dict(zip(gear_dim_names, gear))
    b, q = v["num_seqs"], v["max_query_len"]
    return tuple({"num_tokens": b * q, "num_seqs": b, "max_query_len": q, "num_logits": b, "max_blocks": 1}[d]
                 for d in STEP_DIMS)


def smallest_gear(gears: Sequence[tuple[int, int]], num_seqs: int, longest: int) -> tuple[int, int] | None:
    """The compiled ``(num_seqs, max_query_len)`` gear with the fewest padded tokens that holds ``num_seqs``
    sequences of up to ``longest`` tokens; None when none does."""
    fits = [g for g in gears if g[0] >= num_seqs and g[1] >= longest]
    return min(fits, key=lambda g: (g[0] * g[1], g[1])) if fits else None


def pooling_runs(lens: Sequence[int], gears: Sequence[tuple[int, int]]) -> list[tuple[range, tuple[int, int]]]:
    """Split a batch of sequences (their lengths, in order) into consecutive groups, each on one gear: a group
    grows while some gear holds it. Raises :class:`OmforgeError` (one line) for a sequence no gear holds."""
    runs: list[tuple[range, tuple[int, int]]] = []
    start = 0
    while start < len(lens):
        gear = smallest_gear(gears, 1, lens[start])
        if gear is None:
            raise OmforgeError(f"a pooling input of {lens[start]} tokens is longer than every compiled gear "
                               f"(max_query_len ≤ {max(g[1] for g in gears)})")
        end = start + 1
        while end < len(lens):
            wider = smallest_gear(gears, end + 1 - start, max(lens[start:end + 1]))
            if wider is None:
                break
            gear, end = wider, end + 1
        runs.append((range(start, end), gear))
        start = end
    return runs


def pad_to_gear(inputs: dict[str, np.ndarray], rows: range, gear: tuple[int, int]) -> dict[str, np.ndarray]:
    """The inputs of sequences ``rows`` of a packed batch (runtime/pooling.py ``pack``) at ``gear``'s shapes."""
    b, q = gear
    ids = np.zeros((b, q), np.int64)
    q_in = inputs["input_ids"].shape[1]
    last = inputs["pool_index"][rows.start:rows.stop] - np.arange(rows.start, rows.stop) * q_in  # len - 1
    width = min(q, q_in)  # the group's sequences end within its gear; columns past it are the batch's padding
    ids[:len(rows), :width] = inputs["input_ids"][rows.start:rows.stop, :width]
    pool_index = np.arange(b, dtype=np.int64) * q  # padding sequences: their first token
    pool_index[:len(rows)] += last
    return {"input_ids": ids, "position_ids": np.broadcast_to(np.arange(q, dtype=np.int64), (b, q)).copy(),
            "pool_index": pool_index}


class AclPoolingExecutor(AclSession):
    """One pooling bundle's OM on one NPU; ``run(inputs)`` → the output rows ``[num_seqs, width]`` float32 of one
    packed batch (runtime/pooling.py ``pack``). ``acl``: pyACL (default ``import acl``; tests pass a fake)."""

    def __init__(self, bundle: Path, manifest: Manifest, *, device: int = 0, acl: Any = None):
        from omforge.runtime.ascend.acl_executor import check_bundle

        bundle = Path(bundle)
        asc = manifest.ascend
        if manifest.pooling is None or asc is None:
            raise BundleError(f"{bundle}: not an ascend pooling bundle (task {manifest.task}, target "
                              f"{manifest.target})")
        self.om = check_bundle(bundle, manifest)  # a missing OM is said before a missing pyACL
        if acl is None:
            acl = import_acl()
        self._start_session(AclRuntime(acl), device)
        self.output = manifest.pooling.output
        self.inputs = [t.name for t in manifest.abi.inputs]
        self.outputs = [t.name for t in manifest.abi.outputs]
        if self.inputs != list(POOLING_INPUTS) or self.outputs != [self.output]:
            raise BundleError(f"{bundle}: the pooling graph's inputs {self.inputs} / outputs {self.outputs} are not "
                              f"{list(POOLING_INPUTS)} / ['{self.output}']")
        if set(asc.gear_dims) != {"num_seqs", "max_query_len"}:
            raise BundleError(f"{bundle}: pooling gears over {list(asc.gear_dims)}, expected num_seqs and "
                              "max_query_len")
        self.gears = [tuple(g[asc.gear_dims.index(d)] for d in ("num_seqs", "max_query_len")) for g in asc.gears]
        self.step_gears = [step_gear(g, asc.gear_dims) for g in asc.gears]
        self.input_shape = asc.input_shape
        self.memory = asc.memory
        self._lock = threading.Lock()  # a model must not execute on two threads at once (§3.3)
        self._open_or_close()

    def _open(self) -> None:
        rt = self.rt
        self._open_device()
        handle, refused = rt.open_load_config(str(self.om))
        if handle is None:
            self._say(f"{self.om}: ACL refused ACL_MDL_WORKSPACE_MEM_OPTIMIZE (code {refused}); loading with "
                      "acl.mdl.load_from_file instead: GE reserves the model's inputs and outputs again")
        try:
            plan = self.memory
            need = device_need(plan.weights_bytes, plan.workspace_bytes_estimate, plan.io_bytes, 0,
                               rt.query_size(str(self.om)), handle is not None)
            free, total = rt.free_device_memory()
            self.need, self.free_at_open = need, free  # for omforge verify's memory line
            if need.total > free:
                from omforge.runtime.ascend.acl_executor import DeviceMemoryTooSmall

                raise DeviceMemoryTooSmall(f"{self.om}: the pooling bundle needs {need.total / 2**30:.2f} GiB of "
                                           f"device memory and NPU {self.device} has {free / 2**30:.2f} GiB free of "
                                           f"{total / 2**30:.2f} GiB: compile with smaller compile.buckets")
            self.model_id = rt.load_with_config(handle, str(self.om)) if handle is not None \
                else rt.load_from_file(str(self.om))
        finally:
            if handle is not None:
                rt.destroy_config(handle, check=False)
        self._push("acl.mdl.unload", lambda: rt.unload_model(self.model_id))
        desc_handle = rt.create_desc(self.model_id)
        self._push("acl.mdl.destroy_desc", lambda: rt.destroy_desc(desc_handle))
        self.desc = desc = rt.describe(desc_handle)
        check_desc(desc, self.inputs, self.outputs, self.input_shape, self.step_gears, [])
        self.in_ptr = {t.name: self._malloc(t.size) for t in desc.inputs}  # the dynamic-dims input too (§3.4)
        self.out_ptr, self.out_size = self._malloc(desc.outputs[0].size), desc.outputs[0].size
        self.in_dataset, in_bufs = rt.create_dataset([(self.in_ptr[t.name], t.size) for t in desc.inputs])
        self._push("acl.mdl.destroy_dataset", lambda: rt.destroy_dataset(self.in_dataset, in_bufs))
        self.out_dataset, out_bufs = rt.create_dataset([(self.out_ptr, self.out_size)])
        self._push("acl.mdl.destroy_dataset", lambda: rt.destroy_dataset(self.out_dataset, out_bufs))
        self.host_out = rt.malloc_host(self.out_size)
        self._push("acl.rt.free_host", lambda: rt.free_host(self.host_out))

    def run(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        """The output rows of the packed batch ``inputs``, in order (split into gear runs)."""
        q = inputs["input_ids"].shape[1]
        lens = [int(i) - b * q + 1 for b, i in enumerate(inputs["pool_index"])]
        return np.concatenate([self.run_gear(pad_to_gear(inputs, rows, gear), gear)[:len(rows)]
                               for rows, gear in pooling_runs(lens, self.gears)])

    def run_gear(self, feeds: dict[str, np.ndarray], gear: tuple[int, int]) -> np.ndarray:
        """Execute compiled ``gear`` ``(num_seqs, max_query_len)`` on ``feeds`` at its shapes; every output row.
        One caller at a time, in the executor's context (the engine thread is not the one that loaded the model)."""
        with self._lock:
            self.rt.set_context(self.context)
            return self._execute(feeds, gear)

    def _execute(self, feeds: dict[str, np.ndarray], gear: tuple[int, int]) -> np.ndarray:
        rt, desc = self.rt, self.desc
        for name in self.inputs:
            t = desc.input(name)
            rt.host_to_device(self.in_ptr[name], t.size, as_dtype(feeds[name], t.dtype, name).tobytes())
        step = self.step_gears[self.gears.index(gear)]
        rt.set_dynamic_dims(self.model_id, self.in_dataset, desc.dynamic_index, gear_dims(step, self.input_shape))
        rt.execute(self.model_id, self.in_dataset, self.out_dataset)
        dtype = ACL_DTYPES[desc.outputs[0].dtype]
        width = desc.outputs[0].dims[-1]
        count = gear[0] * width * dtype.itemsize
        raw = rt.device_to_host(self.host_out, self.out_size, self.out_ptr, count)
        return np.frombuffer(raw, dtype).reshape(gear[0], width).astype(np.float32)
