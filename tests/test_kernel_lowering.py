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

from helpers import SMOLLM2_RECIPE, TINY_RECIPE, compile_bundle
from omforge.compile.bundle import load_manifest
from omforge.runtime import kernels
from omforge.runtime.llm import LLM
from omforge.runtime.sampling_params import SamplingParams
from test_smollm2 import CHAT_PROMPTS

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


def plain_tokens(recipe: Path, out: Path, cache: Path, prompts: list) -> list[list[int]]:  # noqa: ANN001
    args = ", ".join(repr(str(x)) for x in (recipe, out, cache, json.dumps(prompts)))
    r = without_kernels(GENERATE_PLAIN.format(args=args), cache)
    assert r.returncode == 0, r.stderr[-3000:]
    manifest = load_manifest(out, verify=False)
    assert manifest["paged_attention"] == "plain" and manifest["kernels"] is None
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_tiny_kernel_bundle_equals_plain(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    bundle = compile_bundle(TINY_RECIPE, tmp_path / "kernel", cache)
    m = load_manifest(bundle)
    assert m["paged_attention"] == "kernel"
    assert m["kernels"] == {"name": "_omforge_kernels", "domain": kernels.DOMAIN, "abi": kernels.ABI_VERSION,
                            "isa": kernels.status().isa}
    hist = m["passes"]["op_histogram"]
    assert hist[f"{kernels.DOMAIN}::PagedAttention"] == m["model"]["config"]["num_hidden_layers"]
    assert "ScatterND" not in hist
    prompts = [[int(t) for t in range(3 + i, 40 + 7 * i)] for i in range(6)]
    ours = [o.token_ids for o in LLM(bundle, max_num_batched_tokens=48).generate(prompts, GREEDY, use_tqdm=False)]
    theirs = plain_tokens(TINY_RECIPE, tmp_path / "plain", cache, prompts)
    plain = load_manifest(tmp_path / "plain", verify=False)
    assert plain["passes"]["num_nodes"] > m["passes"]["num_nodes"]
    assert ours == theirs


def test_without_the_library_compile_falls_back_and_a_kernel_bundle_is_one_clear_line(tmp_path: Path) -> None:
    env = {**os.environ, "OMFORGE_KERNELS": "0", "OMFORGE_CACHE_DIR": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-m", "omforge", "compile", str(TINY_RECIPE), "-o", str(tmp_path / "plain")],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("kernel library unavailable (disabled by OMFORGE_KERNELS=0)") == 1  # said once
    assert load_manifest(tmp_path / "plain")["paged_attention"] == "plain"
    bundle = compile_bundle(TINY_RECIPE, tmp_path / "kernel", tmp_path / "cache")
    r = subprocess.run([sys.executable, "-m", "omforge", "generate", str(bundle), "--prompt", "hi", "--max-tokens", "2"],
                       env={**os.environ, "OMFORGE_KERNELS": "0"}, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "kernel library" in lines[0] and "disabled by OMFORGE_KERNELS=0" in lines[0], r.stderr


def test_smollm2_greedy_chat_tokens_equal_plain_lowering(smollm2_bundle: Path, smollm2_cache: Path,
                                                         tmp_path: Path) -> None:
    llm = LLM(smollm2_bundle)
    assert load_manifest(smollm2_bundle, verify=False)["paged_attention"] == "kernel"
    tok = llm.tokenizer
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False)
           for p in CHAT_PROMPTS]
    ours = [o.token_ids for o in llm.generate(ids, GREEDY, use_tqdm=False)]
    assert ours == plain_tokens(SMOLLM2_RECIPE, tmp_path / "plain", smollm2_cache, CHAT_PROMPTS)
