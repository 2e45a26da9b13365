"""Every ``acl.*`` (pyACL) call omforge makes: its argument types, what it returns, and the documentation page that
says so. :mod:`omforge.runtime.ascend.acl_api` calls nothing that is not here, ``tests/fake_acl.py`` refuses any call
or argument type that is not here, and :func:`acl_call_rows` renders the table for docs/ascend-conformance.md.

Types: ``int``, ``str``, ``bytes``, ``dict``; ``handle`` is an opaque object an earlier call returned (pyACL passes
them as int addresses). Returns: ``ret`` is the bare ACL error code (0 success, reference/ascend.md §3.1); a tuple
lists the values in pyACL's order, ``ret`` last. Pages are CANN's pyACL ("aclpythondevg") pages where one was found,
else the C page of the same function; versions differ (6.0.1 – 9.0) and are named in the URL. [unverified] marks a
row whose pyACL page was not found: its form is the C API's, through pyACL's documented conventions.

NOT RUN ON HARDWARE: no call here has run against a real pyACL; the table is read from the documentation.
"""

from __future__ import annotations

from dataclasses import dataclass

_EN800 = "https://www.hiascend.com/document/detail/en/canncommercial/800/apiref/appdevgapi/"
_ZH800 = "https://www.hiascend.com/document/detail/zh/canncommercial/800/apiref/appdevgapi/"
_ZH601 = "https://hiascend.com/document/detail/zh/canncommercial/601/inferapplicationdev/aclpythondevg/"
_EN900G = "https://www.hiascend.com/document/detail/en/CANNCommunityEdition/900/API/ascendgraphapi/"
_ZH900G = "https://www.hiascend.com/document/detail/zh/canncommercial/900/API/ascendgraphapi/"
_IDK = ("https://hiascend.com/document/detail/zh/Atlas200IDKA2DeveloperKit/23.0.RC2/"
        "Application%20Development%20Guide/aadgp/")
_GUIDE = "reference/ascend.md §3.2 (call list; pyACL page not located) [unverified]"


@dataclass(frozen=True)
class AclCall:
    """One pyACL function: ``args`` are ``(parameter, type)`` in call order."""

    name: str
    args: tuple[tuple[str, str], ...]
    returns: str
    source: str


def _c(name: str, args: str, returns: str, source: str) -> AclCall:
    """A row from its compact form: ``args`` as ``"p: t, q: u"``."""
    pairs = tuple(tuple(a.split(": ")) for a in args.split(", ")) if args else ()
    return AclCall(name, pairs, returns, source)  # type: ignore[arg-type]


CALLS: tuple[AclCall, ...] = (
    # --- runtime: device, context, stream (reference §3.2) ---
    _c("acl.init", "", "ret", _GUIDE),
    _c("acl.finalize", "", "ret", _GUIDE),
    _c("acl.rt.get_device_count", "", "(count: int, ret)", _GUIDE),
    _c("acl.rt.set_device", "device_id: int", "ret", _IDK + "aclpythondevg_01_0060.html"),
    _c("acl.rt.reset_device", "device_id: int", "ret", _GUIDE),
    _c("acl.rt.create_context", "device_id: int", "(context: handle, ret)", _GUIDE),
    _c("acl.rt.destroy_context", "context: handle", "ret", _GUIDE),
    _c("acl.rt.set_context", "context: handle", "ret", _GUIDE),
    _c("acl.rt.create_stream", "", "(stream: handle, ret)", _GUIDE),
    _c("acl.rt.destroy_stream", "stream: handle", "ret", _GUIDE),
    _c("acl.rt.synchronize_stream", "stream: handle", "ret", _GUIDE),
    # --- memory (§3.2) ---
    _c("acl.rt.malloc", "size: int, policy: int", "(ptr: int, ret)",
       "https://hiascend.com/document/detail/zh/canncommercial/700/inferapplicationdev/aclpythondevg/"
       "aclpythondevg_01_0103.html"),
    _c("acl.rt.free", "ptr: int", "ret", _GUIDE),
    _c("acl.rt.malloc_host", "size: int", "(ptr: int, ret)", _GUIDE),
    _c("acl.rt.free_host", "ptr: int", "ret", _GUIDE),
    _c("acl.rt.memset", "ptr: int, max_size: int, value: int, count: int", "ret", _GUIDE),
    _c("acl.rt.memcpy", "dst: int, dest_max: int, src: int, count: int, kind: int", "ret",
       _EN800 + "aclpythondevg_01_0124.html"),
    _c("acl.rt.memcpy_async", "dst: int, dest_max: int, src: int, count: int, kind: int, stream: handle", "ret",
       _EN800 + "aclpythondevg_01_0125.html (src and dst 64-byte aligned)"),
    _c("acl.rt.get_mem_info", "attr: int", "(free: int, total: int, ret)", _EN800 + "aclpythondevg_01_0118.html"),
    _c("acl.util.bytes_to_ptr", "data: bytes", "ptr: int",
       "https://www.hiascend.com/document/detail/zh/canncommercial/latest/API/runtimeapi/aclpythondevg_01_0052.html"),
    _c("acl.util.ptr_to_bytes", "ptr: int, size: int", "data: bytes",
       "https://www.hiascend.com/document/detail/en/CANNCommunityEdition/900/API/runtimeapi/"
       "aclpythondevg_01_0056.html"),
    # --- model loading (§3.3; the config-handle load: reference §5.2) ---
    _c("acl.mdl.query_size", "model_path: str", "(work_size: int, weight_size: int, ret)",
       "https://www.hiascend.com/document/detail/zh/canncommercial/900/API/ascendgraphapi/aclcppdevg_03_0303.html "
       "(C page) [unverified: pyACL page not located]"),
    _c("acl.mdl.create_config_handle", "", "config_handle: handle (0 on failure)",
       _EN900G + "aclpythondevg_01_0160.html"),
    _c("acl.mdl.set_config_opt", "config_handle: handle, attr: int, attr_value: int | str", "ret",
       _ZH601 + "aclpythondevg_01_0137.html (attrValue: int); " + _ZH800 + "aclpythondevg_01_0162.html; "
       "attributes: " + _EN800 + "aclcppdevg_03_1375.html (LOAD_TYPE_SIZET and WORKSPACE_MEM_OPTIMIZE are size_t: "
       "the C layer refuses unless valueSize == sizeof(size_t), hicann/ge ffdcbc9 "
       "api/acl/acl_model/model/model_config_om2.cpp:101-124, 294-316; a Python int, pyACL sizes it [unverified: "
       "pyACL's marshalling is not documented])"),
    _c("acl.mdl.load_with_config", "config_handle: handle", "(model_id: int, ret)",
       _ZH601 + "aclpythondevg_01_0138.html"),
    _c("acl.mdl.destroy_config_handle", "config_handle: handle", "ret", _ZH900G + "aclpythondevg_01_0161.html"),
    _c("acl.mdl.load_from_file", "model_path: str", "(model_id: int, ret)",
       _EN800 + "aclpythondevg_01_0147.html (the fallback load: GE reserves the inputs and outputs in its work "
       "memory)"),
    _c("acl.mdl.unload", "model_id: int", "ret", _GUIDE),
    # --- model description (§3.3, §3.4) ---
    _c("acl.mdl.create_desc", "", "model_desc: handle", _GUIDE),
    _c("acl.mdl.get_desc", "model_desc: handle, model_id: int", "ret", _EN800 + "aclpythondevg_01_0205.html"),
    _c("acl.mdl.destroy_desc", "model_desc: handle", "ret", _GUIDE),
    _c("acl.mdl.get_num_inputs", "model_desc: handle", "count: int", _GUIDE),
    _c("acl.mdl.get_num_outputs", "model_desc: handle", "count: int", _GUIDE),
    _c("acl.mdl.get_input_name_by_index", "model_desc: handle, index: int", "name: str",
       _EN800 + "aclpythondevg_01_0213.html"),
    _c("acl.mdl.get_output_name_by_index", "model_desc: handle, index: int", "name: str (op:edge:name for ONNX)",
       _EN800 + "aclcppdevg_03_1457.html (C page) [unverified: pyACL page not located]"),
    _c("acl.mdl.get_input_dims", "model_desc: handle, index: int", "(dims: dict {name, dimCount, dims}, ret)",
       _GUIDE),
    _c("acl.mdl.get_output_dims", "model_desc: handle, index: int", "(dims: dict {name, dimCount, dims}, ret)",
       _GUIDE),
    _c("acl.mdl.get_input_size_by_index", "model_desc: handle, index: int", "size: int (largest gear)",
       _ZH800 + "aclpythondevg_01_0199.html"),
    _c("acl.mdl.get_output_size_by_index", "model_desc: handle, index: int", "size: int (largest gear)", _GUIDE),
    _c("acl.mdl.get_input_data_type", "model_desc: handle, index: int", "dtype: int (aclDataType)", _GUIDE),
    _c("acl.mdl.get_output_data_type", "model_desc: handle, index: int", "dtype: int (aclDataType)", _GUIDE),
    _c("acl.mdl.get_input_index_by_name", "model_desc: handle, name: str", "(index: int, ret)",
       _EN800 + "aclpythondevg_01_0219.html"),
    _c("acl.mdl.get_input_dynamic_gear_count", "model_desc: handle, index: int", "(count: int, ret)",
       _EN800 + "aclcppdevg_03_1466.html (C page) [unverified: pyACL page not located]"),
    _c("acl.mdl.get_input_dynamic_dims", "model_desc: handle, index: int, gear_count: int",
       "(gears: list of dict {dimCount, dims}, ret)",
       "https://www.hiascend.com/document/detail/en/canncommercial/850/API/appdevgapi/aclpythondevg_01_0217.html"),
    # --- datasets and execution (§3.3, §3.4) ---
    _c("acl.create_data_buffer", "data: int, size: int", "data_buffer: handle", _ZH601 + "aclpythondevg_01_0013.html"),
    _c("acl.destroy_data_buffer", "data_buffer: handle", "ret", _GUIDE),
    _c("acl.mdl.create_dataset", "", "dataset: handle", _GUIDE),
    _c("acl.mdl.add_dataset_buffer", "dataset: handle, data_buffer: handle", "(dataset: handle, ret)",
       "https://www.hiascend.com/doc_center/source/zh/canncommercial/800/apiref/appdevgapi/aclpythondevg_01_0188.html"),
    _c("acl.mdl.destroy_dataset", "dataset: handle", "ret", _GUIDE),
    _c("acl.mdl.set_input_dynamic_dims", "model_id: int, dataset: handle, index: int, dims: dict", "ret",
       _EN900G + "aclpythondevg_01_0159.html"),
    _c("acl.mdl.execute", "model_id: int, input: handle, output: handle", "ret",
       _EN900G + "aclpythondevg_01_0145.html"),
)

BY_NAME: dict[str, AclCall] = {c.name: c for c in CALLS}

ARG_TYPES: dict[str, tuple[type, ...]] = {"int": (int,), "str": (str,), "bytes": (bytes,), "dict": (dict,),
                                          "int | str": (int, str), "handle": (object,)}
"""What each type name admits (``bool`` is not an ``int`` here; a ``handle`` is anything but None)."""


def argument_errors(name: str, args: tuple[object, ...]) -> str | None:
    """Why ``name(*args)`` is outside the table (one line), or None when the table has it with these types."""
    call = BY_NAME.get(name)
    if call is None:
        return f"{name} is not in omforge's pyACL call table (contract/acl_calls.py)"
    if len(args) != len(call.args):
        return f"{name} takes {len(call.args)} arguments ({_args(call)}), got {len(args)}"
    for value, (param, kind) in zip(args, call.args):
        if value is None or isinstance(value, bool) or not isinstance(value, ARG_TYPES[kind]):
            return f"{name}: {param} must be {kind}, got {type(value).__name__}"
    return None


def _args(call: AclCall) -> str:
    return ", ".join(f"{p}: {t}" for p, t in call.args)


def acl_call_rows() -> list[tuple[str, str, str, str]]:
    """The table as ``(call, argument types, returns, source)`` rows, in the order above."""
    return [(c.name, _args(c) or "—", c.returns, c.source) for c in CALLS]


def acl_calls_markdown() -> str:
    """The rows as a markdown table (for docs/ascend-conformance.md's "pyACL calls" section)."""
    lines = ["| call | arguments | returns | source |", "| --- | --- | --- | --- |"]
    lines += [f"| `{c}` | {a} | {r} | {s} |" for c, a, r, s in acl_call_rows()]
    return "\n".join(lines) + "\n"
