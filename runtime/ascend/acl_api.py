"""Every ``acl.*`` (pyACL) call omforge makes, in one thin module: each call checked, each failure a named exception
with the ACL code and the call. Nothing here decides anything (that is :mod:`omforge.runtime.ascend.acl_plan` and the
executor); the calls and constants are those of reference/ascend.md §3, and each call is a row of
:mod:`omforge.contract.acl_calls` (its argument types, its return shape, its documentation page).

NOT RUN ON HARDWARE: no Ascend device or CANN install was available where this was written; the calls follow the
cited pyACL documentation and are exercised here only against ``tests/fake_acl.py`` (a fake, named so).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

from omforge.contract.ascend import DYNAMIC_INPUT
from omforge.errors import OmforgeError
from omforge.runtime.ascend.acl_plan import ModelDesc, TensorDesc

ACL_SUCCESS = 0
MEMCPY_HOST_TO_DEVICE, MEMCPY_DEVICE_TO_HOST, MEMCPY_DEVICE_TO_DEVICE = 1, 2, 3
MALLOC_HUGE_FIRST = 0
HBM_MEM = 1  # aclrtMemAttr ACL_HBM_MEM: the device's high-bandwidth memory (acl.rt.get_mem_info)
# aclmdlConfigAttr (inc/external/acl/acl_mdl.h; aclcppdevg_03_1375) and their values, for acl.mdl.set_config_opt
MDL_LOAD_TYPE_SIZET, MDL_PATH_PTR, MDL_WORKSPACE_MEM_OPTIMIZE = 1, 2, 13
MDL_LOAD_FROM_FILE = 1
WORKSPACE_MEM_OPTIMIZE_INPUTOUTPUT = 1


class AclUnavailable(OmforgeError):
    """pyACL cannot be imported: no CANN toolkit, or its set_env.sh was not sourced."""


class AclError(OmforgeError):
    """An ACL call returned a non-zero code. ``code`` and ``call`` say which; subclasses say the family (§3.1)."""

    family = "error"

    def __init__(self, call: str, code: int):
        self.call, self.code = call, code
        super().__init__(f"{call} failed with ACL {self.family} {code}")


class AclParameterError(AclError):
    family = "parameter error (1xxxxx)"


class AclResourceError(AclError):
    family = "resource error (2xxxxx, e.g. device memory)"


class AclServiceError(AclError):
    family = "service error (3xxxxx)"


class AclInternalError(AclError):
    family = "internal error (5xxxxx)"


def acl_error(call: str, code: int) -> AclError:
    """The named exception of an ACL return code: 1xxxxx parameter, 2xxxxx resource, 3xxxxx service, 5xxxxx
    internal, anything else :class:`AclError`."""
    kind = {1: AclParameterError, 2: AclResourceError, 3: AclServiceError, 5: AclInternalError}.get(code // 100000,
                                                                                                  AclError)
    return kind(call, code)


def import_acl() -> Any:
    """``import acl`` or :class:`AclUnavailable` with one line saying what is missing."""
    try:
        return importlib.import_module("acl")
    except ImportError as e:
        raise AclUnavailable(f"this is an ascend bundle and pyACL is not importable here ({e}): install the CANN "
                             "toolkit and `source /usr/local/Ascend/ascend-toolkit/set_env.sh`, on a machine with "
                             "an Ascend NPU (omforge doctor shows what this machine has)") from None


def device_count(acl: Any) -> int | None:
    """NPUs pyACL sees (``acl.rt.get_device_count``), or None when the call fails (for omforge doctor)."""
    count, ret = acl.rt.get_device_count()
    return count if ret == ACL_SUCCESS else None


class AclRuntime:
    """Checked wrappers over one ``acl`` module (the real one, or a fake in tests)."""

    def __init__(self, acl: Any):
        self.acl = acl

    @staticmethod
    def _ok(ret: int, call: str) -> None:
        if ret != ACL_SUCCESS:
            raise acl_error(call, ret)

    def _value(self, result: tuple[Any, int], call: str) -> Any:
        value, ret = result
        self._ok(ret, call)
        return value

    # --- device, context, stream (§3.2) ---
    def init(self) -> None:
        self._ok(self.acl.init(), "acl.init")

    def finalize(self) -> None:
        self._ok(self.acl.finalize(), "acl.finalize")

    def set_device(self, device: int) -> None:
        self._ok(self.acl.rt.set_device(device), f"acl.rt.set_device({device})")

    def reset_device(self, device: int) -> None:
        self._ok(self.acl.rt.reset_device(device), f"acl.rt.reset_device({device})")

    def create_context(self, device: int) -> Any:
        return self._value(self.acl.rt.create_context(device), "acl.rt.create_context")

    def destroy_context(self, context: Any) -> None:
        self._ok(self.acl.rt.destroy_context(context), "acl.rt.destroy_context")

    def set_context(self, context: Any) -> None:
        self._ok(self.acl.rt.set_context(context), "acl.rt.set_context")

    def create_stream(self) -> Any:
        return self._value(self.acl.rt.create_stream(), "acl.rt.create_stream")

    def destroy_stream(self, stream: Any) -> None:
        self._ok(self.acl.rt.destroy_stream(stream), "acl.rt.destroy_stream")

    # --- memory ---
    def malloc(self, size: int) -> int:
        return self._value(self.acl.rt.malloc(size, MALLOC_HUGE_FIRST), f"acl.rt.malloc({size})")

    def free(self, ptr: int) -> None:
        self._ok(self.acl.rt.free(ptr), "acl.rt.free")

    def malloc_host(self, size: int) -> int:
        return self._value(self.acl.rt.malloc_host(size), f"acl.rt.malloc_host({size})")

    def free_host(self, ptr: int) -> None:
        self._ok(self.acl.rt.free_host(ptr), "acl.rt.free_host")

    def memset(self, ptr: int, size: int, value: int = 0) -> None:
        self._ok(self.acl.rt.memset(ptr, size, value, size), "acl.rt.memset")

    def memcpy(self, dst: int, dst_max: int, src: int, count: int, kind: int) -> None:
        self._ok(self.acl.rt.memcpy(dst, dst_max, src, count, kind), f"acl.rt.memcpy(kind={kind}, {count} bytes)")

    def host_to_device(self, dst: int, dst_max: int, data: bytes) -> None:
        """Copy ``data`` (kept alive by the caller during the call) to device memory at ``dst``."""
        self.memcpy(dst, dst_max, self.acl.util.bytes_to_ptr(data), len(data), MEMCPY_HOST_TO_DEVICE)

    def device_to_host(self, host_ptr: int, host_max: int, src: int, count: int) -> bytes:
        self.memcpy(host_ptr, host_max, src, count, MEMCPY_DEVICE_TO_HOST)
        return self.acl.util.ptr_to_bytes(host_ptr, count)

    def device_to_device(self, dst: int, dst_max: int, src: int, count: int) -> None:
        self.memcpy(dst, dst_max, src, count, MEMCPY_DEVICE_TO_DEVICE)

    def device_to_device_async(self, dst: int, dst_max: int, src: int, count: int, stream: Any) -> None:
        """Queue a D2D copy on ``stream``; it is done after :meth:`synchronize` (§3.2)."""
        self._ok(self.acl.rt.memcpy_async(dst, dst_max, src, count, MEMCPY_DEVICE_TO_DEVICE, stream),
                 f"acl.rt.memcpy_async(D2D, {count} bytes)")

    def synchronize(self, stream: Any) -> None:
        self._ok(self.acl.rt.synchronize_stream(stream), "acl.rt.synchronize_stream")

    def free_device_memory(self) -> tuple[int, int]:
        """``(free, total)`` bytes of the current device's HBM (``acl.rt.get_mem_info(ACL_HBM_MEM)``)."""
        free, total, ret = self.acl.rt.get_mem_info(HBM_MEM)
        self._ok(ret, "acl.rt.get_mem_info(ACL_HBM_MEM)")
        return int(free), int(total)

    def query_size(self, path: str) -> tuple[int, int] | None:
        """``(work, weight)`` bytes an OM needs (``acl.mdl.query_size``, aclmdlQuerySize), or None when ACL cannot
        tell (its docs: not for models whose input shapes are unknown). ``work`` includes the model's input and
        output memory, the KV pool too (hicann/ge ``graph_builder.cc``: memory_size ≥ zero_copy_size; reference
        §5.2): :func:`~omforge.runtime.ascend.acl_plan.device_need` takes them out once."""
        work, weight, ret = self.acl.mdl.query_size(path)
        return (int(work), int(weight)) if ret == ACL_SUCCESS else None

    # --- models (§3.3, §3.4) ---
    def open_load_config(self, path: str) -> tuple[Any, int | None]:
        """A config handle that loads the OM at ``path`` from file as the manifest's ``ACL_LOAD_PATH`` says: without
        ``ACL_MDL_WORKSPACE_MEM_OPTIMIZE`` GE reserves work memory for every input and output, the KV pool included
        (hicann/ge ``davinci_model.cc`` InitFeatureMapAndP2PMem; reference §5.2), and a pool of N bytes costs 2N.
        The load type and the option are ``size_t`` attributes: the C layer refuses either unless ``valueSize ==
        sizeof(size_t)`` (hicann/ge ``model_config_om2.cpp:101-124, 294-316``); pyACL documents ``attrValue`` as an
        int and sizes it itself (aclpythondevg_01_0137), so a Python ``int`` is passed [unverified on hardware].
        Returns ``(handle, None)``, or ``(None, code)`` when ACL refuses the option (the handle is destroyed: the
        caller falls back to :meth:`load_from_file`); any other refusal raises."""
        mdl = self.acl.mdl
        handle = mdl.create_config_handle()
        if not handle:  # the documented failure: a zero handle, no code
            raise AclResourceError("acl.mdl.create_config_handle", 0)
        try:
            for attr, value in ((MDL_LOAD_TYPE_SIZET, MDL_LOAD_FROM_FILE), (MDL_PATH_PTR, path)):
                self._ok(mdl.set_config_opt(handle, attr, value), f"acl.mdl.set_config_opt({attr}, {value!r})")
            refused = mdl.set_config_opt(handle, MDL_WORKSPACE_MEM_OPTIMIZE, WORKSPACE_MEM_OPTIMIZE_INPUTOUTPUT)
        except BaseException:
            mdl.destroy_config_handle(handle)
            raise
        if refused == ACL_SUCCESS:
            return handle, None
        self.destroy_config(handle)
        return None, refused

    def load_with_config(self, handle: Any, path: str) -> int:
        return self._value(self.acl.mdl.load_with_config(handle), f"acl.mdl.load_with_config({path})")

    def destroy_config(self, handle: Any, check: bool = True) -> None:
        """``check=False``: on the way out of a failure (that failure is the one raised)."""
        ret = self.acl.mdl.destroy_config_handle(handle)
        if check:
            self._ok(ret, "acl.mdl.destroy_config_handle")

    def load_from_file(self, path: str) -> int:
        """The fallback load (``aclmdlLoadFromFile``): GE reserves the model's inputs and outputs in its own work
        memory, so the pool counts twice (reference §5.2)."""
        return self._value(self.acl.mdl.load_from_file(path), f"acl.mdl.load_from_file({path})")

    def load_model(self, path: str) -> tuple[int, int | None]:
        """Load ``path`` (:meth:`open_load_config`, else :meth:`load_from_file`); returns the model id and the ACL code
        that refused ``ACL_MDL_WORKSPACE_MEM_OPTIMIZE`` (None when the optimized load was used)."""
        handle, refused = self.open_load_config(path)
        if handle is None:
            return self.load_from_file(path), refused
        try:
            model_id = self.load_with_config(handle, path)
        finally:
            ret = self.acl.mdl.destroy_config_handle(handle)  # also after a failed load; that failure is the one raised
        self._ok(ret, "acl.mdl.destroy_config_handle")
        return model_id, None

    def unload_model(self, model_id: int) -> None:
        self._ok(self.acl.mdl.unload(model_id), "acl.mdl.unload")

    def create_desc(self, model_id: int) -> Any:
        desc = self.acl.mdl.create_desc()
        self._ok(self.acl.mdl.get_desc(desc, model_id), "acl.mdl.get_desc")
        return desc

    def destroy_desc(self, desc: Any) -> None:
        self._ok(self.acl.mdl.destroy_desc(desc), "acl.mdl.destroy_desc")

    def describe(self, desc: Any) -> ModelDesc:
        mdl = self.acl.mdl

        def tensor(kind: str, i: int) -> TensorDesc:
            get_dims = mdl.get_input_dims if kind == "input" else mdl.get_output_dims
            dims = self._value(get_dims(desc, i), f"acl.mdl.get_{kind}_dims({i})")
            name = (mdl.get_input_name_by_index if kind == "input" else mdl.get_output_name_by_index)(desc, i)
            size = (mdl.get_input_size_by_index if kind == "input" else mdl.get_output_size_by_index)(desc, i)
            dtype = (mdl.get_input_data_type if kind == "input" else mdl.get_output_data_type)(desc, i)
            return TensorDesc(name, int(size), tuple(int(d) for d in dims["dims"]), int(dtype))

        inputs = tuple(tensor("input", i) for i in range(mdl.get_num_inputs(desc)))
        outputs = tuple(tensor("output", i) for i in range(mdl.get_num_outputs(desc)))
        index, ret = mdl.get_input_index_by_name(desc, DYNAMIC_INPUT)
        if ret != ACL_SUCCESS:
            return ModelDesc(inputs, outputs, (), None)
        count = self._value(mdl.get_input_dynamic_gear_count(desc, -1), "acl.mdl.get_input_dynamic_gear_count")
        gears = self._value(mdl.get_input_dynamic_dims(desc, -1, count), "acl.mdl.get_input_dynamic_dims")
        return ModelDesc(inputs, outputs, tuple(tuple(int(v) for v in g["dims"]) for g in gears), int(index))

    def create_dataset(self, buffers: Sequence[tuple[int, int]]) -> tuple[Any, list[Any]]:
        """A dataset over device ``(ptr, size)`` buffers, in order; returns it and its data buffers."""
        dataset = self.acl.mdl.create_dataset()
        data_buffers = []
        for ptr, size in buffers:
            buf = self.acl.create_data_buffer(ptr, size)
            data_buffers.append(buf)
            _, ret = self.acl.mdl.add_dataset_buffer(dataset, buf)
            self._ok(ret, "acl.mdl.add_dataset_buffer")
        return dataset, data_buffers

    def destroy_dataset(self, dataset: Any, data_buffers: Sequence[Any]) -> None:
        for buf in data_buffers:
            self._ok(self.acl.destroy_data_buffer(buf), "acl.destroy_data_buffer")
        self._ok(self.acl.mdl.destroy_dataset(dataset), "acl.mdl.destroy_dataset")

    def set_dynamic_dims(self, model_id: int, dataset: Any, index: int, dims: Sequence[int]) -> None:
        self._ok(self.acl.mdl.set_input_dynamic_dims(model_id, dataset, index,
                                                     {"dimCount": len(dims), "name": "", "dims": list(dims)}),
                 "acl.mdl.set_input_dynamic_dims")

    def execute(self, model_id: int, inputs: Any, outputs: Any) -> None:
        self._ok(self.acl.mdl.execute(model_id, inputs, outputs), "acl.mdl.execute")
