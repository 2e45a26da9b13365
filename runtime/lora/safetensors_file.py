"""A safetensors file read into float32 numpy arrays with numpy alone (no ``safetensors`` or ``ml_dtypes`` in the
serving install; bfloat16, which most adapters trained in bf16 are saved as, has no numpy dtype of its own).

The format (https://github.com/huggingface/safetensors, README "Format"): 8 bytes little-endian header length N,
N bytes of JSON ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, then the data
(offsets relative to its start), little-endian, C order.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "F64": np.dtype("<f8"), "BF16": np.dtype("<u2")}


class SafetensorsError(ValueError):
    """A file that is not a readable safetensors file, or a tensor of a dtype LoRA weights never have."""


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of ``path`` as a float32 array (F32, F16, BF16, F64); :class:`SafetensorsError` otherwise."""
    raw = path.read_bytes()
    if len(raw) < 8:
        raise SafetensorsError(f"{path}: not a safetensors file (too short)")
    (size,) = struct.unpack("<Q", raw[:8])
    try:
        header = json.loads(raw[8:8 + size])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsError(f"{path}: not a safetensors file (header: {e})") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: not a safetensors file (the header is not a JSON object)")
    data = memoryview(raw)[8 + size:]
    out: dict[str, np.ndarray] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise SafetensorsError(f"{path}: tensor '{name}' is {info.get('dtype')}; LoRA weights are read as "
                                   f"F32, F16, BF16 or F64")
        begin, end = info["data_offsets"]
        shape = tuple(int(d) for d in info["shape"])
        if end > len(data) or end - begin != dtype.itemsize * int(np.prod(shape, dtype=np.int64)):
            raise SafetensorsError(f"{path}: tensor '{name}' data_offsets [{begin}, {end}] do not fit its shape "
                                   f"{list(shape)} or the file (truncated?)")
        arr = np.frombuffer(data[begin:end], dtype=dtype).reshape(shape)
        if info["dtype"] == "BF16":  # bfloat16 is the top half of a float32
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        out[name] = np.ascontiguousarray(arr, dtype=np.float32)
    return out
