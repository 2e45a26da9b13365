"""A float64 numpy reference of the step ABI's paged attention, and a one-node ONNX graph of the kernel op,
for tests/test_kernels.py (and the lowering tests)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from omforge.runtime.kernels import DOMAIN

INPUTS = ("q", "k", "v", "key_cache", "value_cache", "slot_mapping", "block_tables", "query_index", "token_index",
          "position_ids", "decode_block_tables", "decode_query_index")


def paged_attention_reference(f: dict[str, np.ndarray], *, q_heads: int, kv_heads: int, block_size: int,
                              scale: float, window: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(o [T, Hq, D], key_pool, value_pool)`` in float64, activations given token-major ``[T, H, D]``."""
    q, k, v = (f[n].astype(np.float64) for n in ("q", "k", "v"))
    kc, vc = f["key_cache"].astype(np.float64).copy(), f["value_cache"].astype(np.float64).copy()
    kc[f["slot_mapping"]], vc[f["slot_mapping"]] = k, v
    pos, tidx = f["position_ids"][0], f["token_index"]
    out = np.zeros_like(q)
    group = q_heads // kv_heads
    rows = [(t, f["block_tables"][b], b * f["query_index"].shape[1] + i)
            for b, row in enumerate(f["query_index"]) for i, t in enumerate(row)]
    base = f["query_index"].size
    rows += [(row[0], f["decode_block_tables"][d], base + d) for d, row in enumerate(f["decode_query_index"])]
    for t, table, r in rows:
        if tidx[t] != r:
            continue
        p = pos[t]
        keys = np.arange(p + 1)
        if window:
            keys = keys[keys > p - window]
        slots = table[keys // block_size] * block_size + keys % block_size
        for h in range(q_heads):
            s = kc[slots, h // group] @ q[t, h] * scale
            w = np.exp(s - s.max())
            out[t, h] = (w / w.sum()) @ vc[slots, h // group]
    return out, kc, vc


def kernel_model(*, q_heads: int, kv_heads: int, head_dim: int, block_size: int, scale: float, window: int = 0,
                 token_major: bool = False, kv_type: int = TensorProto.FLOAT, op_type: str = "PagedAttention",
                 attrs: dict | None = None) -> onnx.ModelProto:
    """One PagedAttention node; q/k/v ``[1, H, T, D]`` (or ``[1, T, H*D]`` with ``token_major``)."""
    def act(name: str, heads: int):  # noqa: ANN202
        shape = [1, "T", heads * head_dim] if token_major else [1, heads, "T", head_dim]
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)

    ints = {n: helper.make_tensor_value_info(n, TensorProto.INT64, None) for n in INPUTS[5:]}
    pools = [helper.make_tensor_value_info(n, kv_type, ["S", kv_heads, head_dim]) for n in INPUTS[3:5]]
    inputs = [act("q", q_heads), act("k", kv_heads), act("v", kv_heads), *pools, *ints.values()]
    attributes = dict(scale=scale, q_heads=q_heads, kv_heads=kv_heads, block_size=block_size, window=window)
    attributes.update(attrs or {})
    node = helper.make_node(op_type, list(INPUTS), ["o", "key_cache_out", "value_cache_out"], domain=DOMAIN,
                            **attributes)
    outputs = [helper.make_tensor_value_info("o", TensorProto.FLOAT, None),
               helper.make_tensor_value_info("key_cache_out", kv_type, None),
               helper.make_tensor_value_info("value_cache_out", kv_type, None)]
    graph = helper.make_graph([node], "paged_attention", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, 1)],
                             ir_version=9)
