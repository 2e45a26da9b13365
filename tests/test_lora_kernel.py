"""The kernel library's LoraAdd (runtime/ort/kernels/lora.h) against a float64 numpy reference: one token, a few, a
prefill of 300 (slots with many tokens take the transposed-B row tiles, slots with few the dot tiles, in one run),
ragged shapes (every vector tail), rank padding, slot 0 copied through bit for bit, both slot shapes, its errors,
and every ISA path this CPU can run."""

from __future__ import annotations

import functools

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from kernel_reference import kernel_session
from omforge.runtime.ort import kernels

pytestmark = pytest.mark.skipif(not kernels.status().available, reason=f"kernel library: {kernels.status().reason}")

INPUTS = ("y", "x", "lora_a", "lora_b", "lora_slots")


def lora_model() -> onnx.ModelProto:
    """One LoraAdd node, every input of any shape (the kernel checks them)."""
    types = (TensorProto.FLOAT,) * 4 + (TensorProto.INT64,)
    graph = helper.make_graph(
        [helper.make_node("LoraAdd", list(INPUTS), ["out"], domain=kernels.DOMAIN)], "lora_add",
        [helper.make_tensor_value_info(n, t, None) for n, t in zip(INPUTS, types)],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(kernels.DOMAIN, 1)])


@functools.cache
def session():  # noqa: ANN201 - one session for the file (the model has no fixed shapes)
    return kernel_session(lora_model())


def make_pools(rng: np.random.Generator, S: int, PR: int, n_in: int, n_out: int, rank: int | None = None,
               ) -> tuple[np.ndarray, np.ndarray]:
    """Pools ``[S, PR, in]``, ``[S, out, PR]``, slot 0 zeros (the contract); ``rank``: each adapter's rows and columns
    past it are zeros (a slot padded to PR)."""
    a = rng.standard_normal((S, PR, n_in), dtype=np.float32) / np.float32(np.sqrt(n_in))
    b = rng.standard_normal((S, n_out, PR), dtype=np.float32) / np.float32(np.sqrt(PR))
    a[0], b[0] = 0, 0
    if rank is not None:
        a[:, rank:], b[:, :, rank:] = 0, 0
    return a, b


def reference(y: np.ndarray, x: np.ndarray, a: np.ndarray, b: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """y[t] + B[s_t] · (A[s_t] · x[t]) in float64."""
    s = slots.reshape(-1)
    x64, y64 = x.reshape(len(s), -1).astype(np.float64), y.reshape(len(s), -1).astype(np.float64)
    h = np.einsum("tri,ti->tr", a[s].astype(np.float64), x64)
    return (y64 + np.einsum("tor,tr->to", b[s].astype(np.float64), h)).reshape(y.shape)


def run(y: np.ndarray, x: np.ndarray, a: np.ndarray, b: np.ndarray, slots: np.ndarray) -> np.ndarray:
    return session().run(None, dict(zip(INPUTS, (y, x, a, b, slots))))[0]


def check(slots: list[int], *, S: int = 5, PR: int = 48, n_in: int = 576, n_out: int = 960, seed: int = 0,
          flat_slots: bool = False) -> None:
    """One run against the reference; slot-0 tokens must come back exactly as y."""
    rng = np.random.default_rng(seed)
    T = len(slots)
    y = rng.standard_normal((1, T, n_out), dtype=np.float32)
    x = rng.standard_normal((1, T, n_in), dtype=np.float32)
    a, b = make_pools(rng, S, PR, n_in, n_out)
    s = np.array(slots, np.int64) if flat_slots else np.array([slots], np.int64)
    got = run(y, x, a, b, s)
    assert got.shape == y.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, reference(y, x, a, b, s), rtol=1e-5, atol=2e-5)
    base = np.array(slots) == 0
    np.testing.assert_array_equal(got[0, base], y[0, base])
    if not base.all():  # the adapters' terms are there
        assert not np.allclose(got[0, ~base], y[0, ~base], atol=1e-3)


def test_one_token() -> None:
    check([4])  # the last slot
    check([0])
    check([2], flat_slots=True)


def test_seven_tokens_mixed_slots() -> None:
    check([0, 4, 1, 0, 4, 2, 1], seed=1)
    check([3, 3, 0, 1, 4, 4, 2], seed=2, flat_slots=True)


def test_prefill_of_300_tokens() -> None:
    """Slots 1 and 4 with many tokens (row tiles over B transposed), slot 3 with 3 (dot tiles), slot 2 absent."""
    rng = np.random.default_rng(3)
    slots = rng.choice([0, 1, 4], size=300, p=[0.2, 0.4, 0.4])
    slots[[10, 150, 299]] = 3
    check(list(slots), seed=3)
    check(list(rng.integers(0, 17, size=300)), S=17, PR=16, n_in=2048, n_out=576, seed=4)


@pytest.mark.parametrize("n_in, n_out, PR", [(37, 45, 5), (16, 17, 1), (100, 3, 96)])
def test_ragged_shapes(n_in: int, n_out: int, PR: int) -> None:
    """Sizes off every vector width: partial loads and stores in both tiles, both token tails."""
    for T in (1, 3, 13, 70):
        check([(t * 7) % 3 for t in range(T)], S=3, PR=PR, n_in=n_in, n_out=n_out, seed=T)


def test_rank_padding_is_the_unpadded_adapter() -> None:
    """A rank-8 adapter padded to 32 in the pools gives its unpadded product."""
    rng = np.random.default_rng(5)
    T, n_in, n_out, r = 40, 64, 96, 8
    a, b = make_pools(rng, 3, 32, n_in, n_out, rank=r)
    y = rng.standard_normal((1, T, n_out), dtype=np.float32)
    x = rng.standard_normal((1, T, n_in), dtype=np.float32)
    slots = np.array([[t % 3 for t in range(T)]], np.int64)
    got = run(y, x, a, b, slots)
    np.testing.assert_allclose(got, reference(y, x, a[:, :r], b[:, :, :r], slots), rtol=1e-5, atol=2e-5)


def test_slot_zero_is_copied_without_arithmetic() -> None:
    """Slot-0 rows are y's bits (-0.0 stays -0.0, which y + 0.0 would not keep), also in a step of only slot 0."""
    rng = np.random.default_rng(6)
    a, b = make_pools(rng, 3, 16, 32, 48)
    x = rng.standard_normal((1, 20, 32), dtype=np.float32)
    y = rng.standard_normal((1, 20, 48), dtype=np.float32)
    y[:, :, ::2] = -0.0
    for slots in ([0] * 20, [0, 1, 2, 0] * 5):
        s = np.array([slots], np.int64)
        got = run(y, x, a, b, s)
        base = np.array(slots) == 0
        assert got[0, base].tobytes() == y[0, base].tobytes()


def test_two_dimensional_activations() -> None:
    """y and x as [T, out] / [T, in] (no leading dims), slots [T]."""
    rng = np.random.default_rng(7)
    a, b = make_pools(rng, 4, 24, 40, 72)
    y, x = rng.standard_normal((9, 72), dtype=np.float32), rng.standard_normal((9, 40), dtype=np.float32)
    s = np.array([0, 1, 2, 3, 3, 2, 1, 0, 3], np.int64)
    np.testing.assert_allclose(run(y, x, a, b, s), reference(y, x, a, b, s), rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("change, message", [
    ({"lora_slots": np.array([[0, 1, 5, 2]], np.int64)}, r"lora_slots\[2\] = 5 is outside the pool's slots \[0, 5\)"),
    ({"lora_slots": np.array([[0, -1, 1, 2]], np.int64)}, r"lora_slots\[1\] = -1 is outside"),
    ({"lora_slots": np.array([[0, 1, 2]], np.int64)}, r"lora_slots must be \[1, T\] or \[T\] with T = 4, got \[1, 3\]"),
    ({"lora_slots": np.zeros((2, 4), np.int64)}, r"lora_slots must be \[1, T\] or \[T\]"),
    ({"x": np.zeros((1, 3, 8), np.float32)}, r"x must be \[\.\.\., T, in\] with leading dims 1 and y's T = 4"),
    ({"y": np.zeros((2, 4, 12), np.float32)}, r"y must be \[\.\.\., T, out\] with leading dims 1, got \[2, 4, 12\]"),
    ({"lora_a": np.zeros((5, 6, 9), np.float32)}, r"lora_a must be \[S, PR, in\] with in = 8, got \[5, 6, 9\]"),
    ({"lora_b": np.zeros((5, 11, 6), np.float32)}, r"lora_b must be \[S, out, PR\] = \[5, 12, 6\]"),
    ({"lora_b": np.zeros((4, 12, 6), np.float32)}, r"lora_b must be \[S, out, PR\]"),
])
def test_errors_name_the_input(change: dict, message: str) -> None:
    feeds = {"y": np.zeros((1, 4, 12), np.float32), "x": np.zeros((1, 4, 8), np.float32),
             "lora_a": np.zeros((5, 6, 8), np.float32), "lora_b": np.zeros((5, 12, 6), np.float32),
             "lora_slots": np.array([[0, 1, 4, 2]], np.int64)}
    session().run(None, feeds)  # the unchanged feeds run
    with pytest.raises(Exception, match="LoraAdd: " + message):
        session().run(None, {**feeds, **change})


def run_all_cases() -> None:
    """The checks above, for a child process on a forced ISA path."""
    test_one_token()
    test_seven_tokens_mixed_slots()
    test_prefill_of_300_tokens()
    for shape in ((37, 45, 5), (16, 17, 1), (100, 3, 96)):
        test_ragged_shapes(*shape)
    test_rank_padding_is_the_unpadded_adapter()
    test_slot_zero_is_copied_without_arithmetic()


@pytest.mark.parametrize("isa", ["avx2", "generic"])
def test_slower_isa_paths(isa: str) -> None:
    """The AVX2 and portable paths, forced in a child process (the path is fixed when the library loads); the
    fastest path this CPU has is the one the tests above ran."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    if isa == kernels.status().lora or (isa == "avx2" and kernels.status().lora == "generic"):
        pytest.skip(f"the {isa} path is this process's (or beyond this CPU)")
    code = ("import test_lora_kernel as t; from omforge.runtime.ort import kernels; "
            f"assert kernels.status().lora == {isa!r}, kernels.status(); t.run_all_cases()")
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "OMFORGE_KERNELS_ISA": isa},
                       cwd=Path(__file__).parent, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
