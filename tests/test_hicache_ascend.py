"""The host tier (L2) below a pool in device memory, on the FAKE pyACL (tests/fake_acl.py): evictions written
back device → host by the step plans, hits copied host → device by the plan that admits them. The fake checks
every copy's kind and bounds; its "OM" runs the ORT lowering, so tokens must equal the engine's without tiers.
Never run on an NPU: this checks omforge's bookkeeping and copies, not Ascend's behaviour."""

from __future__ import annotations

from pathlib import Path

import fake_atc
import numpy as np
import pytest

from fake_acl import FakeAcl
from helpers import TINY_RECIPE, compile_bundle
from omforge.contract.manifest import load_manifest
from omforge.recipe import load_recipe, retarget
from omforge.runtime.engine import LLMEngine
from omforge.runtime.hicache.attach import HiCacheConfigError
from omforge.runtime.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
rng = np.random.default_rng(3)
PROMPTS = [rng.integers(3, 250, 70).tolist() for _ in range(3)]


@pytest.fixture(scope="module")
def small_pool_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny ascend bundle with FAKE OM files and a pool of 6 blocks of 16 compiled in (one request's worth)."""
    root = tmp_path_factory.mktemp("hicache-acl")
    recipe = root / "tiny.yaml"
    text = TINY_RECIPE.read_text().replace("compile:\n", "compile:\n  kv_block_size: 16\n")
    recipe.write_text(text + "serve:\n  num_kv_blocks: 6\n  max_num_seqs: 1\n")
    bundle = compile_bundle(recipe, root / "ascend", root / "cache", target="ascend")
    from omforge.compile.ascend.stages import (
        lower_step_graph,  # the plain-op twin the fake "OM" runs (test_acl_executor)
    )

    manifest = load_manifest(bundle, verify=False)
    (root / "plain").mkdir()
    lower_step_graph(Path(manifest.export.dir), root / "plain", retarget(load_recipe(recipe), "ascend"),
                     manifest.kv.block_size, plain=True)
    fake_atc.build_bundle(bundle, root / "plain" / "step.onnx")
    return bundle


def run(engine: LLMEngine, tag: str) -> list[list[int]]:
    outs = []
    for i, prompt in enumerate([*PROMPTS, *PROMPTS]):  # the second round finds the first's prefixes evicted
        engine.add_request(prompt, GREEDY, request_id=f"{tag}{i}")
        for _ in range(200):
            if not engine.has_unfinished():
                break
            for o in engine.step():
                if o.finished:
                    outs.append(o.token_ids)
            engine.kv.check_invariants()
            if engine.hicache is not None:
                engine.hicache.host.check_invariants()
    return outs


def test_the_host_tier_gives_the_same_tokens_with_less_prefill(small_pool_bundle: Path) -> None:
    plain = LLMEngine(small_pool_bundle, acl_module=FakeAcl())
    want = run(plain, "p")
    fake = FakeAcl()
    tiered = LLMEngine(small_pool_bundle, acl_module=fake, enable_hierarchical_cache=True, hicache_size_gb=0.01)
    assert run(tiered, "t") == want
    host = tiered.hicache.stats().tiers["host"]
    assert host.written_blocks >= 8 and host.loaded_blocks >= 8  # the second round's prefixes came back
    assert tiered.stats.prefill_tokens <= plain.stats.prefill_tokens - host.loaded_blocks * tiered.block_size
    assert not any(c.startswith("FAILED") for c in fake.calls), [c for c in fake.calls if c.startswith("FAILED")]
    assert tiered.kv.stats().num_free == tiered.kv.pool.num_blocks
    tiered.close()
    plain.close()


def test_a_device_pool_refuses_what_is_not_built(small_pool_bundle: Path, tmp_path: Path) -> None:
    with pytest.raises(HiCacheConfigError, match="not built yet"):
        LLMEngine(small_pool_bundle, acl_module=FakeAcl(), enable_hierarchical_cache=True, hicache_size_gb=0.01,
                  hicache_storage_backend="file", hicache_storage_dir=str(tmp_path))
    with pytest.raises(HiCacheConfigError, match="give the host tier a size"):
        LLMEngine(small_pool_bundle, acl_module=FakeAcl(), enable_hierarchical_cache=True)
