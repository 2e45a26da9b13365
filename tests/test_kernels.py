"""The native PagedAttention kernel (runtime/ort/kernels) against a float64 numpy reference: decode, prefill,
chunk continuation, mixed steps, GQA groups, head sizes, block sizes, shared prefix blocks, sliding windows,
every ISA path this CPU can run, in-place and unaliased pool writes, and its errors."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from kernel_reference import ENCODE, INPUTS, kernel_model, paged_attention_reference, rotate_half
from kernel_reference import kernel_session as session
from omforge.contract import cdiv
from omforge.runtime.ort import kernels
from omforge.runtime.step import SeqWork, build_step

pytestmark = pytest.mark.skipif(not kernels.status().available, reason=f"kernel library: {kernels.status().reason}")


def make_step(rng: np.random.Generator, seqs: list[tuple[int, int]], block_size: int, num_blocks: int,
              shared_prefix_blocks: int = 0, split_decodes: bool = True) -> dict[str, np.ndarray]:
    """Step inputs for sequences ``(cached tokens, new tokens)``, each with blocks of its own except the first
    ``shared_prefix_blocks``, which every sequence shares (their tokens must all be cached)."""
    free = list(rng.permutation(num_blocks))
    shared = [int(free.pop()) for _ in range(shared_prefix_blocks)]
    work = []
    for start, n in seqs:
        need = cdiv(start + n, block_size)
        assert start >= shared_prefix_blocks * block_size
        table = shared + [int(free.pop()) for _ in range(need - len(shared))]
        work.append(SeqWork(list(rng.integers(0, 100, n)), start, table))
    return build_step(work, block_size, split_decodes=split_decodes)


def run_case(rng, seqs, *, q_heads=9, kv_heads=3, head_dim=64, block_size=16, num_blocks=64, window=0,  # noqa: ANN001
             shared_prefix_blocks: int = 0, in_place: bool = True, token_major: bool = False,
             split_decodes: bool = True, kv_dtype: str = "float32", round_q_int16: bool = False,
             packed: bool = False, rotary: bool = False) -> None:
    """One node against the float64 reference. int8 pools: decode rows score with q rounded to int16 per row
    (paged_attention_impl.h), which moves outputs by ~1e-4 (atol 2e-4 here); ``round_q_int16`` gives the reference
    that same rounding instead, and the float tolerance applies; their probabilities are rounded to int16 per block
    too, and each element's tolerance grows by 6 σ of what that moves it by (kernel_reference ``p_rounding``).
    ``packed``: q, k, v as one ``[1, T, (Hq+2Hkv)*D]`` input; ``rotary``: the kernel rotates q and k with cos/sin
    of the step's positions, the reference is given them rotated in float32 (kernel_reference.rotate_half), so the
    pools must match exactly."""
    step = make_step(rng, seqs, block_size, num_blocks, shared_prefix_blocks, split_decodes)
    T = step["input_ids"].shape[1]
    scale = head_dim ** -0.5
    f = {k: step[k] for k in ("slot_mapping", "block_tables", "query_index", "token_index", "position_ids",
                              "decode_block_tables", "decode_query_index")}
    f["q"] = rng.standard_normal((T, q_heads, head_dim), dtype=np.float32)
    f["k"] = rng.standard_normal((T, kv_heads, head_dim), dtype=np.float32)
    f["v"] = rng.standard_normal((T, kv_heads, head_dim), dtype=np.float32)
    pools = [ENCODE[kv_dtype](rng.standard_normal((num_blocks * block_size, kv_heads, head_dim), dtype=np.float32))
             for _ in range(2)]
    f["key_cache"], f["value_cache"] = (p.copy() for p in pools)
    ref = dict(f)
    if rotary:  # the step's real angles: position × 10000^(-2i/D)
        angles = f["position_ids"][0, :, None] * 10000.0 ** (-np.arange(head_dim // 2) * 2 / head_dim)
        f["cos_cache"], f["sin_cache"] = (fn(angles).astype(np.float32)[None] for fn in (np.cos, np.sin))
        ref.update(q=rotate_half(f["q"], f["cos_cache"][0], f["sin_cache"][0]),
                   k=rotate_half(f["k"], f["cos_cache"][0], f["sin_cache"][0]))
    if round_q_int16:
        ref["q"] = rounded_q_int16(ref["q"], scale)
    p_rounding = np.zeros((T, q_heads, head_dim)) if kv_dtype == "int8" else None
    bf16_tokens = dot_rounding = None
    if kv_dtype == "bfloat16" and kernels.status().isa == "avx512bf16":
        bf16_tokens = tile_path_tokens(f, q_heads // kv_heads, cascade=shared_prefix_blocks > 0)
        dot_rounding = np.zeros((T, q_heads, head_dim))
    want_o, want_k, want_v = paged_attention_reference(ref, q_heads=q_heads, kv_heads=kv_heads, block_size=block_size,
                                                       scale=scale, window=window, kv_dtype=kv_dtype,
                                                       p_rounding=p_rounding, bf16_tokens=bf16_tokens,
                                                       dot_rounding=dot_rounding)
    model = kernel_model(q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size, scale=scale,
                         window=window, token_major=token_major, kv_dtype=kv_dtype, packed=packed, rotary=rotary)
    o, k_out, v_out = run_kernel(model, f, pools, in_place, token_major or packed, kv_dtype, packed=packed)
    atol = 2e-4 if kv_dtype == "int8" and head_dim % 32 == 0 and not round_q_int16 else 2e-5
    if p_rounding is not None:  # int8 decode rows: probabilities rounded to int16; 6 σ of what that gives
        atol = atol + 6 * p_rounding
    if dot_rounding is not None:  # bfloat16 pools' tile path: q and the probabilities rounded to bfloat16
        assert bf16_tokens.any(), "no token took the bfloat16 tile path: the case checks nothing of it"
        atol = atol + 6 * dot_rounding
    assert_close(o, want_o, atol=atol, rtol=1e-4)  # against attention over the pools as stored
    np.testing.assert_array_equal(k_out, want_k)
    np.testing.assert_array_equal(v_out, want_v)


def tile_path_tokens(f: dict[str, np.ndarray], group: int, cascade: bool) -> np.ndarray:
    """``[T]`` bool: the tokens whose attention runs on the kernel's tile path (paged_attention_impl.h attend_item):
    those of a work item (a ``query_index`` row) with more than kRowPathRows = 8 query rows per KV head (tokens ×
    group); with ``cascade`` (decodes on shared blocks, which plan_cascade attends on the tile path, whether they sit
    in the decode group or in one-token items) every token."""
    T = f["position_ids"].shape[1]
    mask = np.full(T, cascade)
    width = f["query_index"].shape[1]
    for b, row in enumerate(f["query_index"]):
        mine = [t for i, t in enumerate(row) if f["token_index"][t] == b * width + i]
        if len(mine) * group > 8:
            mask[mine] = True
    return mask


def assert_close(actual: np.ndarray, desired: np.ndarray, atol: np.ndarray | float, rtol: float) -> None:
    """|actual - desired| <= atol + rtol·|desired| element by element (atol may vary per element)."""
    err = np.abs(actual - desired) - (atol + rtol * np.abs(desired))
    worst = np.unravel_index(np.argmax(err), err.shape)
    assert err.max() <= 0, (f"{int((err > 0).sum())} of {err.size} elements off; worst at {worst}: "
                            f"{actual[worst]} vs {desired[worst]}")


def rounded_q_int16(q: np.ndarray, scale: float) -> np.ndarray:
    """q as the int8-pool decode path scores it: each (token, head) row of q * scale rounded to int16 with its own
    scale (largest |element| -> 32767), in float32 as the kernel does, returned unscaled (float64)."""
    qf = (q * np.float32(scale)).astype(np.float32)
    amax = np.abs(qf).max(axis=-1, keepdims=True)
    safe = np.where(amax > 0, amax, np.float32(1))
    q16 = np.clip(np.rint(qf * (np.float32(32767) / safe)), -32767, 32767)
    return q16 * (safe / np.float32(32767)).astype(np.float64) / scale


def run_kernel(model, f, pools, in_place: bool, token_major: bool, kv_dtype: str = "float32",  # noqa: ANN001, ANN201
               packed: bool = False):
    """Run the node; with ``in_place`` the pool outputs are bound to the input buffers (as the executor does);
    ``packed``: q, k and v fed as one ``qkv`` input (q heads, k heads, v heads per token)."""
    sess = session(model)
    T = f["q"].shape[0]
    feeds = dict(f)
    for name in ("q", "k", "v"):
        feeds[name] = (f[name].reshape(1, T, -1) if token_major else f[name].transpose(1, 0, 2)[None]).copy()
    if packed:
        feeds["qkv"] = np.concatenate([feeds.pop(name) for name in ("q", "k", "v")], axis=-1)

    def value(array: np.ndarray) -> ort.OrtValue:  # numpy has no bfloat16: bind its uint16 bits as bfloat16
        return (ort.OrtValue.ortvalue_from_numpy_with_onnx_type(array, 16) if kv_dtype == "bfloat16"
                else ort.OrtValue.ortvalue_from_numpy(array))

    binding = sess.io_binding()
    binding.bind_output("o")  # first: output 0
    for name, array in feeds.items():
        if name not in ("key_cache", "value_cache"):
            binding.bind_cpu_input(name, np.ascontiguousarray(array))
    outs = []
    for name, out, pool in (("key_cache", "key_cache_out", pools[0]), ("value_cache", "value_cache_out", pools[1])):
        binding.bind_ortvalue_input(name, value(pool))
        target = pool if in_place else np.full_like(pool, 7)  # in place: the pool itself; else another buffer
        binding.bind_ortvalue_output(out, value(target))
        outs.append(target)
    sess.run_with_iobinding(binding)
    o = binding.get_outputs()[0].numpy()
    k_out, v_out = outs
    if not in_place:
        np.testing.assert_array_equal(pools[0], f["key_cache"])  # the inputs are untouched
    o = o.reshape(T, -1, f["q"].shape[2]) if token_major else o[0].transpose(1, 0, 2)
    return o, k_out, v_out


@pytest.mark.parametrize("seqs", [
    [(0, 1)],                                    # first decode
    [(37, 1), (100, 1), (15, 1)],                # decodes crossing blocks
    [(0, 50)],                                   # prefill, several items of 32 tokens
    [(48, 20)],                                  # chunk continuing after cached blocks
    [(30, 40), (70, 1), (5, 1), (0, 3)],         # mixed: chunks + decodes (decode group)
], ids=["decode-first", "decode", "prefill", "chunk", "mixed"])
def test_step_shapes(seqs) -> None:  # noqa: ANN001
    run_case(np.random.default_rng(0), seqs)


@pytest.mark.parametrize("q_heads, kv_heads", [(4, 4), (9, 3), (16, 2)], ids=["group1", "group3", "group8"])
@pytest.mark.parametrize("head_dim", [16, 64, 128, 256])
@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16"])
def test_gqa_and_head_dim(q_heads: int, kv_heads: int, head_dim: int, kv_dtype: str) -> None:
    run_case(np.random.default_rng(1), [(20, 1), (3, 9), (33, 1)], q_heads=q_heads, kv_heads=kv_heads,
             head_dim=head_dim, kv_dtype=kv_dtype)


@pytest.mark.parametrize("block_size", [4, 16, 64, 128])
def test_block_sizes(block_size: int) -> None:
    run_case(np.random.default_rng(2), [(block_size - 1, 3), (2 * block_size + 5, 1), (0, 40)],
             block_size=block_size, num_blocks=max(12, 160 // block_size))


def test_shared_prefix_blocks() -> None:
    run_case(np.random.default_rng(3), [(40, 5), (33, 1), (64, 1)], shared_prefix_blocks=2)


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("q_heads, kv_heads, head_dim", [(9, 3, 64), (16, 2, 128)])
def test_decodes_sharing_a_prefix_attend_it_together(kv_dtype: str, q_heads: int, kv_heads: int,
                                                     head_dim: int) -> None:
    """Cascade (custom_op.cpp plan_cascade): decodes whose tables begin with the same blocks (at least 48 query
    rows per KV head) attend those once, together, then their own blocks from the state that leaves. 20 members
    (60 / 160 rows: one / three cascade items per KV head), one at the first position after the shared blocks;
    beside a prefill chunk on the same prefix; the decodes in the decode group and among the chunk rows."""
    rng = np.random.default_rng(11)
    decodes = [(48 + int(n), 1) for n in rng.integers(1, 60, 19)] + [(48, 1)]
    for split in (True, False):
        run_case(rng, decodes + [(50, 20)], q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
                 shared_prefix_blocks=3, num_blocks=160, kv_dtype=kv_dtype, split_decodes=split)


def test_without_decode_split_and_token_major() -> None:
    rng = np.random.default_rng(4)
    run_case(rng, [(30, 40), (70, 1)], split_decodes=False)
    run_case(rng, [(30, 40), (70, 1)], token_major=True)


def test_unaliased_pools_are_copied_then_written() -> None:
    run_case(np.random.default_rng(5), [(10, 6), (40, 1)], in_place=False)


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "int8"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_reduced_precision_kv(kv_dtype: str, head_dim: int) -> None:
    """bf16 and int8 pools: rows written exactly as the reference encodes them; attention over the pools as stored."""
    rng = np.random.default_rng(10)
    run_case(rng, [(30, 40), (70, 1), (5, 1), (0, 3)], head_dim=head_dim, kv_dtype=kv_dtype)
    run_case(rng, [(20, 6), (33, 1)], head_dim=head_dim, kv_dtype=kv_dtype, in_place=False)


@pytest.mark.parametrize("head_dim, q_heads, kv_heads", [(64, 9, 3), (128, 16, 2), (32, 4, 4), (256, 8, 1)])
def test_int8_decode_scores_are_integer_dots_of_int16_queries(head_dim: int, q_heads: int, kv_heads: int) -> None:
    """int8 pools, decode items: the kernel's scores are exact integer dots of int16-rounded queries with the int8
    keys, scaled — so against a reference given the same rounded queries it agrees to float rounding (2e-5)."""
    rng = np.random.default_rng(11)
    run_case(rng, [(37, 1), (100, 1), (15, 1), (0, 1), (63, 1)], q_heads=q_heads, kv_heads=kv_heads,
             head_dim=head_dim, kv_dtype="int8", round_q_int16=True)
    run_case(rng, [(130, 1), (1, 1)], q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, kv_dtype="int8",
             round_q_int16=True, block_size=64, num_blocks=8)


@pytest.mark.parametrize("seqs, q_heads, kv_heads", [
    ([(37, 5), (100, 8), (3, 2), (63, 1)], 9, 3),   # 15, 24, 6 and 3 rows: speculative verification, short chunks
    ([(37, 3), (70, 2), (0, 3)], 16, 2),            # 8 query heads per KV head: 24 rows at most
])
def test_int8_short_items_take_the_integer_row_path(seqs, q_heads: int, kv_heads: int) -> None:  # noqa: ANN001
    """int8 pools: items of a few tokens (up to 24 query rows per KV head take the integer row path, as decodes do):
    each token sees only the keys up to its own position — against the reference given the same rounded q."""
    rng = np.random.default_rng(12)
    run_case(rng, seqs, q_heads=q_heads, kv_heads=kv_heads, kv_dtype="int8", round_q_int16=True)
    run_case(rng, seqs, q_heads=q_heads, kv_heads=kv_heads, kv_dtype="int8", round_q_int16=True, block_size=64,
             num_blocks=16)


@pytest.mark.parametrize("window", [1, 7, 40])
def test_sliding_window(window: int) -> None:
    run_case(np.random.default_rng(6), [(50, 1), (20, 30), (90, 1)], window=window)


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("packed, rotary", [(True, False), (True, True), (False, True)],
                         ids=["packed", "packed-rotary", "rotary"])
def test_packed_qkv_and_rotary(kv_dtype: str, packed: bool, rotary: bool) -> None:
    """The fused form the lowering emits (passes/packed_qkv.py): the QKV projection as one input and RoPE applied
    in the kernel — the same attention and bit-identical pools as rotating first and passing q, k, v apart."""
    rng = np.random.default_rng(12)
    for q_heads, kv_heads, head_dim in ((9, 3, 64), (16, 2, 128)):
        run_case(rng, [(30, 40), (70, 1), (5, 1), (0, 3)], q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
                 kv_dtype=kv_dtype, packed=packed, rotary=rotary)
    run_case(rng, [(20, 6), (33, 1)], kv_dtype=kv_dtype, packed=packed, rotary=rotary, in_place=False)


@pytest.mark.parametrize("isa", ["avx512", "avx2", "generic"])
def test_slower_isa_paths(isa: str, tmp_path) -> None:  # noqa: ANN001
    """The AVX-512 (without bfloat16 dot products: bfloat16 pools attended in float32 on every path), AVX2 and
    portable paths, forced in a child process (the ISA is fixed when the library loads)."""
    if isa == "avx512" and kernels.status().isa != "avx512bf16":
        pytest.skip("the AVX-512 path is this CPU's own (the other tests run it) or beyond it")
    import subprocess
    import sys

    code = ("import numpy as np, test_kernels as t; from omforge.runtime.ort import kernels; "
            f"assert kernels.status().isa == {isa!r}, kernels.status(); "
            "t.run_case(np.random.default_rng(7), [(30, 40), (70, 1), (5, 1)]); "
            "t.run_case(np.random.default_rng(8), [(3, 9), (33, 1)], q_heads=16, kv_heads=2, head_dim=128, window=5); "
            "t.run_case(np.random.default_rng(9), [(30, 40), (70, 1)], kv_dtype='bfloat16'); "
            "t.run_case(np.random.default_rng(9), [(30, 40), (70, 1)], kv_dtype='int8'); "
            "t.run_case(np.random.default_rng(9), [(37, 1), (70, 1)], kv_dtype='int8', round_q_int16=True); "
            "t.run_case(np.random.default_rng(10), [(48 + i, 1) for i in range(1, 20)] + [(50, 20)], "
            "shared_prefix_blocks=3, num_blocks=160); "  # the cascade: 19 decodes on 3 shared blocks
            "t.check_add_rms_norm((1, 64, 576)); t.check_add_rms_norm((2, 3, 37))")
    import os
    env = {**os.environ, "OMFORGE_KERNELS_ISA": isa}
    tests_dir = str(__import__("pathlib").Path(__file__).parent)
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=tests_dir, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.parametrize("attrs, message", [
    ({"q_heads": 8, "kv_heads": 3}, "q_heads must be a positive multiple of kv_heads"),
    ({"block_size": 0}, "block_size must be positive"),
    ({"window": -1}, "window must be >= 0"),
])
def test_bad_attribute_is_an_ort_error(attrs: dict, message: str) -> None:
    model = kernel_model(q_heads=9, kv_heads=3, head_dim=64, block_size=16, scale=0.125, attrs=attrs)
    with pytest.raises(Exception, match=message):
        session(model)


def test_window_attribute_is_optional() -> None:
    """A node without ``window`` (its lookup fails and the status is released) attends over the whole context."""
    model = kernel_model(q_heads=9, kv_heads=3, head_dim=64, block_size=16, scale=0.125)
    del model.graph.node[0].attribute[[a.name for a in model.graph.node[0].attribute].index("window")]
    rng = np.random.default_rng(11)
    step = make_step(rng, [(40, 1), (0, 5)], 16, 8)
    f = {k: step[k] for k in ("slot_mapping", "block_tables", "query_index", "token_index", "position_ids",
                              "decode_block_tables", "decode_query_index")}
    T = step["input_ids"].shape[1]
    f.update(q=rng.standard_normal((T, 9, 64), dtype=np.float32), k=rng.standard_normal((T, 3, 64), dtype=np.float32),
             v=rng.standard_normal((T, 3, 64), dtype=np.float32))
    pools = [rng.standard_normal((128, 3, 64), dtype=np.float32) for _ in range(2)]
    f["key_cache"], f["value_cache"] = (p.copy() for p in pools)
    want, _, _ = paged_attention_reference(f, q_heads=9, kv_heads=3, block_size=16, scale=0.125)
    o, _, _ = run_kernel(model, f, pools, in_place=True, token_major=False)
    np.testing.assert_allclose(o, want, atol=2e-5, rtol=1e-4)


def test_bad_inputs_are_ort_errors() -> None:
    rng = np.random.default_rng(9)
    step = make_step(rng, [(5, 3)], 16, 4)
    model = kernel_model(q_heads=9, kv_heads=3, head_dim=64, block_size=16, scale=0.125)
    sess = session(model)
    feeds = {k: step[k] for k in ("slot_mapping", "block_tables", "query_index", "token_index", "position_ids",
                                  "decode_block_tables", "decode_query_index")}
    feeds.update(q=np.zeros((1, 9, 3, 64), np.float32), k=np.zeros((1, 3, 3, 64), np.float32),
                 v=np.zeros((1, 3, 3, 64), np.float32), key_cache=np.zeros((64, 3, 64), np.float32),
                 value_cache=np.zeros((64, 3, 64), np.float32))
    sess.run(None, feeds)  # well-formed
    with pytest.raises(Exception, match="slot outside the pool"):
        sess.run(None, {**feeds, "slot_mapping": feeds["slot_mapping"] + 1000})
    with pytest.raises(Exception, match="block id out of range"):
        sess.run(None, {**feeds, "block_tables": feeds["block_tables"] + 50})
    with pytest.raises(Exception, match="head_dim must be one of"):
        bad = kernel_model(q_heads=9, kv_heads=3, head_dim=48, block_size=16, scale=0.125)
        session(bad).run(None, {**feeds, "q": np.zeros((1, 9, 3, 48), np.float32),
                                "k": np.zeros((1, 3, 3, 48), np.float32), "v": np.zeros((1, 3, 3, 48), np.float32),
                                "key_cache": np.zeros((64, 3, 48), np.float32),
                                "value_cache": np.zeros((64, 3, 48), np.float32)})


def test_packed_and_rotary_input_errors() -> None:
    rng = np.random.default_rng(9)
    step = make_step(rng, [(5, 3)], 16, 4)
    f = {k: step[k] for k in ("slot_mapping", "block_tables", "query_index", "token_index", "position_ids",
                              "decode_block_tables", "decode_query_index")}
    f.update(key_cache=np.zeros((64, 3, 64), np.float32), value_cache=np.zeros((64, 3, 64), np.float32),
             cos_cache=np.ones((1, 3, 32), np.float32), sin_cache=np.zeros((1, 3, 32), np.float32),
             qkv=np.zeros((1, 3, 15 * 64), np.float32))
    packed = kernel_model(q_heads=9, kv_heads=3, head_dim=64, block_size=16, scale=0.125, packed=True, rotary=True)
    for value in packed.graph.input:  # widths left open, so that the kernel is the one to check them
        if value.name in ("qkv", "cos_cache", "sin_cache"):
            value.type.tensor_type.shape.dim[2].dim_param = "W"
    sess = session(packed)
    sess.run(None, f)  # well-formed
    with pytest.raises(Exception, match=r"a packed q must be \[1, T, \(q_heads \+ 2\*kv_heads\)\*D\]"):
        sess.run(None, {**f, "qkv": np.zeros((1, 3, 14 * 64), np.float32)})
    with pytest.raises(Exception, match="cos_cache and sin_cache must be float32"):
        half = np.ones((1, 3, 16), np.float32)
        sess.run(None, {**f, "cos_cache": half, "sin_cache": half})
    model = kernel_model(q_heads=9, kv_heads=3, head_dim=64, block_size=16, scale=0.125, token_major=True)
    model.graph.node[0].input[2] = ""  # v omitted, k given
    del model.graph.input[2]
    feeds = {**f, "q": np.zeros((1, 3, 9 * 64), np.float32), "k": np.zeros((1, 3, 3 * 64), np.float32)}
    with pytest.raises(Exception, match="k and v must be given together"):
        session(model).run(None, {k: feeds[k] for k in ("q", "k", *INPUTS[3:])})


def test_status_reports_the_isa() -> None:
    s = kernels.status()
    assert s.abi == kernels.ABI_VERSION and s.isa in ("avx512bf16", "avx512", "avx2", "generic")
    assert s.manifest_entry().domain == kernels.DOMAIN


@pytest.mark.parametrize("shape", [(1, 7, 64), (1, 300, 3072), (2, 5, 10)])
def test_swiglu(shape: tuple[int, ...]) -> None:
    from onnx import TensorProto, helper

    node = helper.make_node("SwiGLU", ["x"], ["y"], domain=kernels.DOMAIN)
    graph = helper.make_graph([node], "swiglu", [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                    helper.make_opsetid(kernels.DOMAIN, 1)],
                              ir_version=9)
    x = np.random.default_rng(0).standard_normal(shape, dtype=np.float32) * 6
    x.flat[:4] = [100.0, -100.0, 0.0, -0.0]  # saturated and zero gates
    (y,) = session(model).run(None, {"x": x})
    g, u = x[..., : shape[-1] // 2].astype(np.float64), x[..., shape[-1] // 2:].astype(np.float64)
    np.testing.assert_allclose(y, g / (1 + np.exp(-g)) * u, rtol=2e-6, atol=1e-6)
    with pytest.raises(Exception, match="even last dimension"):
        session(model).run(None, {"x": x[..., :-1].copy()})


def add_rms_norm_model(epsilon: float = 1e-5):  # noqa: ANN201
    from onnx import TensorProto, helper

    node = helper.make_node("AddRMSNorm", ["a", "b", "w"], ["y", "s"], domain=kernels.DOMAIN, epsilon=epsilon)
    graph = helper.make_graph([node], "add_rms_norm",
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("a", "b", "w")],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("y", "s")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(kernels.DOMAIN, 1)],
                             ir_version=9)


@pytest.mark.parametrize("shape", [(1, 1, 576), (1, 64, 576), (2, 3, 37), (1, 512, 960)])
def test_add_rms_norm(shape: tuple[int, ...]) -> None:
    """AddRMSNorm: the residual sum exactly as float32 adds it, the RMSNorm of it against float64 (the slower ISA
    paths: test_slower_isa_paths)."""
    check_add_rms_norm(shape)


def check_add_rms_norm(shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal(shape, dtype=np.float32) * 3 for _ in range(2))
    w = rng.standard_normal(shape[-1], dtype=np.float32)
    y, s = session(add_rms_norm_model(1e-5)).run(None, {"a": a, "b": b, "w": w})
    np.testing.assert_array_equal(s, a + b)
    total = (a + b).astype(np.float64)
    want = total / np.sqrt((total ** 2).mean(-1, keepdims=True) + 1e-5) * w
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)


def test_add_rms_norm_errors() -> None:
    a = np.ones((2, 8), np.float32)
    with pytest.raises(Exception, match="one shape"):
        session(add_rms_norm_model()).run(None, {"a": a, "b": a[:1].copy(), "w": np.ones(8, np.float32)})
    with pytest.raises(Exception, match=r"weight must be \[H\]"):
        session(add_rms_norm_model()).run(None, {"a": a, "b": a, "w": np.ones(4, np.float32)})
