"""The kernel lowering end to end: bundles that use omforge's PagedAttention kernel against the plain-op lowering
(fewer nodes, the same greedy tokens on the tiny model and on SmolLM2's chat prompts), the manifest's record of
it, and the fallback when the library is absent (compile falls back; a kernel bundle fails to load in one line)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_smollm2 import CHAT_PROMPTS

from helpers import SMOLLM2_RECIPE, TINY_RECIPE, compile_bundle
from omforge.contract.manifest import KernelLibrary, load_manifest
from omforge.runtime.llm import LLM
from omforge.runtime.ort import kernels
from omforge.runtime.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not kernels.status().available, reason=f"kernel library: {kernels.status().reason}")
TESTS = Path(__file__).parent
GREEDY = SamplingParams(temperature=0.0, max_tokens=32)


def without_kernels(code: str, cache: Path) -> subprocess.CompletedProcess:
    """Run ``code`` in a child process where the kernel library is disabled (as on a machine without it)."""
    env = {**os.environ, "OMFORGE_KERNELS": "0", "OMFORGE_CACHE_DIR": str(cache)}
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=TESTS, capture_output=True, text=True, timeout=900)


GENERATE_PLAIN = """
import json, sys
from pathlib import Path
from helpers import compile_bundle
from omforge.runtime.llm import LLM
from omforge.runtime.sampling_params import SamplingParams
recipe, out, cache, prompts = sys.argv[1:] if len(sys.argv) > 1 else ({args})
bundle = compile_bundle(Path(recipe), Path(out), Path(cache))
llm = LLM(bundle)
prompts = json.loads(prompts)
if isinstance(prompts[0], str):
    tok = llm.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{{"role": "user", "content": p}}]), add_special_tokens=False)
               for p in prompts]
outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)
print(json.dumps([o.token_ids for o in outs]))
"""


def plain_tokens(recipe: Path, out: Path, cache: Path, prompts: list) -> list[list[int]]:
    args = ", ".join(repr(str(x)) for x in (recipe, out, cache, json.dumps(prompts)))
    r = without_kernels(GENERATE_PLAIN.format(args=args), cache)
    assert r.returncode == 0, r.stderr[-3000:]
    manifest = load_manifest(out, verify=False)
    assert manifest.paged_attention == "plain" and manifest.kernels is None
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_tiny_kernel_bundle_equals_plain(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    bundle = compile_bundle(TINY_RECIPE, tmp_path / "kernel", cache)
    m = load_manifest(bundle)
    assert m.paged_attention == "kernel"
    f32 = kernels.status().f32 == "avx512f"  # float32 weight MatMuls are MatMulF32, its packed layout recorded
    assert m.kernels == KernelLibrary("_omforge_kernels", kernels.DOMAIN, kernels.ABI_VERSION, kernels.status().isa,
                                      kernels.status().weight_layout if f32 else None)
    hist = m.passes.op_histogram
    assert hist[f"{kernels.DOMAIN}::PagedAttention"] == m.model.config.num_hidden_layers
    assert "ScatterND" not in hist
    prompts = [[int(t) for t in range(3 + i, 40 + 7 * i)] for i in range(6)]
    ours = [o.token_ids for o in LLM(bundle, max_num_batched_tokens=48).generate(prompts, GREEDY, use_tqdm=False)]
    theirs = plain_tokens(TINY_RECIPE, tmp_path / "plain", cache, prompts)
    plain = load_manifest(tmp_path / "plain", verify=False)
    assert plain.passes.num_nodes > m.passes.num_nodes
    assert ours == theirs


def test_without_the_library_compile_falls_back_and_a_kernel_bundle_is_one_clear_line(tmp_path: Path) -> None:
    env = {**os.environ, "OMFORGE_KERNELS": "0", "OMFORGE_CACHE_DIR": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-m", "omforge", "compile", str(TINY_RECIPE), "-o", str(tmp_path / "plain")],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("kernel library unavailable (disabled by OMFORGE_KERNELS=0)") == 1  # said once
    assert load_manifest(tmp_path / "plain").paged_attention == "plain"
    bundle = compile_bundle(TINY_RECIPE, tmp_path / "kernel", tmp_path / "cache")
    r = subprocess.run([sys.executable, "-m", "omforge", "generate", str(bundle), "--prompt", "hi",
                        "--max-tokens", "2"],
                       env={**os.environ, "OMFORGE_KERNELS": "0"}, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "kernel library" in lines[0] and "disabled by OMFORGE_KERNELS=0" in lines[0], r.stderr


def test_smollm2_greedy_chat_tokens_equal_plain_lowering(smollm2_bundle: Path, smollm2_cache: Path,
                                                         tmp_path: Path) -> None:
    llm = LLM(smollm2_bundle)
    assert load_manifest(smollm2_bundle, verify=False).paged_attention == "kernel"
    tok = llm.tokenizer
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False)
           for p in CHAT_PROMPTS]
    ours = [o.token_ids for o in llm.generate(ids, GREEDY, use_tqdm=False)]
    assert ours == plain_tokens(SMOLLM2_RECIPE, tmp_path / "plain", smollm2_cache, CHAT_PROMPTS)


@pytest.fixture(scope="module")
def tiny_bundles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny recipe with each KV cache dtype (blocks of 4 tokens: short prompts cross many blocks)."""
    root = tmp_path_factory.mktemp("kv-dtypes")
    bundles = {}
    for dtype in ("float32", "bfloat16", "int8"):
        recipe = root / f"tiny-{dtype}.yaml"
        recipe.write_text(TINY_RECIPE.read_text().replace("compile:\n", f"compile:\n  kv_block_size: 4\n"
                                                                        f"  kv_cache_dtype: {dtype}\n"))
        bundles[dtype] = compile_bundle(recipe, root / dtype, root / "cache")
    return bundles


def test_bundles_of_older_kernel_abis_run_and_newer_ones_fail_in_one_line(tiny_bundles: dict[str, Path],
                                                                          tmp_path: Path) -> None:
    """The ops keep their earlier forms (ABI 2's q, k, v inputs still run), so a bundle recording an older ABI loads;
    one from a newer omforge (its graph may use forms this library lacks) is refused before ORT sees it."""
    import shutil

    from omforge.errors import OmforgeError

    prompt = [[5, 6, 7, 8, 9]]
    want = [o.token_ids for o in LLM(tiny_bundles["float32"]).generate(prompt, GREEDY, use_tqdm=False)]
    for abi, loads in ((kernels.ABI_VERSION - 1, True), (kernels.ABI_VERSION + 1, False)):
        bundle = shutil.copytree(tiny_bundles["float32"], tmp_path / f"abi{abi}")
        manifest = json.loads((bundle / "manifest.json").read_text())
        manifest["kernels"]["abi"] = abi
        (bundle / "manifest.json").write_text(json.dumps(manifest))
        if loads:
            assert [o.token_ids for o in LLM(bundle).generate(prompt, GREEDY, use_tqdm=False)] == want
        else:
            with pytest.raises(OmforgeError, match=f"compiled for kernel ABI {abi}, this omforge's kernel library "
                                                   f"speaks ABI {kernels.ABI_VERSION}"):
                LLM(bundle)


@pytest.mark.parametrize("dtype, itemsize, extra", [("bfloat16", 2, 0), ("int8", 1, 4)])
def test_reduced_precision_kv_bundle(tiny_bundles: dict[str, Path], dtype: str, itemsize: int, extra: int) -> None:
    m, m32 = (load_manifest(tiny_bundles[d]) for d in (dtype, "float32"))
    kv, pool = m.kv, m.abi.inputs[7]
    assert kv.dtype == dtype and pool.name == "key_cache.0"
    assert pool.dtype == dtype and pool.shape is not None and pool.shape[-1] == kv.head_dim + extra
    assert kv.bytes_per_token == m32.kv.bytes_per_token * itemsize * (kv.head_dim + extra) // (4 * kv.head_dim)
    llm = LLM(tiny_bundles[dtype], num_kv_blocks=256)
    assert llm.engine.executor.key_pools[0].dtype.itemsize == itemsize
    # the pools' dtype follows through swapping: outputs under swap preemption equal those run alone
    prompts = [[int(t) for t in range(5 + i, 30 + 3 * i)] for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    alone = [LLM(tiny_bundles[dtype], num_kv_blocks=64).generate([p], params, use_tqdm=False)[0].token_ids
             for p in prompts]
    tight = LLM(tiny_bundles[dtype], num_kv_blocks=16, preemption_mode="swap", swap_space_gb=0.01)
    assert [o.token_ids for o in tight.generate(prompts, params, use_tqdm=False)] == alone
    assert tight.engine.stats.preemptions > 0
    # drift against the float32 cache on the same steps (logits of a prefill, then 8 decodes)
    from omforge.runtime.step import SeqWork

    execs = {d: LLM(tiny_bundles[d], num_kv_blocks=64).engine.executor for d in ("float32", dtype)}
    ids, table = prompts[0], list(range(40))
    drift = []
    for _d, ex in execs.items():
        out = [ex.execute([SeqWork(ids, 0, table)])[0]]
        for i in range(8):
            out.append(ex.execute([SeqWork([7 + i], len(ids) + i, table)])[0])
        drift.append(out)
    diff = max(float(abs(a - b).max()) for a, b in zip(*drift))
    scale = max(float(abs(a).max()) for a in drift[0])
    assert 0 < diff < 0.05 * scale, (diff, scale)  # reduced precision moves the logits, by little


def test_reduced_precision_kv_errors(tmp_path: Path) -> None:
    from omforge.compile.compiler import compile_recipe
    from omforge.errors import OmforgeError
    from omforge.recipe import load_recipe

    recipe = tmp_path / "r.yaml"
    recipe.write_text(TINY_RECIPE.read_text().replace("compile:\n", "compile:\n  kv_cache_dtype: fp8\n"))
    with pytest.raises(OmforgeError, match="kv_cache_dtype"):
        load_recipe(recipe)
    recipe.write_text(TINY_RECIPE.read_text().replace("compile:\n", "compile:\n  kv_cache_dtype: int8\n"))
    with pytest.raises(OmforgeError, match="kv_cache_dtype: int8 is not supported for target ascend"):
        compile_recipe(load_recipe(recipe), tmp_path / "out", target="ascend", quiet=True)


def test_diff_of_two_bundles_reports_kv_drift(tiny_bundles: dict[str, Path]) -> None:
    r = subprocess.run([sys.executable, "-m", "omforge", "diff", str(tiny_bundles["float32"]),
                        str(tiny_bundles["int8"]), "--max-tokens", "8", "--json", "--tol", "100"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["kv_dtypes"] == ["float32", "int8"] and len(d["prompts"]) == 20
    assert 0 < d["max_abs"] < 100 and all(0 <= p["identical_prefix"] <= 8 for p in d["prompts"])
    same = subprocess.run([sys.executable, "-m", "omforge", "diff", str(tiny_bundles["float32"]),
                           str(tiny_bundles["float32"]), "--max-tokens", "4"],
                          capture_output=True, text=True, timeout=600)
    assert same.returncode == 0 and "identical 4-token outputs: 100% of prompts" in same.stdout, same.stderr
