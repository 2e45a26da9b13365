"""``omforge doctor``: what this machine has, and which targets it can compile and run.

Looks without changing anything and without importing heavy packages (versions come from package metadata; torch
is not imported): Python, the packages omforge uses, onnxruntime's execution providers, the CANN toolkit (``atc``
on PATH and the toolkit version, said in one line when older than the CANN release omforge targets,
``ASCEND_OPP_PATH``, whether ``set_env.sh`` was sourced), pyACL, visible NPUs,
torch / torch_npu. Always exits 0: it reports, it does not judge the machine.
"""

from __future__ import annotations

import glob
import importlib.metadata
import importlib.util
import os
import platform
import shutil
import sys
from pathlib import Path
from typing import Any

from omforge.contract.ascend import CANN_RELEASE

PACKAGES = ("omforge", "numpy", "onnx", "onnxruntime", "onnxscript", "onnx-ir", "onnxsim", "tokenizers", "jinja2",
            "pydantic", "fastapi", "uvicorn", "prometheus-client", "torch", "torch-npu", "transformers", "gguf",
            "safetensors")
EXPORT_NEEDS = ("torch", "onnxscript", "onnx-ir", "onnx", "gguf", "safetensors")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cann_version(env: dict[str, str]) -> str | None:
    """The installed toolkit's version. First the ``version=`` line of ``<toolkit>/<arch>-linux/
    ascend_toolkit_install.info`` (what CANN's docs read: hicann/ge ``docs/en/build.md:11-14``), then ``Version=`` of
    the compiler package's ``share/info/ge-compiler/version.info`` (``cmake/package.cmake:63-66``, read by
    ``scripts/install.sh:43-55``), then older layouts' ``version.cfg`` / ``*/version.info`` [unverified: seen in
    releases before the open sources]. The toolkit root is what set_env.sh exports."""
    roots = ([env.get(k) for k in ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH")]
             + ["/usr/local/Ascend/cann", "/usr/local/Ascend/ascend-toolkit/latest"])
    for root in filter(None, roots):
        home = Path(root)
        files = [home / f"{platform.machine()}-linux" / "ascend_toolkit_install.info",
                 *sorted(home.glob("*-linux/ascend_toolkit_install.info")),
                 home / "share" / "info" / "ge-compiler" / "version.info",
                 home / "version.cfg", home / "compiler" / "version.info", home / "runtime" / "version.info"]
        for path in files:
            if path.is_file():
                for line in path.read_text(errors="replace").splitlines():
                    key, _, value = line.partition("=")
                    if key.strip().lower() in ("version", "runtime_running_version") and value.strip():
                        return value.strip().strip("[]").split(":")[-1]
    return None


def release_key(version: str) -> tuple[int, int, int, int] | None:
    """A comparable key for a CANN version: (major, minor, stage, n) with stage 0 for an alpha/beta, 1 for ``RCn``
    (n its number), 2 for a release (n its patch): ``8.0.RC3`` < ``8.5.0.alpha001`` < ``8.5.0`` < ``9.1.0``. None
    when it does not start with ``major.minor``. build.sh's ``release_key`` computes the same."""
    parts = version.strip().split(".")
    if len(parts) < 2 or not (parts[0].isdigit() and parts[1].isdigit()):
        return None
    third = parts[2] if len(parts) > 2 else ""
    stage, n = 2, 0
    if third.upper().startswith("RC") and third[2:].isdigit():
        stage, n = 1, int(third[2:])
    elif third.isdigit():
        n = int(third)
    elif third:
        stage = 0
    if (len(parts) > 3 and any(c.isalpha() for c in parts[3])) or any(f"-{w}" in version for w in ("alpha", "beta",
                                                                                                   "rc")):
        stage = 0
    return int(parts[0]), int(parts[1]), stage, n


def release_line(installed: str | None) -> str:
    """One line: the targeted CANN release, and whether ``installed`` is older."""
    if installed is None:
        return f"omforge targets CANN {CANN_RELEASE}; the installed version is unknown"
    have, want = release_key(installed), release_key(CANN_RELEASE)
    if have is None:
        return f"omforge targets CANN {CANN_RELEASE}; cannot compare the installed {installed!r}"
    if have < want:
        return (f"CANN {installed} is older than {CANN_RELEASE}, the release omforge's Ascend path targets: ops, ONNX "
                "plugins and options it relies on may be missing")
    return f"CANN {installed}: not older than {CANN_RELEASE}, the release omforge's Ascend path targets"


def _acl() -> tuple[bool, str, int | None]:
    """(pyACL importable, what happened, number of NPUs it sees or None)."""
    if importlib.util.find_spec("acl") is None:
        return False, "not installed (no module named 'acl')", None
    try:
        import acl
    except Exception as e:
        return False, f"import failed: {type(e).__name__}: {e}", None
    from omforge.runtime.ascend.acl_api import device_count  # every acl call lives in acl_api

    try:
        return True, "imports", device_count(acl)
    except Exception as e:
        return True, f"imports; device count failed: {e}", None


def gather(env: dict[str, str] | None = None) -> dict[str, Any]:
    """Everything the doctor reports, JSON-ready."""
    env = dict(os.environ if env is None else env)
    packages = {name: _version(name) for name in PACKAGES}
    try:
        import onnxruntime as ort

        providers = list(ort.get_available_providers())
    except Exception as e:
        providers = [f"(onnxruntime unusable: {e})"]
    atc = shutil.which("atc", path=env.get("PATH"))
    cann_version = _cann_version(env)
    acl_ok, acl_note, acl_devices = _acl()
    davinci = sorted(p for p in glob.glob("/dev/davinci*") if p.removeprefix("/dev/davinci").isdigit())
    npus = acl_devices if acl_devices is not None else len(davinci)
    sourced = bool(env.get("ASCEND_OPP_PATH") and (env.get("ASCEND_TOOLKIT_HOME") or env.get("ASCEND_HOME_PATH")))
    can_export = all(packages[p] for p in EXPORT_NEEDS)
    ort_cpu = "CPUExecutionProvider" in providers
    targets = {
        "ort": {"compile": can_export, "run": ort_cpu,
                "why": "onnxruntime CPU" if ort_cpu else "onnxruntime has no CPU provider"},
        "ort-cuda": {"compile": can_export, "run": "CUDAExecutionProvider" in providers,
                     "why": "CUDAExecutionProvider available" if "CUDAExecutionProvider" in providers
                     else "no CUDAExecutionProvider (onnxruntime-gpu and a GPU)"},
        "ascend": {"compile": can_export and atc is not None, "run": acl_ok and npus > 0,
                   "why": "; ".join(filter(None, [
                       None if atc else "no atc on PATH: compile stops before the OM step (exit 3)",
                       None if acl_ok else f"pyACL {acl_note}",
                       None if npus else "no NPU visible"])) or "atc, pyACL and an NPU present"},
    }
    try:
        from omforge.runtime.ort import kernels

        k = kernels.status()
        kernel_report = {"built": kernels.library_path() is not None, "available": k.available, "isa": k.isa,
                         "abi": k.abi, "path": k.path, "reason": k.reason or None,
                         "ort_paged_attention": "kernel" if k.available else "plain",
                         "gemm": k.gemm if k.available else None, "bf16": k.bf16 if k.available else None,
                         "qbf16": k.qbf16 if k.available else None, "f32": k.f32 if k.available else None,
                         "weight_layout": k.weight_layout}
    except Exception as e:
        kernel_report = {"built": False, "available": False, "isa": None, "abi": None, "path": None,
                         "reason": f"{type(e).__name__}: {e}", "ort_paged_attention": "plain", "gemm": None,
                         "bf16": None, "qbf16": None, "f32": None, "weight_layout": None}
    if not can_export:
        missing = [p for p in EXPORT_NEEDS if not packages[p]]
        for t in targets.values():
            t["why"] += f"; export needs {', '.join(missing)}"
    return {
        "python": {"version": platform.python_version(), "executable": sys.executable},
        "platform": platform.platform(),
        "packages": packages,
        "onnxruntime_providers": providers,
        "cann": {"atc": atc, "version": cann_version, "ASCEND_OPP_PATH": env.get("ASCEND_OPP_PATH"),
                 "set_env_sourced": sourced, "targets": CANN_RELEASE,
                 "older": None if cann_version is None or release_key(cann_version) is None
                 else release_key(cann_version) < release_key(CANN_RELEASE), "release": release_line(cann_version)},
        "pyacl": {"importable": acl_ok, "note": acl_note},
        "npus": {"count": npus, "devices": davinci, "npu_smi": shutil.which("npu-smi", path=env.get("PATH"))},
        "kernels": kernel_report,
        "targets": targets,
    }


def render(report: dict[str, Any]) -> str:
    """The report as two readable tables: what is here, and target × compile / run."""
    rows = [("python", f"{report['python']['version']} ({report['python']['executable']})")]
    rows += [(f"  {k}", v or "-") for k, v in report["packages"].items()]
    rows.append(("onnxruntime providers", ", ".join(report["onnxruntime_providers"])))
    c = report["cann"]
    rows += [("CANN atc", c["atc"] or "not on PATH"), ("CANN version", c["version"] or "-"),
             ("CANN release", c["release"]),
             ("ASCEND_OPP_PATH", c["ASCEND_OPP_PATH"] or "not set"),
             ("set_env.sh sourced", "yes" if c["set_env_sourced"] else "no"),
             ("pyACL (import acl)", report["pyacl"]["note"]),
             ("NPUs visible", str(report["npus"]["count"]))]
    k = report["kernels"]
    rows.append(("CPU kernel library", f"available, ISA path {k['isa']}, ABI {k['abi']} ({k['path']})" if k["available"]
                 else f"{'built but ' if k['built'] else ''}unavailable: {k['reason']}"))
    rows.append(("ort paged attention", f"{k['ort_paged_attention']} lowering for bundles compiled here"))
    rows.append(("ort int4/int8 weights", f"MatMulQ ({k['gemm']} path, weight layout {k['weight_layout']})"
                 if k.get("gemm") else "MatMulNBits (onnxruntime's op; the kernel library's GEMM is unavailable)"))
    rows.append(("ort float32 weights", "MatMulF32 (avx512f path)" if k.get("f32") == "avx512f"
                 else "MatMul (onnxruntime's MLAS: no AVX-512 MatMulF32 of the kernel library here)"))
    rows.append(("ort bfloat16 weights", f"MatMulBF16 ({k['bf16']} path)" if k.get("bf16")
                 else "unavailable (needs the kernel library)"))
    rows.append(("ort int4/int8 × bf16 activations", f"MatMulQBF16 ({k['qbf16']} path)" if k.get("qbf16")
                 else "unavailable (needs the kernel library with MatMulQBF16)"))
    if (k.get("qbf16") or "").startswith("amx"):  # the library's MatMulQBF16 path: "amx-bf16" on the tile unit
        rows.append(("  advice", "this CPU's tile unit runs MatMulQBF16: for batched serving of int4/int8 weights, "
                     "compile.quantization.activations: bfloat16 (docs/weights.md)"))
    width = max(len(k) for k, _ in rows)
    lines = ["omforge doctor", ""] + [f"{k:<{width}}  {v}" for k, v in rows] + ["", f"{'target':<9} {'compile':<8} "
                                                                                 f"{'run':<4} why"]
    for name, t in report["targets"].items():
        lines.append(f"{name:<9} {'yes' if t['compile'] else 'no':<8} {'yes' if t['run'] else 'no':<4} {t['why']}")
    runs = [n for n, t in report["targets"].items() if t["run"]]
    lines += ["", f"this machine runs: {', '.join(runs) if runs else 'no target'}"]
    return "\n".join(lines)
