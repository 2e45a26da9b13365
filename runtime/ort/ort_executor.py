"""The ONNX Runtime executor: one session over the step graph, the KV pools allocated once and never copied.

Each layer's pool is a numpy array ``[num_blocks, block_size, kv_heads, head_dim]`` whose slot view is bound
(zero-copy) as the ``key_cache.N`` input. Who writes the step's new rows depends on the graph
(``lower_ort.lower(kv_write=…)``): with ``key_cache_out.N`` outputs (the default) the same buffer is bound as
that output and the in-graph ScatterND writes in place; with ``key_new.N`` outputs the executor stores them at
``slot_mapping`` after the run. Either way no step copies a pool: cost follows the work. A graph lowered to
omforge's CPU kernel (``omforge.kernels.PagedAttention``) needs the kernel library, registered here whenever it
is usable; :meth:`OrtExecutor.for_bundle` checks first that the library can run the bundle.

A graph with LoRA inputs (docs/lora.md) gets its adapter pools the same way: each ``lora_a.*`` / ``lora_b.*`` input
is a zeros float32 array of its ABI shape, allocated and bound once (zero-copy), exposed as :attr:`lora_pools` (input
name → array; the ``lora_pools`` capability): the plan's adapter loads (runtime/lora/slots.py ``LoraLoad``) write
into a slot of those arrays before the step that reads it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from pathlib import Path

import numpy as np
import onnxruntime as ort

from omforge.contract import PagedLayout
from omforge.contract.manifest import Manifest
from omforge.runtime.executor import ExecutorCapabilities, HostKVPools
from omforge.runtime.ort import kernels
from omforge.runtime.step import SeqWork, build_step

BFLOAT16 = 16  # ONNX element type: numpy has no bfloat16, so bf16 pools are uint16 arrays bound with this type
POOL_NUMPY_DTYPES = {"float32": np.float32, "bfloat16": np.uint16, "int8": np.int8}
LORA_POOL_PREFIXES = ("lora_a.", "lora_b.")  # contract/lora.py pool_a / pool_b


def release_freed_heap() -> bool:
    """Hand the heap pages malloc holds but nothing uses back to the kernel (glibc ``malloc_trim(0)``): building a
    session parses the model and its graph into memory it frees again (~26 MiB at 1B), and without this those pages
    stay in the process's RSS for good. False where the C library has no ``malloc_trim`` (not glibc)."""
    name = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    if trim is None:
        return False
    trim(0)  # its result says whether any page went back: either way nothing more to do
    return True


class OrtExecutor:
    """The :class:`~omforge.runtime.executor.Executor` for ort bundles."""

    def __init__(self, model_path: Path, layout: PagedLayout, num_blocks: int, threads: int | None = None,
                 providers: list[str] | None = None, num_host_blocks: int = 0, prefault: bool = False):
        opts = ort.SessionOptions()
        if threads:
            opts.intra_op_num_threads = threads
        if kernels.status().available:
            kernels.register(opts)
        self.layout, self.num_blocks = layout, num_blocks
        self.session = ort.InferenceSession(str(model_path), opts, providers=providers or ["CPUExecutionProvider"])
        release_freed_heap()
        shape = (num_blocks, layout.block_size, layout.kv_heads, layout.row_elems)
        self.pool_dtype = POOL_NUMPY_DTYPES[layout.kv_dtype]
        # prefault (a server): written now, so the pool is resident from the start and the process's RSS is known
        # up front; otherwise (offline) pages become resident as blocks are first used
        alloc = (lambda: np.full(shape, 0, self.pool_dtype)) if prefault else (lambda: np.zeros(shape, self.pool_dtype))
        self.key_pools = [alloc() for _ in range(layout.num_layers)]
        self.value_pools = [alloc() for _ in range(layout.num_layers)]
        self.allocate_host(num_host_blocks)
        self.binding = self.session.io_binding()
        self.binding.bind_output("logits")  # first, so it stays output 0 when re-bound each run
        self.input_names = {i.name for i in self.session.get_inputs()}
        self._bind_lora_pools()
        # a decode group in the graph: decodes share a step with prefill chunks, unpadded
        self.capabilities = ExecutorCapabilities(supports_mixed_batches="decode_query_index" in self.input_names,
                                                 supports_prompt_logits=True, host_kv=HostKVPools(tuple(
                                                     p for layer in zip(self.key_pools, self.value_pools)
                                                     for p in layer)), lora_pools=self.lora_pools or None)
        outputs = [o.name for o in self.session.get_outputs()]
        self.runtime_write = "key_new.0" in outputs
        self._new_rows = [f"{kind}_new.{layer}" for layer in range(layout.num_layers) for kind in ("key", "value")]
        self._pool_values = []  # keep the OrtValues alive as long as the binding refers to them
        slots = (num_blocks * layout.block_size, layout.kv_heads, layout.row_elems)
        self._slot_views = []
        for layer in range(layout.num_layers):
            for kind, pools in (("key", self.key_pools), ("value", self.value_pools)):
                view = pools[layer].reshape(slots)
                value = (ort.OrtValue.ortvalue_from_numpy_with_onnx_type(view, BFLOAT16)
                         if layout.kv_dtype == "bfloat16" else ort.OrtValue.ortvalue_from_numpy(view))
                self.binding.bind_ortvalue_input(f"{kind}_cache.{layer}", value)
                if not self.runtime_write:
                    self.binding.bind_ortvalue_output(f"{kind}_cache_out.{layer}", value)
                self._pool_values.append(value)
                self._slot_views.append(view)
        if prefault:
            self._warm_up()

    def _bind_lora_pools(self) -> None:
        """``lora_pools``: every LoRA pool input's array (zeros: slot 0, the base model, stays so), bound once."""
        self.lora_pools: dict[str, np.ndarray] = {}
        self._lora_values = []  # the OrtValues the binding refers to
        for spec in self.session.get_inputs():
            if not spec.name.startswith(LORA_POOL_PREFIXES):
                continue
            if spec.type != "tensor(float)" or not all(isinstance(d, int) for d in spec.shape):
                raise ValueError(f"LoRA pool input {spec.name}: {spec.type} {spec.shape}, expected a float32 tensor "
                                 "of static shape [slots, rows, columns]")
            pool = np.zeros(spec.shape, np.float32)
            value = ort.OrtValue.ortvalue_from_numpy(pool)
            self.binding.bind_ortvalue_input(spec.name, value)
            self.lora_pools[spec.name] = pool
            self._lora_values.append(value)

    @classmethod
    def for_bundle(cls, bundle: Path, manifest: Manifest, num_blocks: int, threads: int | None = None,
                   num_host_blocks: int = 0, prefault: bool = False) -> OrtExecutor:
        """The executor of an ort bundle's step graph, once the kernel library here can run it
        (:func:`kernels.check_bundle`: a one-line BundleError otherwise, a warning on its portable path)."""
        kernels.check_bundle(bundle, manifest.kernels, manifest.passes.op_histogram)
        return cls(bundle / manifest.graphs.step, manifest.kv.paged_layout, num_blocks=num_blocks, threads=threads,
                   num_host_blocks=num_host_blocks, prefault=prefault)

    def _warm_up(self) -> None:
        """One step of one token in slot 0, then slot 0 zeroed again (a server, before its first request): ORT maps
        the bundle's weights from the file and pages them in at first use, so without it the first request pays
        reading every weight page (and ORT's first-run set-up), and the process's RSS is not yet its working set."""
        self.execute([SeqWork([0], 0, [0])])
        for view in self._slot_views:
            view[0] = 0

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks ``src → dst`` in every layer's K and V pool (copy-on-write of a shared block)."""
        pools = (self.key_pools, self.value_pools)
        self._swap(pairs, pools, pools)

    def allocate_host(self, num_host_blocks: int) -> None:
        """The host swap tier: pools of ``num_host_blocks`` blocks per layer, K and V."""
        shape = (num_host_blocks, *self.key_pools[0].shape[1:])
        self.host_keys = [np.zeros(shape, self.pool_dtype) for _ in self.key_pools]
        self.host_values = [np.zeros(shape, self.pool_dtype) for _ in self.value_pools]

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks, ``(device, host)`` pairs."""
        self._swap(pairs, (self.key_pools, self.value_pools), (self.host_keys, self.host_values))

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy host blocks back to device blocks, ``(host, device)`` pairs."""
        self._swap(pairs, (self.host_keys, self.host_values), (self.key_pools, self.value_pools))

    @staticmethod
    def _swap(pairs: list[tuple[int, int]], src_pools, dst_pools) -> None:  # noqa: ANN001
        if not pairs:
            return
        src, dst = (np.fromiter(col, np.int64, len(pairs)) for col in zip(*pairs))
        for srcs, dsts in zip(src_pools, dst_pools):
            for s_pool, d_pool in zip(srcs, dsts):
                d_pool[dst] = s_pool[src]

    def execute(self, work: list[SeqWork]) -> np.ndarray:
        """Run one scheduler step; returns logits ``[items needing logits, vocab]`` (:class:`Executor`)."""
        return self.run(build_step(work, self.layout.block_size,
                                   split_decodes=self.capabilities.supports_mixed_batches))

    def close(self) -> None:
        """Nothing to release by hand (the session and pools are freed with the object)."""

    def run(self, step: dict[str, np.ndarray]) -> np.ndarray:
        """Execute one step; returns logits ``[num_logits, vocab]`` (the pools are updated in place)."""
        for name, array in step.items():
            if name in self.input_names:
                self.binding.bind_cpu_input(name, np.ascontiguousarray(array))
        self.binding.bind_output("logits")  # unallocated again: the number of logit rows varies by step
        if self.runtime_write:
            for name in self._new_rows:
                self.binding.bind_output(name)
        self.session.run_with_iobinding(self.binding)
        outputs = self.binding.get_outputs()
        if self.runtime_write:  # store the step's K/V rows at their slots, every layer
            slots = step["slot_mapping"]
            for view, rows in zip(self._slot_views, outputs[1:]):
                view[slots] = rows.numpy()
        return outputs[0].numpy()[0]
