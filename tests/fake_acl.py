"""FAKE pyACL, for tests only — not Ascend, not a simulator of NPU numerics.

``FakeAcl`` offers the part of the ``acl`` module omforge calls (reference/ascend.md §3), with the checks a real
runtime makes that catch executor bugs: memory is host ``bytearray``s behind integer "pointers"; copies check their
kind (host/device), bounds and ``dst_max``; a double free or a leak shows in :attr:`FakeAcl.live`. A "model" is a
FAKE ``.om`` written by ``tests/fake_atc.py`` from the exact atc command: a JSON pointer to the plain-op twin of
the bundle's ascend step graph (``lower_ascend.lower(plain=True)``), which runs on onnxruntime — the numerics are
the ORT lowering's, so an engine on this fake must produce the ORT engine's tokens. What it enforces of CANN's
documented behaviour, each with its source:

- a gear model's dims list is built from the inputs ``--input_shape`` listed, in that order, static dims included
  (hicann/ge ``multi_batch_clone_pass.cc``); ``get_input_dynamic_dims`` fails with ACL_ERROR_FAILURE when it holds
  more than 128 (``ACL_MAX_DIM_CNT``, hicann/ge ``model_om2.cpp``); ``set_input_dynamic_dims`` takes only a compiled
  gear's dims, exactly (aclpythondevg_01_0159; reference §3.4);
- output names are ``op-name:edge-index:tensor-name`` for ONNX-converted models (aclmdlGetOutputNameByIndex,
  aclcppdevg_03_1457; reference §3.3);
- ``memcpy`` does not wait for earlier async work (aclpythondevg_01_0124): a sync copy or an execute that touches
  memory an unsynchronized ``memcpy_async`` writes fails, and a stream destroyed with work pending fails;
- one model must not run on several threads at once (aclpythondevg_01_0145): a re-entrant execute fails;
- ``memcpy_async`` takes only 64-byte-aligned source and destination addresses (aclpythondevg_01_0125);
- device memory is finite: ``get_mem_info`` reports the HBM left (the test sets the start) after every ``malloc``
  and every loaded model; a ``malloc`` or a load above it fails with a resource error (207001);
- ``query_size``'s work size includes every input and output of the model, the KV pool too (hicann/ge
  ``graph_builder.cc``: memory_size ≥ zero_copy_size), and a load reserves weights + that work (``davinci_model.cc``
  InitFeatureMapAndP2PMem) unless ``ACL_MDL_WORKSPACE_MEM_OPTIMIZE`` (13) is 1, when the inputs and outputs are left
  out ("the work memory no longer contains the model's input/output memory", ``aclmdlConfigAttr.md``; reference
  §5.2); ``load_with_config`` needs the load type (1, from file) and the path set (aclmdlConfigAttr);
- it offers nothing but the calls of ``contract/acl_calls.py`` (each from its doc page): any other call, or an
  argument of another type, raises :class:`NotInCallTable` — a defect in omforge, not an ACL error;
- ``set_config_opt``'s ``size_t`` attributes (1 load type, 13 workspace optimize) are refused unless their value
  reaches the C layer as a ``size_t`` in range (hicann/ge ffdcbc9 ``api/acl/acl_model/model/model_config_om2.cpp:
  101-124, 294-316``: ``valueSize != sizeof(size_t)`` → ACL_ERROR_INVALID_PARAM); pyACL documents the value as an
  int (aclpythondevg_01_0137) and its marshalling is not documented, so ``FakeAcl(attr13_value_size=4)`` models a
  pyACL that passes attribute 13 as a 4-byte int: the C check refuses it; ``load_from_file`` reserves the inputs
  and outputs in the work memory like a load without attribute 13;
- in-place OMs (the FAKE OM lists ``ref_inputs``: the inputs its build route declared ``RefData``): twin outputs
  named ``<input>`` + ``REF_SUFFIX`` (contract/ascend.py) are what a ref op wrote into that input; they are not
  outputs of the OM (hidden from the description). After execute each is written into the caller's buffer of that
  input when the input is ``RefData`` — its address is always the user's, "cannot disable zero copy" (hicann/ge
  ``runtime/v1/graph/load/model_manager/davinci_model.cc:2190-2200``) — and DROPPED when it is a plain ``Data``:
  GE's ``InnerIdentityAddPass`` puts an Identity copy before a ref op unless its input traces back to a var-like
  node (``compiler/graph/passes/feature/inner_identity_add_pass.cc:30-60, 95-104``; var-like = Variable,
  VariableV2, RefData, ``graph_metadef/graph/utils/op_type_utils.cc:91-93``), so the write lands in a copy that
  is lost. :attr:`FakeAcl.lost_writes` counts the dropped writes per input;
- no output of the OM may alias a ref input (the input itself, or the value a ref op wrote into it): GE inserts a
  copy for a ref output that reaches NetOutput (``compiler/graph/optimize/mem_layout_conflict_optimize/
  mem_layout_conflict_util.cc:1246-1251``): such an OM is refused at load;
- on a paged OM (inputs ``slot_mapping`` and ``key_cache.N``), what the executor feeds must meet the kernels'
  runtime rules, checked at every execute: ScatterPaKvCache's slots in ``[0, num_blocks·block_size−1]`` and UNIQUE
  (ops-transformer 2025-12 mirror ``attention/scatter_pa_kv_cache/op_host/scatter_pa_kv_cache_def.cpp:115-176``
  and its README; reference §5.3); FIA/IFA paged mode: ``block_table`` int32 and 2-D, every entry a block of the
  pool, ``actual_seq_lengths`` and ``actual_seq_lengths_kv`` present, each kv length within the sequence's table
  (``aclnnIncreFlashAttentionV4.md:465-473``; FIA V4 doc :912, :1936) — checked at load for the types, at execute
  for the values;
- it counts the bytes every copy moves, by kind (:attr:`FakeAcl.copied`: ``H2D``, ``D2H``, ``D2D``), so a test can
  assert what a step copies; a FAKE OM flag ``zero_copy_lost`` (input names) makes the load reserve a copy of those
  inputs, as GE does for a ``Data`` input whose block is not zero-copyable (``davinci_model.cc:2282-2290``,
  decided at build time in ``block_mem_zero_copy.cc:38-55, 217-242``).
"""

from __future__ import annotations

import functools
import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from omforge.contract.acl_calls import BY_NAME, argument_errors
from omforge.contract.ascend import REF_SUFFIX, SEQ_LENS_KV, SEQ_LENS_Q, SLOT_MAPPING

ERR_PARAM = 100000
ERR_MEMORY = 207001  # ACL_ERROR_RT_MEMORY_ALLOCATION
ERR_FAILURE = 500001  # ACL_ERROR_FAILURE
MAX_DIM_CNT = 128
ALIGN = 64  # memcpy_async addresses (aclpythondevg_01_0125)
WORKSPACE = 64 << 20  # the FAKE OM's own work memory beside its inputs and outputs
LOAD_TYPE, PATH, WORKSPACE_MEM_OPTIMIZE = 1, 2, 13  # aclmdlConfigAttr
LOAD_FROM_FILE = 1
SIZE_T = 8  # sizeof(size_t) on the aarch64 / x86_64 hosts CANN ships for
SIZET_RANGE = {LOAD_TYPE: (1, 6), WORKSPACE_MEM_OPTIMIZE: (0, 1)}  # model_config_om2.cpp:112-113, 305
COPY_KINDS = {1: "H2D", 2: "D2H", 3: "D2D"}
SPACE = 1 << 40  # each allocation owns [base, base + SPACE)
_ACL_OF_NP = {np.dtype(np.float32): 0, np.dtype(np.float16): 1, np.dtype(np.int32): 3, np.dtype(np.int64): 9}
_POOL = re.compile(r"(key|value)_cache\.\d+")
_NP_OF_ONNX = {1: np.float32, 10: np.float16, 6: np.int32, 7: np.int64}


class NotInCallTable(Exception):
    """omforge called a pyACL function, or passed an argument type, that contract/acl_calls.py does not list."""


class _Checked:
    """One namespace of the fake module (``acl``, ``acl.rt``, …): only the table's calls, with the table's types."""

    def __init__(self, prefix: str, impl: Any):
        self._prefix, self._impl = prefix, impl

    def __getattr__(self, name: str) -> Any:
        full = f"{self._prefix}.{name}"
        if full not in BY_NAME:
            raise NotInCallTable(argument_errors(full, ()))
        fn = getattr(self._impl, name)

        def call(*args: Any) -> Any:
            problem = argument_errors(full, args)
            if problem is not None:
                raise NotInCallTable(problem)
            return fn(*args)
        return call


class FakeAcl:
    """``hbm_free`` / ``hbm_total``: what ``acl.rt.get_mem_info(ACL_HBM_MEM)`` reports before anything is allocated
    (default 64 GiB free); allocations and loaded models come off it. ``attr13_value_size``: the ``valueSize`` this
    "pyACL" hands the C layer for ``ACL_MDL_WORKSPACE_MEM_OPTIMIZE`` (see the module docstring)."""

    def __init__(self, hbm_free: int = 64 << 30, hbm_total: int = 64 << 30, attr13_value_size: int = SIZE_T) -> None:
        self.hbm = (hbm_free, hbm_total)
        self.attr13_value_size = attr13_value_size  # the valueSize this "pyACL" passes for attribute 13
        self.copied: Counter[str] = Counter()  # bytes moved by every copy, by kind (H2D, D2H, D2D)
        self.lost_writes: Counter[str] = Counter()  # ref writes dropped: the input was a plain Data
        self.pending: dict[Any, list[tuple[int, int, Any]]] = {}  # stream -> queued (dst, count, run)
        self.calls: list[str] = []
        self.mem: dict[int, tuple[bytearray, str]] = {}  # base -> (buffer, "device" | "host" | "host-bytes")
        self._next = 1
        self.initialized = False
        self.device: int | None = None
        self.rt, self.mdl, self.util = _Checked("acl.rt", _Rt(self)), _Checked("acl.mdl", _Mdl(self)), \
            _Checked("acl.util", _Util(self))
        self._top = _Checked("acl", _Top(self))

    def __getattr__(self, name: str) -> Any:  # acl.init, acl.create_data_buffer, …: through the table
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._top, name)

    @property
    def models(self) -> dict[int, _Model]:
        return self.mdl._impl.models

    @property
    def device_used(self) -> int:
        """Device bytes taken: live device allocations and what loaded models reserved."""
        return sum(len(buf) for buf, kind in self.mem.values() if kind == "device") + \
            sum(m.reserved for m in self.models.values())

    @property
    def device_free(self) -> int:
        return self.hbm[0] - self.device_used

    # -- memory model --
    def alloc(self, size: int, kind: str, data: bytes | None = None) -> int:
        base = self._next * SPACE
        self._next += 1
        self.mem[base] = (bytearray(data) if data is not None else bytearray(size), kind)
        return base

    def resolve(self, ptr: int, count: int) -> tuple[bytearray, int, str]:
        base = ptr - ptr % SPACE
        if base not in self.mem:
            raise _Fail(f"pointer {ptr:#x} was not allocated")
        buf, kind = self.mem[base]
        off = ptr - base
        if off + count > len(buf):
            raise _Fail(f"{count} bytes at offset {off} overrun a {len(buf)}-byte allocation")
        return buf, off, kind

    def check_not_pending(self, ptr: int, count: int, what: str) -> None:
        """Fail when ``[ptr, ptr + count)`` overlaps memory an unsynchronized async copy writes."""
        for stream, queue in self.pending.items():
            for dst, n, _ in queue:
                if dst < ptr + count and ptr < dst + n:
                    raise _Fail(f"{what} touches memory an async copy on {stream} still writes: synchronize first")

    @property
    def live(self) -> list[str]:
        """Allocations not freed (bytes_to_ptr staging excluded: the real one is the caller's bytes object)."""
        return [f"{kind} {len(buf)} bytes" for buf, kind in self.mem.values() if kind != "host-bytes"]



class _Top:
    """The top-level ``acl.*`` functions."""

    def __init__(self, acl: FakeAcl):
        self.acl = acl

    def init(self) -> int:
        self.acl.calls.append("init")
        self.acl.initialized = True
        return 0

    def finalize(self) -> int:
        self.acl.calls.append("finalize")
        self.acl.initialized = False
        return 0

    def create_data_buffer(self, ptr: int, size: int) -> tuple[str, int, int]:
        self.acl.resolve(ptr, size)
        return ("databuf", ptr, size)

    def destroy_data_buffer(self, buf: Any) -> int:
        self.acl.calls.append("destroy_data_buffer")
        return 0


class _Fail(Exception):
    code = ERR_PARAM


class _OutOfMemory(_Fail):
    code = ERR_MEMORY


def _guard(fn):  # noqa: ANN001, ANN202 - a failed check becomes the ACL parameter error code, as the real API returns
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except _Fail as e:
            args[0].acl.calls.append(f"FAILED {fn.__name__}: {e}")
            return e.code if fn.__name__ in _BARE_RET else (None, e.code)
    return wrapped


_BARE_RET = {"set_device", "reset_device", "destroy_context", "set_context", "destroy_stream", "free", "free_host",
             "memcpy", "memset", "unload", "get_desc", "destroy_desc", "destroy_dataset", "set_input_dynamic_dims",
             "execute", "memcpy_async", "synchronize_stream", "set_config_opt",
             "destroy_config_handle"}


class _Rt:
    def __init__(self, acl: FakeAcl):
        self.acl = acl

    @_guard
    def set_device(self, dev: int) -> int:
        if not self.acl.initialized:
            raise _Fail("acl.init first")
        self.acl.device = dev
        self.acl.calls.append("set_device")
        return 0

    @_guard
    def reset_device(self, dev: int) -> int:
        self.acl.calls.append("reset_device")
        self.acl.device = None
        return 0

    def create_context(self, dev: int) -> tuple[str, int]:
        self.acl.calls.append("create_context")
        return ("ctx", 0) if self.acl.device == dev else (None, ERR_PARAM)

    @_guard
    def destroy_context(self, ctx: Any) -> int:
        self.acl.calls.append("destroy_context")
        return 0

    @_guard
    def set_context(self, ctx: Any) -> int:
        if ctx != "ctx":
            raise _Fail("unknown context")
        return 0

    def create_stream(self) -> tuple[str, int]:
        self.acl.calls.append("create_stream")
        return "stream", 0

    @_guard
    def destroy_stream(self, stream: Any) -> int:
        if self.acl.pending.get(stream):
            raise _Fail("destroy_stream with async work pending")
        self.acl.calls.append("destroy_stream")
        return 0

    @_guard
    def memcpy_async(self, dst: int, dst_max: int, src: int, count: int, kind: int, stream: Any) -> int:
        if stream != "stream":
            raise _Fail("unknown stream")
        if count > dst_max:
            raise _Fail(f"count {count} > dst_max {dst_max}")
        if dst % ALIGN or src % ALIGN:
            raise _Fail(f"memcpy_async addresses must be {ALIGN}-byte aligned (dst {dst:#x}, src {src:#x})")
        self.acl.resolve(dst, count)
        self.acl.resolve(src, count)

        def run() -> None:
            self._copy(dst, src, count, kind)

        self.acl.pending.setdefault(stream, []).append((dst, count, run))
        self.acl.calls.append("memcpy_async")
        return 0

    @_guard
    def synchronize_stream(self, stream: Any) -> int:
        for _, _, run in self.acl.pending.pop(stream, []):
            run()
        self.acl.calls.append("synchronize_stream")
        return 0

    def get_mem_info(self, attr: int) -> tuple[int, int, int]:
        if attr != 1:  # ACL_HBM_MEM
            return 0, 0, ERR_PARAM
        return self.acl.device_free, self.acl.hbm[1], 0

    @_guard
    def malloc(self, size: int, policy: int) -> tuple[int, int]:
        if self.acl.device is None:
            raise _Fail("no device set")
        if size > self.acl.device_free:
            raise _OutOfMemory(f"malloc of {size} bytes with {self.acl.device_free} free")
        return self.acl.alloc(size, "device"), 0

    @_guard
    def malloc_host(self, size: int) -> tuple[int, int]:
        return self.acl.alloc(size, "host"), 0

    @_guard
    def free(self, ptr: int) -> int:
        if self.acl.mem.get(ptr, (None, None))[1] != "device":
            raise _Fail("free of a pointer that is not a live device allocation (double free?)")
        del self.acl.mem[ptr]
        self.acl.calls.append("free")
        return 0

    @_guard
    def free_host(self, ptr: int) -> int:
        if self.acl.mem.get(ptr, (None, None))[1] != "host":
            raise _Fail("free_host of a pointer that is not a live host allocation")
        del self.acl.mem[ptr]
        self.acl.calls.append("free_host")
        return 0

    @_guard
    def memset(self, ptr: int, max_size: int, value: int, count: int) -> int:
        buf, off, _ = self.acl.resolve(ptr, count)
        buf[off:off + count] = bytes([value]) * count
        return 0

    @_guard
    def memcpy(self, dst: int, dst_max: int, src: int, count: int, kind: int) -> int:
        if count > dst_max:
            raise _Fail(f"count {count} > dst_max {dst_max}")
        self.acl.check_not_pending(dst, count, "memcpy's destination")
        self.acl.check_not_pending(src, count, "memcpy's source")
        self._copy(dst, src, count, kind)
        self.acl.calls.append(f"memcpy {kind}")
        return 0

    def _copy(self, dst: int, src: int, count: int, kind: int) -> None:
        dbuf, doff, dkind = self.acl.resolve(dst, count)
        sbuf, soff, skind = self.acl.resolve(src, count)
        want = {1: ("host", "device"), 2: ("device", "host"), 3: ("device", "device")}.get(kind)
        if want is None or (skind.split("-")[0], dkind) != want:
            raise _Fail(f"memcpy kind {kind} from {skind} to {dkind} memory")
        dbuf[doff:doff + count] = sbuf[soff:soff + count]
        self.acl.copied[COPY_KINDS[kind]] += count
        if skind == "host-bytes":
            del self.acl.mem[src - src % SPACE]  # the staging copy of a bytes object, used once


class _Util:
    def __init__(self, acl: FakeAcl):
        self.acl = acl

    def bytes_to_ptr(self, data: bytes) -> int:
        return self.acl.alloc(len(data), "host-bytes", data)

    def ptr_to_bytes(self, ptr: int, size: int) -> bytes:
        buf, off, kind = self.acl.resolve(ptr, size)
        assert kind == "host", "ptr_to_bytes of device memory"
        return bytes(buf[off:off + size])


class _Model:
    """A loaded FAKE OM: its ORT session, and what ATC would have compiled from the command (tests/fake_atc.py):
    the dims list of each gear built from the listed inputs (static dims included), each input's and output's
    dims per gear."""

    def __init__(self, spec: dict[str, Any]):
        import onnx

        graph = onnx.load(spec["onnx"], load_external_data=False).graph
        weights = {t.name for t in graph.initializer}
        self.path, self.reserved = spec["onnx"], 0
        listed = [(name, list(dims)) for name, dims in spec["input_shape"]]
        self.inputs = [(v.name, _NP_OF_ONNX[v.type.tensor_type.elem_type], v) for v in graph.input
                       if v.name not in weights]
        all_outputs = [(v.name, _NP_OF_ONNX[v.type.tensor_type.elem_type], v) for v in graph.output]
        self.outputs = [o for o in all_outputs if not o[0].endswith(REF_SUFFIX)]  # the OM's outputs
        self.ref_outputs = [(o[0], o[0][:-len(REF_SUFFIX)]) for o in all_outputs if o[0].endswith(REF_SUFFIX)]
        self.ref_inputs = set(spec.get("ref_inputs", ()))  # declared RefData by the build route
        self.zero_copy_lost = list(spec.get("zero_copy_lost", ()))
        _check_refs(graph, self)
        producer = {o: (n.name, i) for n in graph.node for i, o in enumerate(n.output)}
        self.output_names = [f"{producer[n][0]}:{producer[n][1]}:{n}" for n, _, _ in self.outputs]
        by_name = {n: v for n, _, v in self.inputs}
        self.gear_dims, symbols = [], []
        for gear in spec["gears"]:
            values, dims_list, sym = iter(gear), [], {}
            for name, dims in listed:
                filled = [next(values) if d == -1 else d for d in dims]
                dims_list += filled
                for d, value in zip(by_name[name].type.tensor_type.shape.dim, filled):
                    if d.dim_param:
                        sym[d.dim_param] = value
            self.gear_dims.append(dims_list)
            symbols.append(sym)

        def dims_of(value: Any, sym: dict[str, int] | None) -> list[int]:
            return [d.dim_value if d.HasField("dim_value") else (-1 if sym is None else sym[d.dim_param])
                    for d in value.type.tensor_type.shape.dim]

        self.in_dims = {n: [dims_of(v, s) for s in symbols] for n, _, v in self.inputs}
        self.out_dims = {n: [dims_of(v, s) for s in symbols] for n, _, v in self.outputs}
        self.compiled = {n: dims_of(v, None) for n, _, v in self.inputs + self.outputs}
        self.dtypes = {n: np.dtype(t) for n, t, _ in self.inputs + self.outputs}
        self.busy = False
        self.paged = SLOT_MAPPING in self.dtypes and any(_POOL.fullmatch(n) for n in self.dtypes)
        if self.paged:
            _check_paged_types(self)

    def size(self, name: str, dims_per_gear: dict[str, list[list[int]]]) -> int:
        return max(int(np.prod(d)) for d in dims_per_gear[name]) * self.dtypes[name].itemsize

    @property
    def dims_input_size(self) -> int:
        return 8 * len(self.gear_dims[0])  # ascend_mbatch_shape_data: the dims list, int64

    @property
    def io_bytes(self) -> int:
        """The zero-copy region: every input (the dynamic-dims one too) and output at its largest gear."""
        return sum(self.size(n, self.in_dims) for n, _, _ in self.inputs) + self.dims_input_size + \
            sum(self.size(n, self.out_dims) for n, _, _ in self.outputs)

    @property
    def copied_inputs_bytes(self) -> int:
        """What the load reserves for the inputs GE copies in (``zero_copy_lost``)."""
        return sum(self.size(n, self.in_dims) for n in self.zero_copy_lost)

    @property
    def weight_bytes(self) -> int:
        return sum(f.stat().st_size for f in Path(self.path).parent.glob(Path(self.path).name + "*"))

    @functools.cached_property
    def session(self) -> Any:
        import onnxruntime as ort

        return ort.InferenceSession(self.path, providers=["CPUExecutionProvider"])


def _check_refs(graph: Any, model: _Model) -> None:
    """Refuse (:class:`_Fail`) an OM whose ref outputs name no input of its, or one of whose outputs aliases a ref
    input: the input itself, or the value written into it, through Identity copies (a pool alias reaching NetOutput
    gets a copy inserted: hicann/ge ``mem_layout_conflict_util.cc:1246-1251``)."""
    names = {n for n, _, _ in model.inputs}
    for out, target in model.ref_outputs:
        if target not in names:
            raise _Fail(f"twin output {out} names no input {target}")
    unknown = model.ref_inputs - names
    if unknown:
        raise _Fail(f"ref_inputs {sorted(unknown)} are not inputs of the model")
    source = {o: n.input[0] for n in graph.node if n.op_type == "Identity" for o in n.output}

    def root(t: str) -> str:
        while t in source:
            t = source[t]
        return t

    written = {root(out): target for out, target in model.ref_outputs}
    for name, _, _ in model.outputs:
        r = root(name)
        aliased = r if r in model.ref_inputs else written.get(r)
        if aliased is not None and aliased in model.ref_inputs:
            raise _Fail(f"output {name} aliases ref input {aliased}: GE copies a ref output that reaches NetOutput "
                        "(mem_layout_conflict_util.cc:1246-1251)")


def _check_paged_types(model: _Model) -> None:
    """FIA/IFA paged mode at load: ``block_tables`` int32 and 2-D, both actual-length inputs present
    (aclnnIncreFlashAttentionV4.md:465-473; reference §5.3); ScatterPaKvCache's ``slot_mapping`` 1-D."""
    for name in ("block_tables", SEQ_LENS_Q, SEQ_LENS_KV):
        if name not in model.dtypes:
            raise _Fail(f"paged OM without the input {name} (FIA/IFA require it)")
    if model.dtypes["block_tables"] != np.int32 or len(model.compiled["block_tables"]) != 2:
        raise _Fail(f"block_tables must be int32 2-D for FIA/IFA, got {model.dtypes['block_tables']} "
                    f"{model.compiled['block_tables']}")
    if len(model.compiled[SLOT_MAPPING]) != 1:
        raise _Fail(f"slot_mapping must be 1-D, got {model.compiled[SLOT_MAPPING]}")


def _check_paged_feeds(model: _Model, feeds: dict[str, np.ndarray]) -> None:
    """The values the kernels take at run time (see the module docstring), on what the executor fed."""
    pool = next(n for n in model.dtypes if _POOL.fullmatch(n))
    num_blocks, block_size = model.compiled[pool][:2]
    slots = feeds[SLOT_MAPPING].astype(np.int64)
    if slots.size and (slots.min() < 0 or slots.max() > num_blocks * block_size - 1):
        raise _Fail(f"ScatterPaKvCache: slot_mapping outside [0, {num_blocks * block_size - 1}] "
                    f"(min {slots.min()}, max {slots.max()})")
    if np.unique(slots).size != slots.size:
        raise _Fail("ScatterPaKvCache: slot_mapping holds repeated slots (they must be unique)")
    tables = feeds["block_tables"]
    if tables.size and (tables.min() < 0 or tables.max() >= num_blocks):
        raise _Fail(f"block_tables entries outside [0, {num_blocks - 1}] (min {tables.min()}, max {tables.max()})")
    q, kv = feeds[SEQ_LENS_Q].astype(np.int64), feeds[SEQ_LENS_KV].astype(np.int64)
    if q.shape != (tables.shape[0],) or kv.shape != (tables.shape[0],):
        raise _Fail(f"actual_seq_lengths {q.shape} / _kv {kv.shape} for {tables.shape[0]} sequences")
    if (kv < 1).any() or (kv > tables.shape[1] * block_size).any() or (q < 1).any() or (q > kv).any():
        raise _Fail(f"actual lengths q {q.tolist()} kv {kv.tolist()} outside [1, kv] / [1, "
                    f"{tables.shape[1] * block_size}] (the block table's capacity)")


class _Desc:
    model: _Model | None = None


class _Mdl:
    def __init__(self, acl: FakeAcl):
        self.acl = acl
        self.models: dict[int, _Model] = {}

    def create_config_handle(self) -> dict:
        return {"config": {}}

    @_guard
    def set_config_opt(self, handle: dict, attr: int, value: int | str) -> int:
        """The C layer's checks (model_config_om2.cpp): a size_t attribute needs ``valueSize == sizeof(size_t)``
        and a value in range; the path a string."""
        if attr in SIZET_RANGE:
            size = self.acl.attr13_value_size if attr == WORKSPACE_MEM_OPTIMIZE else SIZE_T
            low, high = SIZET_RANGE[attr]
            if not isinstance(value, int) or size != SIZE_T:
                raise _Fail(f"attr {attr}: valueSize {size if isinstance(value, int) else '?'} is invalid, it should "
                            f"be {SIZE_T} (a size_t)")
            if not low <= value <= high:
                raise _Fail(f"attr {attr}: value {value} is invalid, it should be in [{low}, {high}]")
        elif attr == PATH and not isinstance(value, str):
            raise _Fail("attr 2 (ACL_MDL_PATH_PTR) takes the path")
        handle["config"][attr] = value
        return 0

    @_guard
    def destroy_config_handle(self, handle: dict) -> int:
        return 0

    @_guard
    def load_with_config(self, handle: dict) -> tuple[int, int]:
        """Load from file as GE does: reserve the weights and the work memory, the model's inputs and outputs in
        it unless ACL_MDL_WORKSPACE_MEM_OPTIMIZE is 1 (reference §5.2)."""
        config = handle["config"]
        if config.get(LOAD_TYPE) != LOAD_FROM_FILE or not isinstance(config.get(PATH), str):
            raise _Fail(f"load_with_config needs ACL_MDL_LOAD_TYPE_SIZET = {LOAD_FROM_FILE} and ACL_MDL_PATH_PTR")
        return self._load(config[PATH], config.get(WORKSPACE_MEM_OPTIMIZE) == 1)

    @_guard
    def load_from_file(self, path: str) -> tuple[int, int]:
        """aclmdlLoadFromFile: GE manages the memory, the model's inputs and outputs in its work memory."""
        return self._load(path, False)

    def _load(self, path: str, optimized: bool) -> tuple[int, int]:
        model = _read_om(path)
        if model is None:
            raise _Fail(f"{path} is not a (FAKE) OM")  # the real call fails with a parameter error too
        work = WORKSPACE + (0 if optimized else model.io_bytes) + model.copied_inputs_bytes
        if model.weight_bytes + work > self.acl.device_free:
            raise _OutOfMemory(f"load needs {model.weight_bytes + work} bytes, {self.acl.device_free} free")
        model.reserved = model.weight_bytes + work
        model_id = len(self.models) + 1
        self.models[model_id] = model
        self.acl.calls.append(f"load {Path(path).name}")
        return model_id, 0

    @_guard
    def unload(self, model_id: int) -> int:
        if self.models.pop(model_id, None) is None:
            raise _Fail("unload of an unknown model")
        self.acl.calls.append("unload")
        return 0

    def create_desc(self) -> _Desc:
        return _Desc()

    @_guard
    def get_desc(self, desc: _Desc, model_id: int) -> int:
        desc.model = self.models[model_id]
        return 0

    @_guard
    def destroy_desc(self, desc: _Desc) -> int:
        self.acl.calls.append("destroy_desc")
        return 0

    # inputs: the data inputs, then the dynamic-dims input (as ATC appends it)
    def _in(self, desc: _Desc) -> list[str]:
        return [n for n, _, _ in desc.model.inputs] + ["ascend_mbatch_shape_data"]

    def get_num_inputs(self, desc: _Desc) -> int:
        return len(self._in(desc))

    def get_num_outputs(self, desc: _Desc) -> int:
        return len(desc.model.outputs)

    def get_input_name_by_index(self, desc: _Desc, i: int) -> str:
        return self._in(desc)[i]

    def get_output_name_by_index(self, desc: _Desc, i: int) -> str:
        return desc.model.output_names[i]  # op-name:edge-index:tensor-name (aclcppdevg_03_1457)

    def get_input_dims(self, desc: _Desc, i: int) -> tuple[dict, int]:
        name = self._in(desc)[i]
        dims = desc.model.compiled.get(name, [len(desc.model.gear_dims[0])])
        return {"name": name, "dimCount": len(dims), "dims": dims}, 0

    def get_output_dims(self, desc: _Desc, i: int) -> tuple[dict, int]:
        name = desc.model.outputs[i][0]
        return {"name": desc.model.output_names[i], "dimCount": len(desc.model.compiled[name]),
                "dims": desc.model.compiled[name]}, 0

    def get_input_size_by_index(self, desc: _Desc, i: int) -> int:
        name = self._in(desc)[i]
        if name == "ascend_mbatch_shape_data":
            return desc.model.dims_input_size
        return desc.model.size(name, desc.model.in_dims)

    def get_output_size_by_index(self, desc: _Desc, i: int) -> int:
        return desc.model.size(desc.model.outputs[i][0], desc.model.out_dims)

    def get_input_data_type(self, desc: _Desc, i: int) -> int:
        name = self._in(desc)[i]
        return 9 if name == "ascend_mbatch_shape_data" else _ACL_OF_NP[desc.model.dtypes[name]]

    def get_output_data_type(self, desc: _Desc, i: int) -> int:
        return _ACL_OF_NP[desc.model.dtypes[desc.model.outputs[i][0]]]

    def get_input_index_by_name(self, desc: _Desc, name: str) -> tuple[int, int]:
        names = self._in(desc)
        return (names.index(name), 0) if name in names else (-1, ERR_PARAM)

    def get_input_dynamic_gear_count(self, desc: _Desc, index: int) -> tuple[int, int]:
        return len(desc.model.gear_dims), 0

    def get_input_dynamic_dims(self, desc: _Desc, index: int, count: int) -> tuple[list[dict] | None, int]:
        if any(len(g) > MAX_DIM_CNT for g in desc.model.gear_dims):  # hicann/ge model_om2.cpp
            self.acl.calls.append(f"FAILED get_input_dynamic_dims: {len(desc.model.gear_dims[0])} dims > {MAX_DIM_CNT}")
            return None, ERR_FAILURE
        return [{"dimCount": len(g), "dims": list(g)} for g in desc.model.gear_dims[:count]], 0

    def query_size(self, path: str) -> tuple[int, int, int]:
        """(work, weight, ret): the FAKE OM's weights are its twin's files; its work memory a fixed workspace plus
        every input and output (graph_builder.cc: memory_size ≥ zero_copy_size)."""
        model = _read_om(path)
        if model is None:
            return 0, 0, ERR_PARAM
        return WORKSPACE + model.io_bytes, model.weight_bytes, 0

    def create_dataset(self) -> dict:
        return {"buffers": [], "dims": None}

    def add_dataset_buffer(self, dataset: dict, buf: Any) -> tuple[dict, int]:
        dataset["buffers"].append(buf)
        return dataset, 0

    @_guard
    def destroy_dataset(self, dataset: dict) -> int:
        self.acl.calls.append("destroy_dataset")
        return 0

    @_guard
    def set_input_dynamic_dims(self, model_id: int, dataset: dict, index: int, dims: dict) -> int:
        model = self.models[model_id]
        if dims["dimCount"] != len(dims["dims"]) or dims["dimCount"] > MAX_DIM_CNT:
            raise _Fail(f"dimCount {dims['dimCount']} for {len(dims['dims'])} dims (at most {MAX_DIM_CNT})")
        if dims["dims"] not in model.gear_dims:
            raise _Fail(f"dims {dims['dims']} are not a compiled gear")
        if index != len(model.inputs):
            raise _Fail(f"index {index} is not the dynamic-dims input")
        dataset["dims"] = model.gear_dims.index(dims["dims"])
        return 0

    @_guard
    def execute(self, model_id: int, inputs: dict, outputs: dict) -> int:
        model = self.models[model_id]
        gear = inputs["dims"]
        if gear is None:
            raise _Fail("execute before set_input_dynamic_dims")
        if model.busy:
            raise _Fail("the model is executing on another thread")
        if len(inputs["buffers"]) != len(model.inputs) + 1 or len(outputs["buffers"]) != len(model.outputs):
            raise _Fail("dataset sizes differ from the model's inputs/outputs")
        feeds = {}
        for (name, dtype, _), (_, ptr, size) in zip(model.inputs, inputs["buffers"]):
            dims = model.in_dims[name][gear]
            count = int(np.prod(dims)) * np.dtype(dtype).itemsize
            if count > size:
                raise _Fail(f"input {name} buffer of {size} bytes < {count}")
            self.acl.check_not_pending(ptr, count, f"execute's input {name}")
            buf, off, _ = self.acl.resolve(ptr, count)
            feeds[name] = np.frombuffer(buf, dtype, int(np.prod(dims)), off).reshape(dims)
        if model.paged:
            _check_paged_feeds(model, feeds)
        model.busy = True
        try:
            results = model.session.run([n for n, _, _ in model.outputs] + [o for o, _ in model.ref_outputs], feeds)
        finally:
            model.busy = False
        written = results[len(model.outputs):]
        results = results[:len(model.outputs)]
        ptr_of = {name: ptr for (name, _, _), (_, ptr, _) in zip(model.inputs, inputs["buffers"])}
        for (out, target), value in zip(model.ref_outputs, written):
            if target not in model.ref_inputs:  # a plain Data: the ref op wrote GE's Identity copy
                self.acl.lost_writes[target] += 1
                continue
            data = np.ascontiguousarray(value, model.dtypes[target]).tobytes()
            if list(value.shape) != model.in_dims[target][gear]:
                raise _Fail(f"{out} has shape {value.shape}, input {target} {model.in_dims[target][gear]}")
            buf, off, _ = self.acl.resolve(ptr_of[target], len(data))
            buf[off:off + len(data)] = data  # in place: the caller's own buffer (RefData)
        for (name, _, _), (_, ptr, size), value in zip(model.outputs, outputs["buffers"], results):
            if list(value.shape) != model.out_dims[name][gear]:
                raise _Fail(f"output {name} has shape {value.shape}, the gear says {model.out_dims[name][gear]}")
            data = np.ascontiguousarray(value).tobytes()
            if len(data) > size:
                raise _Fail(f"output {name} needs {len(data)} bytes, its buffer has {size}")
            self.acl.check_not_pending(ptr, len(data), f"execute's output {name}")
            buf, off, _ = self.acl.resolve(ptr, len(data))
            buf[off:off + len(data)] = data
        self.acl.calls.append("execute")
        return 0


def _read_om(path: str) -> _Model | None:
    """The FAKE OM at ``path`` (tests/fake_atc.py), or None when it is not one."""
    try:
        spec = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(spec, dict) or spec.get("fake_om") is not True:
        return None
    return _Model(spec)
