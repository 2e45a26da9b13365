"""The kernel library's mixture-of-experts op (MoEF32 / MoEBF16 / MoEQ, runtime/ort/kernels/moe.h) at one MoE layer
of Qwen3-30B-A3B's shape (hidden 2048, expert intermediate 768, 128 experts, top 8, renormalized), random weights,
against ONNX Runtime's own ``com.microsoft.MoE`` CPU op (float32 weights: its CPU kernel takes float32 and float16
only) and against the bytes-read bound: the packed bytes of the experts a call touches ÷ the machine's read bandwidth.

  .venv/bin/python benchmarks/bench_moe.py [--tokens 1 16 512] [--precisions float32 bfloat16 int8 int4]
      [--threads 2] [--reps 20] [--layers N] [--bandwidth GB/s] [--no-ort] [--work /tmp/bench-moe] [--out FILE]
  smoke check (seconds): --hidden 256 --inter 96 --experts 8 --top-k 2 --tokens 1 5 --reps 2

Per row: median and best ms per layer (a call's time ÷ its layers) over ``--reps`` timed calls after two warm-up
calls. A model chains ``--layers`` MoE layers, each with its own copy of the weights — by default enough that they
exceed three times the last-level cache (this VM reports 300 MiB of L3, which holds a whole int4 layer), so each
layer's experts come from memory, as in a 48-layer model — and the calls cycle through 8 inputs with other random router
logits (each call another set of experts; T 16 touches ~80 of 128). Columns: the experts touched (mean over the
inputs), GFLOP/s of the expert GEMMs (2·T·k·3·H·F), the bytes-read bound per layer (the touched experts' packed bytes
÷ the read bandwidth) and the share of it reached (bound ÷ measured; 100 % is the bandwidth limit). ``--bandwidth``:
GB/s instead of measuring it (benchmarks/harness/machine_limits.py's read bandwidth: numpy sums over ``--threads``
threads, 1 GiB — a floor; benchmarks/bench_stream_gemv.cpp measures a streaming GEMV's). Models are written with
external data under ``--work`` and removed after use.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from omforge.passes import moe_kernel
from omforge.runtime.ort import kernels

REPO = Path(__file__).resolve().parent.parent
ROUTINGS = 8  # inputs cycled through call after call: each call's experts another set (a layer's in a decode)


def read_bandwidth(threads: int) -> float:
    """GB/s of a 1 GiB read over ``threads`` threads (machine_limits.py's measure)."""
    spec = importlib.util.spec_from_file_location("machine_limits", REPO / "benchmarks/harness/machine_limits.py")
    limits = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(limits)
    return limits.read_bw(1 << 30, threads)


def neutral_weights(e: int, h: int, f: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``gate_up_weight [E, H, 2F]``, ``down_weight [E, F, H]`` (MatMul layout), float32 normals scaled by 1/√K."""
    rng = np.random.default_rng(seed)
    gate_up = rng.standard_normal((e, h, 2 * f), dtype=np.float32)
    gate_up *= np.float32(1 / np.sqrt(h))
    down = rng.standard_normal((e, f, h), dtype=np.float32)
    down *= np.float32(1 / np.sqrt(f))
    return gate_up, down


def model_of(node: onnx.NodeProto, weights: list[tuple[str, np.ndarray]], domain: str) -> onnx.ModelProto:
    """A one-node model over x ``[T, H]`` and router_logits ``[T, E]`` with ``weights`` as initializers."""
    graph = helper.make_graph([node], node.op_type, [helper.make_tensor_value_info("x", TensorProto.FLOAT, None),
                                                     helper.make_tensor_value_info("router_logits", TensorProto.FLOAT,
                                                                                   None)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(a, n) for n, a in weights])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(domain, 1)])


def kernel_parts(gate_up: np.ndarray, down: np.ndarray, precision: str,
                 top_k: int) -> tuple[onnx.NodeProto, list[tuple[str, np.ndarray]], int]:
    """The kernel op's node for ``precision``, its packed weights and one expert's packed bytes."""
    p = moe_kernel.pack_experts(gate_up, down, precision, top_k, True)
    names, weights = [], []
    for suffix, array in p.inputs:  # bfloat16 panels as uint16 (the same bits; the op takes either)
        names.append("" if array is None else f"w.{suffix}")
        if array is not None:
            weights.append((names[-1], array.view(np.uint16) if array.dtype == ml_dtypes.bfloat16 else array))
    while names and not names[-1]:  # trailing optional inputs left out
        names.pop()
    node = helper.make_node(p.op, ["x", "router_logits", *names], ["y"], domain=kernels.DOMAIN, **p.attributes)
    return node, weights, p.nbytes // gate_up.shape[0]


def ort_parts(gate_up: np.ndarray, down: np.ndarray,
              top_k: int) -> tuple[onnx.NodeProto, list[tuple[str, np.ndarray]], int]:
    """ORT's ``com.microsoft.MoE`` for the same block: SwiGLU, fc1 ``[E, 2F, H]`` with gate and up interleaved per
    column (swiglu_fusion 1: row 2i gate i, row 2i + 1 up i), fc2 ``[E, H, F]``, activation_alpha 1 and beta 0
    (silu(g) · u), normalize_routing_weights 1 (tests/test_moe_kernel.py checks it against the contract's reference);
    its weights and one expert's bytes."""
    e, h, f2 = gate_up.shape
    fc1 = np.empty((e, f2, h), np.float32)
    fc1[:, 0::2] = gate_up[:, :, :f2 // 2].transpose(0, 2, 1)
    fc1[:, 1::2] = gate_up[:, :, f2 // 2:].transpose(0, 2, 1)
    fc2 = np.ascontiguousarray(down.transpose(0, 2, 1))
    node = helper.make_node("MoE", ["x", "router_logits", "fc1", "", "fc2"], ["y"], domain="com.microsoft", k=top_k,
                            activation_type="swiglu", swiglu_fusion=1, activation_alpha=1.0, activation_beta=0.0,
                            normalize_routing_weights=1)
    return node, [("fc1", fc1), ("fc2", fc2)], (fc1.nbytes + fc2.nbytes) // e


def save(node: onnx.NodeProto, weights: list[tuple[str, np.ndarray]], layers: int, path: Path) -> None:
    """``layers`` copies of ``node`` in a chain (x → y₁ → … → y, one router_logits for all), each with its own copy of
    ``weights`` (so no layer finds another's in the caches, as in a model), at ``path``: each weight written straight
    into ``<path>.data`` (4 KiB-aligned, never copied in memory: a float32 layer is 2.4 GB, beyond protobuf's 2 GB)
    and referenced as external data."""
    model = model_of(node, [], node.domain)
    del model.graph.node[:]
    with open(path.with_name(path.name + ".data"), "wb") as f:
        for layer in range(layers):
            names = {n: f"l{layer}.{n}" for n, _ in weights}
            chained = onnx.NodeProto()
            chained.CopyFrom(node)
            chained.name = f"moe{layer}"
            chained.input[:] = ["x" if layer == 0 else f"y{layer - 1}", "router_logits",
                                *[names.get(i, i) for i in node.input[2:]]]
            chained.output[:] = ["y" if layer == layers - 1 else f"y{layer}"]
            model.graph.node.append(chained)
            for name, array in weights:
                f.write(b"\0" * (-f.tell() % 4096))
                offset = f.tell()
                np.ascontiguousarray(array).tofile(f)
                tensor = TensorProto(name=names[name], data_type=helper.np_dtype_to_tensor_dtype(array.dtype),
                                     dims=array.shape, data_location=TensorProto.EXTERNAL)
                for key, value in (("location", path.name + ".data"), ("offset", offset), ("length", array.nbytes)):
                    entry = tensor.external_data.add()
                    entry.key, entry.value = key, str(value)
                model.graph.initializer.append(tensor)
    onnx.save_model(model, path)


def session(path: Path, threads: int, library: bool) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    if library:
        kernels.register(options)
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def time_calls(s: ort.InferenceSession, feeds: list[dict[str, np.ndarray]], reps: int) -> tuple[float, float]:
    """(median, best) ms per call over ``reps`` calls after two warm-up calls, call i on ``feeds[i % len(feeds)]``."""
    for i in range(2):
        s.run(None, feeds[-1 - i])
    times = []
    for i in range(reps):
        t = time.perf_counter()
        s.run(None, feeds[i % len(feeds)])
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times), min(times)


def llc_bytes() -> int:
    """The last-level cache's size (Linux sysfs; 32 MiB when unknown)."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1], 1)
        sizes.append(int(text.rstrip("KMG")) * unit)
    return max(sizes, default=32 << 20)


def touched(logits: np.ndarray, top_k: int) -> int:
    """Distinct experts in the tokens' top k (softmax is monotonic: the top logits)."""
    return len(np.unique(np.argsort(-logits, axis=-1, kind="stable")[:, :top_k]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 512])
    ap.add_argument("--precisions", nargs="+", default=list(moe_kernel.PRECISIONS), choices=moe_kernel.PRECISIONS)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--bandwidth", type=float, help="read bandwidth in GB/s (default: measured)")
    ap.add_argument("--layers", type=int, help="MoE layers per model (default: their weights ≥ 3 × the LLC, ≤ 8)")
    ap.add_argument("--no-ort", action="store_true", help="skip ORT's com.microsoft.MoE")
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench-moe"))
    ap.add_argument("--out", type=Path, help="append one JSON line per row")
    a = ap.parse_args()
    if not kernels.status().available:
        sys.exit(f"kernel library: {kernels.status().reason}")
    bw = a.bandwidth or read_bandwidth(a.threads)
    s = kernels.status()
    print(f"# MoE layer H {a.hidden}, F {a.inter}, E {a.experts}, top {a.top_k}; {a.threads} threads; read bandwidth "
          f"{bw:.1f} GB/s; paths f32 {s.f32}, bf16 {s.bf16}, int8/int4 {s.gemm}")
    a.work.mkdir(parents=True, exist_ok=True)
    gate_up, down = neutral_weights(a.experts, a.hidden, a.inter)
    rng = np.random.default_rng(1)
    feeds = {t: [{"x": rng.standard_normal((t, a.hidden), dtype=np.float32),
                  "router_logits": rng.standard_normal((t, a.experts), dtype=np.float32)} for _ in range(ROUTINGS)]
             for t in a.tokens}
    cache = llc_bytes()
    engines = [(p, "omforge " + moe_kernel.MOE_OPS[p]) for p in a.precisions] + ([] if a.no_ort else [
        ("float32", "ORT com.microsoft.MoE")])
    print("| weights | op | layers | T | experts | ms median | ms best | GFLOP/s | bound ms | of bound |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for precision, engine in engines:
        path = a.work / f"{engine.split()[-1]}-{precision}.onnx"
        ours = engine.startswith("omforge")
        t0 = time.perf_counter()
        node, weights, per_expert = (kernel_parts(gate_up, down, precision, a.top_k) if ours
                                     else ort_parts(gate_up, down, a.top_k))
        layers = a.layers or min(8, -(-3 * cache // (per_expert * a.experts)))
        save(node, weights, layers, path)
        del weights
        sess = session(path, a.threads, ours)
        build_s = time.perf_counter() - t0
        for t in a.tokens:
            med, best = (v / layers for v in time_calls(sess, feeds[t], a.reps))
            n_exp = statistics.mean(touched(f["router_logits"], a.top_k) for f in feeds[t])
            bound = n_exp * per_expert / (bw * 1e9) * 1e3
            gflops = 2 * t * a.top_k * 3 * a.hidden * a.inter / (med * 1e-3) / 1e9
            print(f"| {precision} | {engine} | {layers} | {t} | {n_exp:.0f} | {med:.3f} | {best:.3f} | {gflops:.1f} | "
                  f"{bound:.3f} | {bound / med:.0%} |", flush=True)
            if a.out:
                with a.out.open("a") as f:
                    f.write(json.dumps({"weights": precision, "op": engine, "layers": layers, "tokens": t,
                                        "experts": n_exp,
                                        "ms_median": med, "ms_best": best, "gflops": gflops, "bound_ms": bound,
                                        "bandwidth_gbs": bw, "threads": a.threads, "build_s": build_s,
                                        "shape": [a.hidden, a.inter, a.experts, a.top_k]}) + "\n")
        del sess
        path.unlink()
        (a.work / (path.name + ".data")).unlink()
    shutil.rmtree(a.work, ignore_errors=True)


if __name__ == "__main__":
    main()
