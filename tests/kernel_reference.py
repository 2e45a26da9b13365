"""A float64 numpy reference of the step ABI's paged attention, and a one-node ONNX graph of the kernel op,
for tests/test_kernels.py (and the lowering tests)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from omforge.contract.kernel_abi import WEIGHT_LAYOUT
from omforge.passes.gemm_pack import to_bf16 as to_bf16  # the kernels' rounding (round to nearest even)
from omforge.runtime.ort.kernels import DOMAIN

INPUTS = ("q", "k", "v", "key_cache", "value_cache", "slot_mapping", "block_tables", "query_index", "token_index",
          "position_ids", "decode_block_tables", "decode_query_index")


def kernel_session(model: onnx.ModelProto, threads: int = 2) -> ort.InferenceSession:
    """A CPU session of a one-node kernel model, omforge's kernel library registered, on ``threads`` threads."""
    from omforge.runtime.ort import kernels

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    kernels.register(options)
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def forced_isa_outputs(folder: Path, isa: str, status: str, want: str, models: int) -> np.ndarray | None:
    """Models ``m0.onnx`` … ``m{models-1}.onnx`` run on ``x.npy`` in ``folder``, in a child process whose kernel
    library is forced to ``OMFORGE_KERNELS_ISA=isa``: their outputs stacked; None when the child's
    ``kernels.status().<status>`` is not ``want`` (the CPU lacks that path)."""
    code = ("import sys, onnx, numpy as np, kernel_reference as t; from omforge.runtime.ort import kernels; "
            f"kernels.status().{status} == {want!r} or sys.exit(3); d = sys.argv[1]; x = np.load(d + '/x.npy'); "
            f"np.save(d + '/y-{isa}.npy', np.stack([t.kernel_session(onnx.load(f'{{d}}/m{{i}}.onnx'))"
            f".run(None, {{'x': x}})[0] for i in range({models})]))")
    r = subprocess.run([sys.executable, "-c", code, str(folder)], env={**os.environ, "OMFORGE_KERNELS_ISA": isa},
                       cwd=Path(__file__).parent, capture_output=True, text=True, timeout=300)
    if r.returncode == 3:
        return None
    assert r.returncode == 0, r.stderr[-2000:]
    return np.load(folder / f"y-{isa}.npy")


KV_ONNX_TYPES = {"float32": TensorProto.FLOAT, "bfloat16": TensorProto.BFLOAT16, "int8": TensorProto.INT8}
KV_OPS = {"float32": "PagedAttention", "bfloat16": "PagedAttentionBF16", "int8": "PagedAttentionInt8"}


def from_bf16(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32)


def quantize_int8(x: np.ndarray) -> np.ndarray:
    """``[..., D]`` float32 → ``[..., D + 4]`` int8: symmetric per row, the float32 scale in the last 4 bytes."""
    x = np.asarray(x, np.float32)
    scale = (np.abs(x).max(-1, keepdims=True) / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(scale > 0, np.clip(np.rint(x / scale), -127, 127), 0).astype(np.int8)
    return np.concatenate([q, np.ascontiguousarray(scale).view(np.int8)], axis=-1)


def dequantize_int8(p: np.ndarray) -> np.ndarray:
    scale = np.ascontiguousarray(p[..., -4:]).view(np.float32)
    return p[..., :-4].astype(np.float32) * scale


ENCODE = {"float32": lambda x: np.asarray(x, np.float32), "bfloat16": to_bf16, "int8": quantize_int8}
DECODE = {"float32": lambda p: p, "bfloat16": from_bf16, "int8": dequantize_int8}


def paged_attention_reference(f: dict[str, np.ndarray], *, q_heads: int, kv_heads: int, block_size: int,
                              scale: float, window: int = 0, kv_dtype: str = "float32",
                              p_rounding: np.ndarray | None = None, bf16_tokens: np.ndarray | None = None,
                              dot_rounding: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(o [T, Hq, D] float64, key_pool, value_pool)`` with the pools encoded as ``kv_dtype`` (the new rows
    written as the kernel writes them), activations given token-major ``[T, H, D]``; attention over the
    pools as stored (decoded), in float64.

    ``p_rounding`` (int8 pools; a ``[T, Hq, D]`` array, filled in): per output element, the standard deviation
    that rounding the probabilities to int16 gives it, as the int8 decode path rounds them (paged_attention_impl.h
    ``pv_tile_i16``: per block of keys, each probability times its value row's scale rounded with the row's own
    step, the largest -> 32767): errors uniform within half a step, so σ² = Σ_blocks step² / 12 · Σ code², with the
    step ``max(P·s_v) / 32767`` (P normalised) and the codes the block's int8 values of that element.

    ``bf16_tokens`` (a ``[T]`` bool mask) and ``dot_rounding`` (``[T, Hq, D]``, filled in): for the tokens whose
    attention scores and sums P·V in bfloat16 dot products (paged_attention_impl.h, bfloat16 pools on the tile path),
    per output element the standard deviation, to first order, of what rounding ``q · scale`` and the probabilities
    to bfloat16 moves it by: each rounded value's relative error taken uniform within ±2⁻⁸ (nearest even, 8
    significant bits), so var = Σ_e M_de² (2⁻⁸ q_e)² / 3 with M = Σ_j w_j (v_j − o) k_jᵀ (the output's derivative
    in q through the scores), plus Σ_j (w_j v_jd)² 2⁻¹⁶ / 3 (the probabilities; their sum l is not rounded)."""
    q = f["q"].astype(np.float64)
    pools = []
    for name, new in (("key_cache", f["k"]), ("value_cache", f["v"])):
        pool = f[name].copy()
        pool[f["slot_mapping"]] = ENCODE[kv_dtype](new)
        pools.append(pool)
    kc, vc = (DECODE[kv_dtype](p).astype(np.float64) for p in pools)
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
            if bf16_tokens is not None and bf16_tokens[t]:
                wn, kk, vv = w / w.sum(), kc[slots, h // group], vc[slots, h // group]
                m = (wn[:, None] * (vv - out[t, h])).T @ kk  # [D, D]: d(o_d) / d(q_e · scale)
                var_q = (m ** 2) @ ((2.0 ** -8 * q[t, h] * scale) ** 2 / 3)
                var_p = ((wn[:, None] * vv) ** 2).sum(0) * 2.0 ** -16 / 3
                dot_rounding[t, h] = np.sqrt(var_q + var_p)
            if p_rounding is not None:
                v = pools[1][slots, h // group]
                codes2 = v[:, :-4].astype(np.float64) ** 2
                pv = w / w.sum() * np.ascontiguousarray(v[:, -4:]).view(np.float32)[:, 0]
                blocks = keys // block_size
                var = sum((pv[blocks == b].max() / 32767) ** 2 / 12 * codes2[blocks == b].sum(0)
                          for b in np.unique(blocks))
                p_rounding[t, h] = np.sqrt(var)
    return out, pools[0], pools[1]


def kernel_model(*, q_heads: int, kv_heads: int, head_dim: int, block_size: int, scale: float, window: int = 0,
                 token_major: bool = False, kv_dtype: str = "float32", attrs: dict | None = None,
                 packed: bool = False, rotary: bool = False) -> onnx.ModelProto:
    """One PagedAttention node; q/k/v ``[1, H, T, D]`` (or ``[1, T, H*D]`` with ``token_major``). ``packed``: one
    input ``qkv [1, T, (Hq + 2*Hkv)*D]`` and k, v omitted; ``rotary``: inputs ``cos_cache`` / ``sin_cache``
    ``[1, T, D/2]`` (the kernel rotates q and k)."""
    def act(name: str, heads: int):  # noqa: ANN202
        shape = [1, "T", heads * head_dim] if token_major or packed else [1, heads, "T", head_dim]
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)

    kv_type, op_type = KV_ONNX_TYPES[kv_dtype], KV_OPS[kv_dtype]
    row = head_dim + 4 if kv_dtype == "int8" else head_dim
    ints = {n: helper.make_tensor_value_info(n, TensorProto.INT64, None) for n in INPUTS[5:]}
    pools = [helper.make_tensor_value_info(n, kv_type, ["S", kv_heads, row]) for n in INPUTS[3:5]]
    acts = [act("qkv", q_heads + 2 * kv_heads)] if packed else [act("q", q_heads), act("k", kv_heads),
                                                                 act("v", kv_heads)]
    node_inputs = ["qkv", "", "", *INPUTS[3:]] if packed else list(INPUTS)
    caches = []
    if rotary:
        caches = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, "T", head_dim // 2])
                  for n in ("cos_cache", "sin_cache")]
        node_inputs += ["cos_cache", "sin_cache"]
    inputs = [*acts, *pools, *ints.values(), *caches]
    attributes = dict(scale=scale, q_heads=q_heads, kv_heads=kv_heads, block_size=block_size, window=window)
    attributes.update(attrs or {})
    node = helper.make_node(op_type, node_inputs, ["o", "key_cache_out", "value_cache_out"], domain=DOMAIN,
                            **attributes)
    outputs = [helper.make_tensor_value_info("o", TensorProto.FLOAT, None),
               helper.make_tensor_value_info("key_cache_out", kv_type, None),
               helper.make_tensor_value_info("value_cache_out", kv_type, None)]
    graph = helper.make_graph([node], "paged_attention", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, 1)],
                             ir_version=9)


def rotate_half(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE of ``x [T, H, D]`` with ``cos``/``sin [T, D/2]``, in float32 with each product and sum
    rounded (the kernel's formula: x1·c − x2·s, x2·c + x1·s)."""
    h = x.shape[-1] // 2
    c, s = cos[:, None, :].astype(np.float32), sin[:, None, :].astype(np.float32)
    x1, x2 = x[..., :h], x[..., h:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(np.float32)


def matmul_q_model(w, op: str = "MatMulQ", **attrs: int) -> onnx.ModelProto:  # noqa: ANN001 - gemm_pack.PanelWeights
    """One ``MatMulQ`` (or ``op``: ``MatMulQBF16``) node ``y [M, N] = x [M, K] · Wᵀ`` over panel16 weights ``w``
    (attrs override the node's)."""
    inits = [onnx.numpy_helper.from_array(w.codes, "codes"), onnx.numpy_helper.from_array(w.scales, "scales")]
    inputs = ["x", "codes", "scales"]
    if w.offsets is not None:
        inits.append(onnx.numpy_helper.from_array(w.offsets, "offsets"))
        inputs.append("offsets")
    node = helper.make_node(op, inputs, ["y"], domain=DOMAIN, **{"K": w.k, "N": w.n, "bits": w.bits,
                                                              "block_size": w.block, "layout": WEIGHT_LAYOUT, **attrs})
    graph = helper.make_graph([node], "matmul_q", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", w.k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", w.n])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)])


def matmul_q_reference(x: np.ndarray, packed) -> np.ndarray:  # noqa: ANN001 - quant.Packed
    """float64 ``MatMulQ``: activations quantized to int8 per 32 k of a row exactly as the kernel does (float32
    scale ``max|x| / 127``, round half to even), the weight's symmetric part multiplied by them and its block
    offsets by the exact x (qgemm.h's formula)."""
    from omforge.passes import quant

    m, k = x.shape
    kp = packed.k_blocks * packed.block
    xp = np.zeros((m, kp), np.float32)
    xp[:, :k] = x
    chunks = xp.reshape(m, -1, 32)
    amax = np.abs(chunks).max(-1)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    a = np.clip(np.rint(chunks * inv[..., None]), -127, 127)
    xq = (a * (amax / np.float32(127)).astype(np.float64)[..., None]).reshape(m, kp)[:, :k]
    w = quant.dequantize(packed).astype(np.float64)
    if packed.block_min is None:
        return xq @ w.T
    offsets = np.repeat(packed.block_min.astype(np.float64), packed.block, axis=1)[:, :k]
    return xq @ (w - offsets).T + x.astype(np.float64) @ offsets.T


def matmul_q_bf16_reference(x: np.ndarray, packed) -> np.ndarray:  # noqa: ANN001 - quant.Packed
    """float64 ``MatMulQBF16``: x rounded to bfloat16, the weight as the kernel decompresses it (``(c − z)·s + m``
    rounded to float32 once, as by fma, then to bfloat16), their products summed exactly."""
    from omforge.passes import quant

    kb, z = packed.k_blocks, 1 << (packed.bits - 1)
    codes = quant.unpacked_codes(packed).reshape(packed.n, kb, packed.block).astype(np.float64)
    w = (codes - z) * packed.scales.reshape(packed.n, kb, 1).astype(np.float64)  # exact: the fma's product
    if packed.block_min is not None:
        w += packed.block_min[..., None].astype(np.float64)
    w = w.reshape(packed.n, -1)[:, :packed.k].astype(np.float32)  # one rounding, as fma's
    return from_bf16(to_bf16(x)).astype(np.float64) @ from_bf16(to_bf16(w)).astype(np.float64).T


def matmul_bf16_model(codes: np.ndarray, n: int, k: int, **attrs: int) -> onnx.ModelProto:
    """One ``MatMulBF16`` node ``y [M, N] = x [M, K] · Wᵀ`` over the bfloat16 panels ``codes``."""
    return _panel_matmul("MatMulBF16", codes, n, k, attrs)


def matmul_f32_model(panels: np.ndarray, n: int, k: int, **attrs: int) -> onnx.ModelProto:
    """One ``MatMulF32`` node ``y [M, N] = x [M, K] · Wᵀ`` over the float32 panels ``panels``."""
    return _panel_matmul("MatMulF32", panels, n, k, attrs)


def _panel_matmul(op: str, weight: np.ndarray, n: int, k: int, attrs: dict[str, int]) -> onnx.ModelProto:
    node = helper.make_node(op, ["x", "w"], ["y"], domain=DOMAIN,
                            **{"K": k, "N": n, "layout": WEIGHT_LAYOUT, **attrs})
    graph = helper.make_graph([node], op, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", n])],
                              [onnx.numpy_helper.from_array(weight, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)])
