"""The kernel library's mixture-of-experts ops (runtime/ort/kernels/moe.h), a neutral ``omforge.MoE`` node lowered by
passes/moe_kernel.py and run by onnxruntime, against a float64 numpy reference of the contract (softmax in float32,
top-k with ties to the lower expert, optional renormalization, SwiGLU experts; each GEMM's activations rounded as its
precision's MatMul op rounds them; int8 / int4 against the dequantized weights): every precision, top_k 1, 2 and 8,
normalize 0 / 1, 1, 5 and 300 tokens, ragged expert loads (one expert with every token, one with none), partial
panels and blocks, GGUF blocks as they are, the layout read back, errors, every ISA path the CPU has (forced in child
processes) — and the reference itself against transformers' Qwen3-MoE block and ORT's own com.microsoft.MoE."""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest

from kernel_reference import from_bf16, kernel_session, matmul_q_reference, to_bf16
from omforge.contract.kernel_abi import WEIGHT_LAYOUT
from omforge.passes import gemm_pack, moe_kernel, quant
from omforge.runtime.ort import kernels

pytestmark = pytest.mark.skipif(not kernels.status().available, reason=f"kernel library: {kernels.status().reason}")

PRECISIONS = ("float32", "bfloat16", "int8", "int4")
H, F, E = 80, 40, 8  # H off whole blocks of 32 and panels of 16 pairs; F off panels (Fp 48: interleave padding)
EXPERTS = "model.layers.0.mlp.experts"  # the experts' torch name (GGUF blocks are found by it)
ALWAYS, NEVER = 3, 5  # the ragged loads: expert 3 in every token's top k, expert 5 in none
# max |y − reference| / max |reference|: float32 sums; bfloat16 and int8 activations as the kernel rounds them (the
# SwiGLU outputs, float32 there and float64 here, rarely round apart by one step)
TOLERANCE = {"float32": 2e-6, "bfloat16": 2e-3, "int8": 2e-3, "int4": 2e-3}


def neutral_weights(seed: int, e: int = E, h: int = H, f: int = F) -> tuple[np.ndarray, np.ndarray]:
    """``gate_up_weight [E, H, 2F]`` and ``down_weight [E, F, H]`` (MatMul layout), random."""
    rng = np.random.default_rng(seed)
    gate_up = (rng.standard_normal((e, h, 2 * f)) / np.sqrt(h)).astype(np.float32)
    down = (rng.standard_normal((e, f, h)) / np.sqrt(f)).astype(np.float32)
    return gate_up, down


def lowered_model(gate_up: np.ndarray, down: np.ndarray, precision: str, top_k: int, normalize: int,
                  **options: object) -> ir.Model:
    """One neutral ``omforge.MoE`` node over x ``[..., H]`` lowered by :func:`moe_kernel.lower_moe_to_kernel`."""
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT))  # no shapes: the kernel checks them
    logits = ir.Value(name="router_logits", type=ir.TensorType(ir.DataType.FLOAT))
    names = [f"{EXPERTS}.gate_up_proj.weight.T", f"{EXPERTS}.down_proj.weight.T"]  # as passes/moe.py names them
    weights = [ir.Value(name=n, const_value=ir.tensor(a, name=n)) for n, a in zip(names, (gate_up, down), strict=True)]
    node = ir.node("MoE", [x, logits, *weights], domain="omforge", attributes={"top_k": top_k, "normalize": normalize},
                   name="moe")
    node.outputs[0].name = "y"
    graph = ir.Graph([x, logits], node.outputs, nodes=[node], initializers=weights,
                     opset_imports={"": 17, "omforge": 1, kernels.DOMAIN: 1}, name="moe")
    kernel = moe_kernel.lower_moe_to_kernel(graph, node, precision, **options)
    assert [n.op_type for n in graph] == [kernel.op_type] == [moe_kernel.MOE_OPS[precision]]
    assert not set(names) & set(graph.initializers)  # the float weights dropped: only the packed ones are kept
    graph.outputs[0].type = ir.TensorType(ir.DataType.FLOAT)
    return ir.Model(graph, ir_version=10)


@functools.cache
def session(precision: str, top_k: int, normalize: int, seed: int = 0, group_size: int = 32, symmetric: bool = True):  # noqa: ANN201
    gate_up, down = neutral_weights(seed)
    model = lowered_model(gate_up, down, precision, top_k, normalize, group_size=group_size, symmetric=symmetric)
    return kernel_session(ir.serde.serialize_model(model))


def route(logits: np.ndarray, top_k: int, normalize: int) -> tuple[np.ndarray, np.ndarray]:
    """The contract's routing: softmax in float32, the top k by p (ties: the lower expert first), p as the weights,
    divided by their sum when ``normalize``."""
    z = np.exp(logits - logits.max(-1, keepdims=True), dtype=np.float32)
    p = z / z.sum(-1, keepdims=True, dtype=np.float32)
    index = np.argsort(-p, axis=-1, kind="stable")[:, :top_k]
    w = np.take_along_axis(p, index, -1).astype(np.float64)
    if normalize:
        w /= w.sum(-1, keepdims=True)
    return index, w


def silu_glu(gu: np.ndarray) -> np.ndarray:
    g, u = np.split(gu.astype(np.float64), 2, axis=-1)
    return g / (1 + np.exp(-g)) * u


@functools.cache
def quantized_experts(seed: int, bits: int, group_size: int, symmetric: bool) -> list[tuple[quant.Packed, ...]]:
    """Each expert's gate_up ``[2F, H]`` and down ``[H, F]`` quantized as torch-layout rows, independently of the
    kernel layout's interleaving and padding (round to nearest is per row along K, so it is the same)."""
    gate_up, down = neutral_weights(seed)
    return [(quant.quantize(gate_up[e].T, bits, group_size, symmetric), quant.quantize(down[e].T, bits, group_size,
                                                                                      symmetric)) for e in range(E)]


def expert_reference(precision: str, x: np.ndarray, e: int, gate_up: np.ndarray, down: np.ndarray,
                     packed: list[tuple[quant.Packed, ...]] | None) -> np.ndarray:
    """Expert e on the rows x (float32), float64, each GEMM's activations as the precision's MatMul op takes them."""
    if precision == "float32":
        return silu_glu(x.astype(np.float64) @ gate_up[e]) @ down[e].astype(np.float64)
    if precision == "bfloat16":
        def bf(a: np.ndarray) -> np.ndarray:
            return from_bf16(to_bf16(np.asarray(a, np.float32))).astype(np.float64)
        return bf(silu_glu(bf(x) @ bf(gate_up[e]))) @ bf(down[e])
    p1, p2 = packed[e]
    return matmul_q_reference(silu_glu(matmul_q_reference(x, p1)).astype(np.float32), p2)


def reference(precision: str, x: np.ndarray, logits: np.ndarray, top_k: int, normalize: int, seed: int = 0,
              group_size: int = 32, symmetric: bool = True) -> np.ndarray:
    gate_up, down = neutral_weights(seed)
    packed = None
    if precision in ("int8", "int4"):
        packed = quantized_experts(seed, 8 if precision == "int8" else 4, group_size, symmetric)
    index, w = route(logits, top_k, normalize)
    y = np.zeros(x.shape, np.float64)
    for e in np.unique(index):
        tokens, slot = np.nonzero(index == e)
        y[tokens] += w[tokens, slot][:, None] * expert_reference(precision, x[tokens], e, gate_up, down, packed)
    return y


def inputs(seed: int, tokens: int, ragged: bool = True) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, H)).astype(np.float32)
    logits = (2 * rng.standard_normal((tokens, E))).astype(np.float32)
    if ragged:
        logits[:, ALWAYS] += 30
        logits[:, NEVER] -= 30
    return x, logits


def check(precision: str, tokens: int, top_k: int, normalize: int, seed: int = 0, **options: object) -> None:
    x, logits = inputs(seed + tokens, tokens)
    s = session(precision, top_k, normalize, seed, **options)
    y = s.run(None, {"x": x[None], "router_logits": logits[None]})[0]
    ref = reference(precision, x, logits, top_k, normalize, seed, **options)
    index, _ = route(logits, top_k, normalize)
    assert (index == ALWAYS).any(-1).all() and (top_k == E or not (index == NEVER).any())  # the loads are ragged
    assert y.shape == (1, tokens, H) and y.dtype == np.float32
    err = np.abs(y[0] - ref).max() / np.abs(ref).max()
    assert err <= TOLERANCE[precision], (precision, tokens, top_k, normalize, err)


@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_against_the_reference(precision: str, top_k: int) -> None:
    """One token (decode), five, and a 300-token prefill (an expert with every token: 19 row tiles of 16), each with
    and without renormalization; top_k 8 is every expert (NEVER then has every token too)."""
    for tokens in (1, 5, 300):
        for normalize in (0, 1):
            check(precision, tokens, top_k, normalize)


@pytest.mark.parametrize(("precision", "group_size", "symmetric"), [("int4", 64, False), ("int8", 128, False),
                                                                     ("int4", 128, True)])
def test_other_blocks_and_affine_weights(precision: str, group_size: int, symmetric: bool) -> None:
    for tokens in (1, 37):
        check(precision, tokens, 2, 1, seed=1, group_size=group_size, symmetric=symmetric)


def test_ties_go_to_the_lower_expert() -> None:
    """Equal logits: every p is 1/E, and the experts 0 … k−1 are chosen, each with weight 1/E."""
    x = np.random.default_rng(2).standard_normal((3, H)).astype(np.float32)
    logits = np.zeros((3, E), np.float32)
    y = session("float32", 2, 0).run(None, {"x": x[None], "router_logits": logits[None]})[0][0]
    gate_up, down = neutral_weights(0)
    want = sum(expert_reference("float32", x, e, gate_up, down, None) for e in (0, 1)) / E
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)


def test_the_layout_reads_back() -> None:
    """Each expert's packed panels, read back with gemm_pack's readers and un-interleaved, are its weights."""
    gate_up, down = neutral_weights(3, e=2, h=33, f=20)  # Fp 32: one padded panel pair; odd H
    index = moe_kernel.interleave_index(20)
    fp = moe_kernel.padded_inter(20)
    for precision in ("float32", "bfloat16", "int4"):
        p = moe_kernel.pack_experts(gate_up, down, precision, 2, True)
        arrays = dict(p.inputs)
        for e in range(2):
            if precision == "float32":
                w1 = gemm_pack.unpack_f32(arrays["gate_up"][e], 2 * fp, 33)
                w2 = gemm_pack.unpack_f32(arrays["down"][e], 33, fp)
                want1, want2 = gate_up[e].T, down[e].T
            elif precision == "bfloat16":
                w1 = gemm_pack.unpack_bf16(arrays["gate_up"][e].view(np.uint16), 2 * fp, 33)
                w2 = gemm_pack.unpack_bf16(arrays["down"][e].view(np.uint16), 33, fp)
                want1, want2 = from_bf16(to_bf16(gate_up[e].T)), from_bf16(to_bf16(down[e].T))
            else:
                unpack = [gemm_pack.unpack(gemm_pack.PanelWeights(4, 32, n, k, arrays[f"{t}.codes"][e],
                                                                  arrays[f"{t}.scales"][e], None))
                          for t, n, k in (("gate_up", 2 * fp, 33), ("down", 33, fp))]
                w1, w2 = unpack
                want1 = quant.dequantize(quant.quantize(gate_up[e].T, 4, 32))
                want2 = quant.dequantize(quant.quantize(down[e].T, 4, 32))
            assert np.array_equal(w1[index >= 0], want1[index[index >= 0]]), precision
            assert not w1[index < 0].any() and not w2[:, 20:].any()
            assert np.array_equal(w2[:, :20], want2), precision
        assert p.attributes["layout"] == WEIGHT_LAYOUT


def test_gguf_blocks_as_they_are() -> None:
    """Q4_0 gate and up, Q8_0 down (two widths in one node): the blocks' values exactly, not a re-quantization."""
    from test_matmul_q import _gguf_rows

    rng = np.random.default_rng(4)
    e, h, f = 4, 64, 32
    prefix = EXPERTS
    blocks, gate_up, down = {}, np.zeros((e, h, 2 * f), np.float32), np.zeros((e, f, h), np.float32)
    for i in range(e):
        for name, kind, n, k in (("gate_proj", "Q4_0", f, h), ("up_proj", "Q4_0", f, h), ("down_proj", "Q8_0", h, f)):
            blocks[f"{prefix}.{i}.{name}.weight"] = (kind, _gguf_rows(kind, n, k, rng), k)
        p1 = quant.concat_rows([quant.from_gguf(*blocks[f"{prefix}.{i}.{n}.weight"]) for n in ("gate_proj", "up_proj")])
        p2 = quant.from_gguf(*blocks[f"{prefix}.{i}.down_proj.weight"])
        gate_up[i], down[i] = quant.dequantize(p1).T, quant.dequantize(p2).T
    packed = moe_kernel.pack_experts(gate_up, down, "int4", 2, True, blocks=blocks, prefix=prefix)
    assert {k: packed.attributes[k] for k in ("bits", "down_bits", "block_size", "down_block_size")} == {
        "bits": 4, "down_bits": 8, "block_size": 32, "down_block_size": 32}
    assert packed.report == {"gate_up": "gguf Q4_0", "down": "gguf Q8_0"}
    model = lowered_model(gate_up, down, "int4", 2, 1, blocks=blocks)  # the prefix from the weights' names
    x = rng.standard_normal((9, h)).astype(np.float32)
    logits = rng.standard_normal((9, e)).astype(np.float32)
    y = kernel_session(ir.serde.serialize_model(model)).run(None, {"x": x[None], "router_logits": logits[None]})[0][0]
    index, w = route(logits, 2, 1)
    ref = np.zeros((9, h))
    def gguf(i: int, *names: str) -> quant.Packed:
        return quant.concat_rows([quant.from_gguf(*blocks[f"{prefix}.{i}.{n}.weight"]) for n in names])

    for t in range(9):
        for j, i in enumerate(index[t]):
            hidden = silu_glu(matmul_q_reference(x[t:t + 1], gguf(i, "gate_proj", "up_proj"))).astype(np.float32)
            ref[t] += w[t, j] * matmul_q_reference(hidden, gguf(i, "down_proj"))[0]
    assert np.abs(y - ref).max() <= 2e-3 * np.abs(ref).max()
    bad = {**blocks, f"{prefix}.1.up_proj.weight": ("Q4_0", _gguf_rows("Q4_0", f, h, rng), h)}
    with pytest.raises(RuntimeError, match=r"experts\.1: the GGUF blocks of gate_proj, up_proj do not hold"):
        moe_kernel.pack_experts(gate_up, down, "int4", 2, True, blocks=bad, prefix=prefix)


def test_the_reference_is_transformers_qwen3_moe_block() -> None:
    """A tiny random Qwen3-MoE sparse block (transformers) on 7 tokens, with and without norm_topk_prob: the float32
    kernel (router logits from its gate) gives its output, and so does the float64 reference."""
    torch = pytest.importorskip("torch")
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    torch.manual_seed(0)
    for norm in (False, True):
        cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=F, num_experts=E, num_experts_per_tok=2,
                             norm_topk_prob=norm, hidden_act="silu")
        block = Qwen3MoeSparseMoeBlock(cfg).eval()
        with torch.no_grad():
            for p in block.parameters():
                p.normal_(0, 0.2)
            x = torch.randn(1, 7, H)
            want = block(x)[0].numpy()
        gate_up = np.ascontiguousarray(block.experts.gate_up_proj.detach().numpy().transpose(0, 2, 1))
        down = np.ascontiguousarray(block.experts.down_proj.detach().numpy().transpose(0, 2, 1))
        logits = (x[0].numpy() @ block.gate.weight.detach().numpy().T).astype(np.float32)
        model = lowered_model(gate_up, down, "float32", 2, int(norm))
        y = kernel_session(ir.serde.serialize_model(model)).run(None, {"x": x.numpy(), "router_logits": logits[None]})
        np.testing.assert_allclose(y[0][0], want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
        index, w = route(logits, 2, int(norm))
        ref = sum(w[t, j] * expert_reference("float32", x[0, t:t + 1].numpy(), index[t, j], gate_up, down, None)[0]
                  * np.eye(7)[t][:, None] for t in range(7) for j in range(2))
        np.testing.assert_allclose(ref, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())


def bench_moe():  # noqa: ANN201 - the module
    spec = importlib.util.spec_from_file_location("bench_moe", Path(__file__).parent.parent / "benchmarks/bench_moe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_onnxruntimes_moe_op_agrees_with_the_reference() -> None:
    """ORT's com.microsoft.MoE as benchmarks/bench_moe.py builds it (SwiGLU of gate and up interleaved per column,
    alpha 1, beta 0; softmax, top k): the same outputs as the contract's reference, so the benchmark compares the same
    block. Its normalize_routing_weights 1 and 0."""
    import onnxruntime as ort

    bench = bench_moe()
    gate_up, down = neutral_weights(0)
    x, logits = inputs(5, 23, ragged=False)
    for top_k, normalize in ((2, 1), (8, 0)):
        node, weights, _ = bench.ort_parts(gate_up, down, top_k)
        next(a for a in node.attribute if a.name == "normalize_routing_weights").i = normalize
        model = bench.model_of(node, weights, "com.microsoft")
        s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        y = s.run(None, {"x": x, "router_logits": logits})[0]
        ref = reference("float32", x, logits, top_k, normalize)
        assert np.abs(y - ref).max() <= 1e-5 * np.abs(ref).max()
        node, weights, _ = bench.kernel_parts(gate_up, down, "int4", top_k)  # the benchmark's kernel model runs too
        y = kernel_session(bench.model_of(node, weights, kernels.DOMAIN)).run(None, {"x": x, "router_logits": logits})
        ref = reference("int4", x, logits, top_k, 1)
        assert np.abs(y[0] - ref).max() <= TOLERANCE["int4"] * np.abs(ref).max()


@pytest.mark.parametrize(("feeds", "message"), [
    ({"router_logits": np.zeros((1, 4, E + 1), np.float32)}, None),  # another E: the weights' check names it
    ({"router_logits": np.zeros((1, 3, E), np.float32)}, r"router_logits must be float32 \[\.\.\., E\] with x's"),
    ({"x": np.zeros((1, 4, H + 1), np.float32)}, rf"x must be float32 \[\.\.\., {H}\], got \[1, 4, {H + 1}\]"),
])
def test_errors_name_what_is_wrong(feeds: dict, message: str | None) -> None:
    base = {"x": np.zeros((1, 4, H), np.float32), "router_logits": np.zeros((1, 4, E), np.float32)}
    s = session("int4", 2, 1)
    s.run(None, base)
    with pytest.raises(Exception, match="MoEQ: " + (message or r"gate_up_codes must be uint8 \[9, 6, 3, 256\]")):
        s.run(None, {**base, **feeds})


def test_top_k_beyond_the_experts_is_refused() -> None:
    gate_up, down = neutral_weights(0, e=2)
    with pytest.raises(ValueError, match=r"top_k must be in 1 … 2 \(the experts\), got 3"):
        moe_kernel.pack_experts(gate_up, down, "float32", 3, True)
    with pytest.raises(ValueError, match="precision must be one of"):
        moe_kernel.pack_experts(gate_up, down, "fp8", 1, True)


def run_isa_cases() -> None:
    """The cases a child process on a forced ISA path runs (the paths are fixed when the library loads)."""
    for precision in PRECISIONS:
        for tokens, top_k in ((1, 8), (37, 2)):
            check(precision, tokens, top_k, 1)


def test_forced_isa_paths() -> None:
    """Each slower path of the GEMMs the op runs (MatMulF32's, MatMulBF16's and MatMulQ's tables, the SwiGLU op's),
    forced in child processes (a path is fixed when the library loads), run side by side: avx512 (bf16 avx512bf16, int8
    avx512vnni), avxvnni (f32 MoEF32's avx2, bf16 avx2, int8 avxvnni), avx2 (int8 avx2), generic (all portable) —
    where the CPU has them (each table falls back to a path it has). The fastest paths ran the tests above."""
    code = ("import test_moe_kernel as t; from omforge.runtime.ort import kernels; s = kernels.status(); "
            "print(s.moe_f32, s.bf16, s.gemm); t.run_isa_cases()")
    children = {isa: subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "OMFORGE_KERNELS_ISA": isa},
                                      cwd=Path(__file__).parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True) for isa in ("avx512", "avxvnni", "avx2", "generic")}
    for isa, child in children.items():
        out, err = child.communicate(timeout=300)
        assert child.returncode == 0, (isa, out, err[-3000:])
