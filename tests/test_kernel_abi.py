"""What the kernel library and contract/kernel_abi.py agree on, checked from both sides: the head sizes PagedAttention
is built for (runtime/ort/kernels/head_dims.h, which the op's check and the kernel's dispatch expand) against
HEAD_DIMS — in the sources, in the built library's report and by running the op at each size — and which ISA path
each op takes under every OMFORGE_KERNELS_ISA value on this CPU (isa.h's chooser, the tables in custom_op.cpp,
lora_op.cpp, qgemm_op.cpp and moe_op.cpp)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from omforge.contract.kernel_abi import HEAD_DIMS
from omforge.contract.kernel_library import status

KERNELS = Path(__file__).resolve().parent.parent / "runtime" / "ort" / "kernels"
needs_library = pytest.mark.skipif(not status().available, reason=f"kernel library: {status().reason}")


def library_info(path: str, isa: str | None = None) -> dict[str, str]:
    """The library's ``omforge_kernels_info`` fields, read in a child process with ``OMFORGE_KERNELS_ISA=isa`` (the
    paths are chosen once per process; None: the variable unset)."""
    code = ("import ctypes, sys; lib = ctypes.CDLL(sys.argv[1]); lib.omforge_kernels_info.restype = ctypes.c_char_p; "
            "print(lib.omforge_kernels_info().decode())")
    env = {k: v for k, v in os.environ.items() if k != "OMFORGE_KERNELS_ISA"}
    if isa is not None:
        env["OMFORGE_KERNELS_ISA"] = isa
    r = subprocess.run([sys.executable, "-c", code, path], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    return dict(kv.split("=", 1) for kv in r.stdout.split())


def test_head_dims_h_lists_the_contracts_head_dims() -> None:
    text = (KERNELS / "head_dims.h").read_text()
    m = re.search(r"^#define OMF_HEAD_DIMS\(X\)((?:\s*X\(\d+\))+)\s*$", text, re.M)
    assert m, "head_dims.h has no `#define OMF_HEAD_DIMS(X) X(d) …` line"
    assert tuple(int(d) for d in re.findall(r"X\((\d+)\)", m.group(1))) == HEAD_DIMS


@pytest.mark.parametrize(("source", "expansion"), [("custom_op.cpp", "kHeadDims[] = {OMF_HEAD_DIMS("),
                                                   ("paged_attention_impl.h", "OMF_HEAD_DIMS(OMF_HEAD_DIM)")])
def test_the_op_check_and_the_kernel_dispatch_expand_head_dims_h(source: str, expansion: str) -> None:
    """kHeadDims and attend's switch are written from the one list, not beside it."""
    text = (KERNELS / source).read_text()
    assert expansion in text
    assert not re.search(r"kHeadDims\[\] = \{\s*\d|OMF_HEAD_DIM\(\d+\)", text), f"{source} lists head sizes itself"


@needs_library
def test_the_built_library_reports_the_contracts_head_dims() -> None:
    info = library_info(status().path)
    assert tuple(int(d) for d in info["head_dims"].split(",")) == HEAD_DIMS


@needs_library
@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_the_op_runs_at_every_contract_head_dim(head_dim: int, kv_dtype: str) -> None:
    """Decodes (the row path) and a short prefill (the tile path) at each size against the float64 reference."""
    from test_kernels import run_case

    run_case(np.random.default_rng(head_dim), [(20, 1), (3, 12)], q_heads=4, kv_heads=1, head_dim=head_dim,
             kv_dtype=kv_dtype)


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    m = re.search(r"^flags\s*:(.*)$", text, re.M)
    return set(m.group(1).split()) if m else set()


def expected_paths(forced: str, has: set[str], amx_granted: bool) -> dict[str, str]:
    """Each op's path under ``OMFORGE_KERNELS_ISA=forced`` on a CPU with the /proc/cpuinfo flags ``has``: the first of
    its table that the value allows and the CPU runs (isa.h). Each table names the values its paths allow as the
    choosers did before isa.h; a value a table does not name falls to what that table allows for any other."""
    def first(*paths: tuple[str, set[str], bool]) -> str:
        return next((name for name, allowed, runs in paths if forced in allowed and runs), "generic")

    every = {"", "amx", "avx512bf16", "avx512", "avxvnni", "avx2", "generic", "other"}
    avx2 = {"avx2", "fma"} <= has
    avx512 = {"avx512f", "avx512bw"} <= has
    bf16 = avx512 and "avx512_bf16" in has
    return {
        "isa": first(("avx512bf16", {"", "avx512bf16"}, bf16), ("avx512", {"", "avx512bf16", "avx512"}, avx512),
                     ("avx2", {"", "avx512bf16", "avx512", "avx2"}, avx2)),
        "lora": first(("avx512", {"", "avx512"}, "avx512f" in has), ("avx2", {"", "avx512", "avx2"}, avx2)),
        "gemm": first(("amx-int8", {"", "amx"}, amx_granted and {"amx_int8", "avx512_vnni", "avx512bw"} <= has),
                      ("avx512vnni", {"", "avx512"}, {"avx512_vnni", "avx512bw"} <= has),
                      ("avxvnni", {"", "avx512", "avxvnni"}, avx2 and {"f16c", "avx_vnni"} <= has),
                      ("avx2", every - {"generic"}, avx2 and "f16c" in has)),
        "bf16": first(("amx-bf16", {"", "amx"}, bf16 and amx_granted and "amx_bf16" in has),
                      ("avx512bf16", {"", "avx512"}, bf16), ("avx2", {"", "avx2", "avxvnni"}, avx2)),
        "f32": first(("avx512f", every - {"generic", "avx2", "avxvnni"}, "avx512f" in has)),
        "moe_f32": first(("avx512f", every - {"generic", "avx2", "avxvnni"}, "avx512f" in has),
                         ("avx2", every - {"generic"}, avx2)),
    }


@needs_library
def test_every_forced_isa_value_picks_the_paths_of_each_ops_table() -> None:
    has = cpu_flags()
    if not has:
        pytest.skip("no /proc/cpuinfo flags to predict the paths from")
    auto = library_info(status().path)
    amx_granted = "amx" in auto["gemm"] or "amx" in auto["bf16"]  # the tile unit and Linux's permission for it
    for forced in ("", "amx", "avx512bf16", "avx512", "avxvnni", "avx2", "generic", "other"):
        info = auto if forced == "" else library_info(status().path, forced)
        want = expected_paths(forced, has, amx_granted)
        assert {op: info[op] for op in want} == want, f"OMFORGE_KERNELS_ISA={forced!r}"
        assert info["qbf16"] == info["bf16"]
