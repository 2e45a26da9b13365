"""Pooling bundles (task embed | score) through the AscendCL executor (runtime/ascend/acl_pooling.py) on the FAKE
pyACL (tests/fake_acl.py): the tiny Qwen3 embedding and reranker recipes compiled for ascend (float32 weights, so the
plain twin the fake runs equals the ORT bundle's numerics), their embeddings / scores through ``LLM`` against the
ORT bundles', batches that need several gears, and ``omforge verify`` on the pooling bundle. Nothing here ran on an
NPU: it checks the plumbing (padding to a gear, the dims list, the read-back) against CANN's cited rules."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fake_acl import FakeAcl
from helpers import compile_bundle

RECIPES = Path(__file__).parent / "recipes"


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``embed`` / ``score`` ascend bundles (float32 weights) with FAKE OMs built from their plain twins by
    tests/fake_atc.py; ``embed-ort`` / ``score-ort`` the same recipes for ort; the recipes under ``recipe-*``."""
    import fake_atc

    from omforge.contract.manifest import load_manifest
    from omforge.recipe import load_recipe, retarget
    from omforge.verify import plain_twin

    root = tmp_path_factory.mktemp("acl-pooling")
    cache = root / "cache"
    out: dict[str, Path] = {}
    for task, name in (("embed", "tiny-qwen3-embed"), ("score", "tiny-qwen3-rerank")):
        recipe = root / f"{name}-ascend.yaml"
        recipe.write_text((RECIPES / f"{name}.yaml").read_text().replace(
            "compile:\n", "compile:\n  target: ascend\n  weights: float32\n"))
        asc = compile_bundle(recipe, root / task, cache)
        manifest = load_manifest(asc, verify=False)
        twin = plain_twin(Path(manifest.export.dir), retarget(load_recipe(recipe), "ascend"), manifest,
                          root / f"plain-{task}")
        fake_atc.build_bundle(asc, twin)
        out[task], out[f"recipe-{task}"] = asc, recipe
        out[f"{task}-ort"] = compile_bundle(RECIPES / f"{name}.yaml", root / f"{task}-ort", cache, target="ort")
    return out


# lengths that need the 128 and 256 gears, and a batch over the largest gear's 16 sequences
INPUTS = [[int(x) for x in np.random.default_rng(i).integers(1, 255, n)]
          for i, n in enumerate([3, 17, 128, 129, 200, 256, 1, 40] + [9] * 12)]


def test_embeddings_on_the_fake_acl_equal_the_ort_bundles(bundles: dict[str, Path]) -> None:
    """Every input's embedding (and a matryoshka truncation) through the ACL executor equals the ORT bundle's
    (float32 on both: the fake runs the plain twin); the batch took several gear runs; nothing failed or leaked."""
    from omforge import LLM

    fake = FakeAcl()
    with LLM(bundles["embed"], acl_module=fake) as llm:
        got = llm.embed(INPUTS)
        short = llm.embed(INPUTS[:4], dimensions=16)
        executor = llm.engine.executor
        assert type(executor).__name__ == "AclPoolingExecutor"
    with LLM(bundles["embed-ort"]) as ref_llm:
        want = ref_llm.embed(INPUTS)
        want_short = ref_llm.embed(INPUTS[:4], dimensions=16)
    for g, w in zip(got + short, want + want_short):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, atol=1e-4)
    assert fake.calls.count("execute") > 2  # lengths 256 and 16+ sequences: more than one gear per step
    assert not [c for c in fake.calls if c.startswith("FAILED")] and fake.live == []


def test_scores_on_the_fake_acl_equal_the_ort_bundles(bundles: dict[str, Path]) -> None:
    from omforge import LLM

    fake = FakeAcl()
    with LLM(bundles["score"], acl_module=fake) as llm:
        engine = llm.engine
        got = engine.run(INPUTS[:8])
    with LLM(bundles["score-ort"]) as ref_llm:
        want = ref_llm.engine.run(INPUTS[:8])
    np.testing.assert_allclose(np.concatenate(got), np.concatenate(want), atol=1e-5)
    assert not [c for c in fake.calls if c.startswith("FAILED")] and fake.live == []


def test_pooling_runs_split_a_batch_into_gears() -> None:
    """Consecutive groups, each on the gear with the fewest padded tokens that holds it; a sequence longer than
    every gear is refused in one line; padding keeps each sequence's last token as its pooled row."""
    from omforge.errors import OmforgeError
    from omforge.runtime.ascend.acl_pooling import pad_to_gear, pooling_runs
    from omforge.runtime.pooling import pack

    gears = [(1, 128), (1, 256), (8, 256), (16, 128)]
    assert pooling_runs([5, 7], gears) == [(range(0, 2), (16, 128))]
    assert pooling_runs([5, 200, 7], gears) == [(range(0, 3), (8, 256))]
    runs = pooling_runs([200] * 9 + [3] * 20, gears)
    assert runs == [(range(0, 8), (8, 256)), (range(8, 16), (8, 256)), (range(16, 29), (16, 128))]
    with pytest.raises(OmforgeError, match="longer than every compiled gear") as e:
        pooling_runs([3, 300], gears)
    assert "\n" not in str(e.value)
    batch = [[4, 5, 6], [7], [8, 9, 10, 11, 12]]
    packed = pack(batch)
    feeds = pad_to_gear(packed, range(1, 3), (4, 8))
    assert feeds["input_ids"].shape == (4, 8) and feeds["position_ids"][3].tolist() == list(range(8))
    assert feeds["input_ids"][1, :5].tolist() == batch[2] and not feeds["input_ids"][2:].any()
    flat = feeds["input_ids"].reshape(-1)
    assert flat[feeds["pool_index"][:2]].tolist() == [7, 12]


def test_verify_checks_every_pooling_gear(bundles: dict[str, Path]) -> None:
    from omforge.contract.manifest import load_manifest
    from omforge.verify import verify

    lines: list[str] = []
    assert verify(bundles["embed"], bundles["recipe-embed"], acl=FakeAcl(), say=lines.append)
    gears = load_manifest(bundles["embed"]).ascend.gears
    assert lines[0].startswith("mode: pooling (task embed)")
    per_gear = [line for line in lines if line.startswith(("pass", "FAIL"))]
    assert len(per_gear) == len(gears) and all(line.startswith("pass  pool") and "pooled" in line
                                               for line in per_gear)
    assert lines[-1].startswith(f"{len(gears)}/{len(gears)} gears within tolerance")
